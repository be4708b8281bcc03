"""The package's folders are its layers (docs/development.rst, The package's folders): each
imports only those below it, and no modules or folders import each other in a circle. The
contracts are setup.cfg's [importlinter]; import-linter reads every import, those inside
functions too."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """Run lint-imports on the package found first under `root`."""
    command = Path(sys.executable).parent / "lint-imports"
    return subprocess.run(
        [str(command), "--no-cache"],
        cwd=root,
        capture_output=True,
        text=True,
        check=False,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
    )


def test_every_layer_imports_only_those_below_it():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 kept, 0 broken" in result.stdout


def test_an_import_from_the_data_layer_up_to_the_web_is_refused(tmp_path):
    # The same contracts on a copy of the package where the store reaches up for the API layer,
    # so the check above is known to see what it is there to catch.
    copy = tmp_path / "tree"
    shutil.copytree(ROOT / "animal_store", copy / "animal_store")
    shutil.copy(ROOT / "setup.cfg", copy / "setup.cfg")
    store = copy / "animal_store" / "data" / "store.py"
    store.write_text(store.read_text() + "\nfrom animal_store.api import layer  # noqa\n")
    result = lint_imports(copy)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "animal_store.data.store -> animal_store.api.layer" in result.stdout
