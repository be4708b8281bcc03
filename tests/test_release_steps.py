"""What a release is and how one is put into service, as docs/development.rst (Releasing) and
docs/operations.rst (Upgrading) write them: main between releases says it is not the last release,
and the upgrade's steps stop at the first one that fails."""

import re
import subprocess

import pytest
from nginx_server import PROJECT_DIR
from packaging.version import Version

from animal_store.version import VERSION

CHANGELOG = (PROJECT_DIR / "CHANGELOG.rst").read_text()
# A release's heading: its version, then the commit it was made from once that commit exists.
RELEASE_HEADING = re.compile(r"^(\d+\.\d+\.\d+)(?: \(commit [0-9a-f]{40}\))?\n-+$", re.MULTILINE)


def unreleased_changes() -> str:
    """The text under the changelog's Unreleased heading, '' without one."""
    found = re.search(
        r"^Unreleased\n-+\n(.*?)(?=^\S[^\n]*\n-+$)", CHANGELOG, re.MULTILINE | re.DOTALL
    )
    return found.group(1).strip() if found else ""


def test_version_between_releases_is_a_development_release():
    version = Version(VERSION)  # PEP 440, or this raises
    releases = [Version(number) for number in RELEASE_HEADING.findall(CHANGELOG)]
    assert releases, "CHANGELOG.rst names no release"
    if unreleased_changes() or version != max(releases):
        # Main after a release: the next release's .devN, so the logs and animal_store_build_info
        # never pass it off as the release before it.
        assert version.is_devrelease, f"{VERSION} is main's, after {max(releases)}"
        assert version > max(releases)
    # Otherwise this is the release commit itself: the newest heading, nothing unreleased.


# The upgrade's commands in docs/operations.rst (Upgrading), as an operator pastes them.
UPGRADE_BLOCK = re.search(
    r"^Upgrading\n-+\n.*?::\n\n((?:    [^\n]*\n|\n)+)",
    (PROJECT_DIR / "docs" / "operations.rst").read_text(),
    re.MULTILINE | re.DOTALL,
).group(1)


def upgrade_script(checkout, commit) -> str:
    """docs/operations.rst's steps for a checkout elsewhere than /srv/animal-store."""
    return UPGRADE_BLOCK.replace("/srv/animal-store", str(checkout)).replace(
        "<the release's commit>", commit
    )


def test_upgrade_with_a_mistyped_commit_stops_before_anything_changes(tmp_path):
    checkout = tmp_path / "animal-store"
    subprocess.run(
        ["git", "clone", "--quiet", "--no-checkout", str(PROJECT_DIR), str(checkout)],
        check=True,
        timeout=120,
    )
    # Pasted into an interactive shell: bash reading the block from its standard input, every
    # command it runs traced.
    result = subprocess.run(
        ["bash", "-x"],
        input=upgrade_script(checkout, "0123abc"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    ran = [line for line in result.stderr.splitlines() if line.startswith("+")]
    assert result.returncode != 0, result.stderr
    # It stopped at the first failure (the checkout, or runuser where the service's user does
    # not exist): no install, no migration, no reload of the old release.
    assert not [line for line in ran if re.search(r"\b(pip|flask|systemctl|chown)\b", line)], ran


@pytest.mark.parametrize("placeholder", ["/srv/animal-store", "<the release's commit>"])
def test_upgrade_block_names_what_the_operator_fills_in(placeholder):
    assert placeholder in UPGRADE_BLOCK
