"""The package's `# type: ignore`s (docs/development.rst, Types): few, each for a dependency's
hints, each with its reason, and each one that a dependency whose hints catch up makes unneeded
(`unused-ignore`) rather than an error under mypy --strict."""

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "animal_store"
IGNORE = re.compile(r"# type: ignore\[([^\]]*)\]")
MOST = 3


def test_the_package_has_few_type_ignores_each_with_its_reason():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines):
            if "type: ignore" not in line:
                continue
            where = f"{path.relative_to(PACKAGE.parent)}:{number + 1}"
            found.append(where)
            codes = IGNORE.search(line)
            assert codes, f"{where}: an ignore names its error codes"
            assert "unused-ignore" in codes.group(1).split(", "), f"{where}: no unused-ignore"
            # The reason: a comment on the line or on those just above it.
            above = [lines[before].strip() for before in range(max(0, number - 3), number)]
            assert any(text.startswith("#") for text in above), f"{where}: no reason given"
    assert len(found) <= MOST, found
