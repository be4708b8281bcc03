"""The locks install what setup.cfg asks for.

requirements.txt and requirements-test.txt are made from setup.cfg by uv (docs/development.rst,
Locks), and nothing remakes them when setup.cfg changes. These tests fail until someone does, so
a requirement added to or raised in setup.cfg cannot be missing from, or older in, what
``pip install --require-hashes`` installs, and the two locks cannot drift apart.
"""

import configparser
import re
from importlib import metadata
from pathlib import Path
from typing import NamedTuple

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

PROJECT_DIR = Path(__file__).resolve().parent.parent


class Pin(NamedTuple):
    version: str
    marker: Marker | None
    hashes: list[str]


def read_lock(name: str) -> dict[str, list[Pin]]:
    """Each pinned distribution's pins: more than one when the lock forks on a marker."""
    # A pin and its hashes are one logical line, continued with backslashes.
    text = (PROJECT_DIR / name).read_text().replace("\\\n", " ")
    pins: dict[str, list[Pin]] = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        pinned, *hashes = re.split(r"\s*--hash=", line)
        requirement = Requirement(pinned)
        (version,) = (spec.version for spec in requirement.specifier if spec.operator == "==")
        pin = Pin(version, requirement.marker, hashes)
        pins.setdefault(canonicalize_name(requirement.name), []).append(pin)
    return pins


def read_setup_cfg() -> tuple[list[Requirement], list[Requirement]]:
    """install_requires and the test extra."""
    # setuptools reads setup.cfg without interpolation too.
    config = configparser.ConfigParser(interpolation=None)
    config.read(PROJECT_DIR / "setup.cfg")

    def requirements(value: str) -> list[Requirement]:
        return [Requirement(line) for line in value.splitlines() if line.strip()]

    return (
        requirements(config["options"]["install_requires"]),
        requirements(config["options.extras_require"]["test"]),
    )


BASE_LOCK, TEST_LOCK = "requirements.txt", "requirements-test.txt"
INSTALL_REQUIRES, TEST_EXTRA = read_setup_cfg()
# What each lock has to hold, as `pip install .` and `pip install '.[test]'` would ask for it.
LOCKED = {BASE_LOCK: INSTALL_REQUIRES, TEST_LOCK: INSTALL_REQUIRES + TEST_EXTRA}
PINS = {lock: read_lock(lock) for lock in LOCKED}


def pins_here(lock: str, name: str) -> list[Pin]:
    """The pins of a distribution this Python installs (the locks fork on the Python version)."""
    pins = PINS[lock].get(canonicalize_name(name), [])
    return [pin for pin in pins if pin.marker is None or pin.marker.evaluate()]


def extra_distributions(requirement: Requirement) -> list[str]:
    """The distributions its extras add (psycopg[binary]: psycopg-binary), as installed."""
    names = []
    for line in metadata.requires(requirement.name) or []:
        needed = Requirement(line)
        # A requirement belongs to an extra if its marker holds with that extra and not without.
        for extra in requirement.extras:
            marker = needed.marker
            if marker and marker.evaluate({"extra": extra}) and not marker.evaluate({"extra": ""}):
                names.append(needed.name)
    return names


@pytest.mark.parametrize(
    ("lock", "requirement"),
    [
        pytest.param(lock, requirement, id=f"{lock}-{requirement.name}")
        for lock, requirements in LOCKED.items()
        for requirement in requirements
    ],
)
def test_setup_cfg_requirement_is_pinned(lock, requirement):
    if requirement.marker and not requirement.marker.evaluate():
        pytest.skip(f"{requirement} is not for this Python")
    pins = pins_here(lock, requirement.name)
    assert pins, f"{requirement.name} is not pinned in {lock}"
    for pin in pins:
        assert requirement.specifier.contains(pin.version, prereleases=True), (
            f"{lock} pins {requirement.name}=={pin.version}, setup.cfg asks for {requirement}"
        )
    for name in extra_distributions(requirement):
        assert pins_here(lock, name), f"{name} ({requirement}) is not pinned in {lock}"


@pytest.mark.parametrize("name", sorted(PINS[BASE_LOCK]))
def test_base_pin_is_the_test_pin(name):
    # The tests must run on what is deployed.
    def versions(lock):
        return sorted((pin.version, str(pin.marker)) for pin in PINS[lock].get(name, []))

    assert versions(TEST_LOCK) == versions(BASE_LOCK), f"the locks pin {name} differently"


@pytest.mark.parametrize("lock", LOCKED)
def test_every_pin_has_a_hash(lock):
    # pip refuses the whole lock with --require-hashes if one pin has none.
    unhashed = [name for name, pins in PINS[lock].items() for pin in pins if not pin.hashes]
    assert unhashed == []
