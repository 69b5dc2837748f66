"""torchport's layers (pyproject.toml, [tool.importlinter]; docs/architecture.md, Layers).

``lint-imports`` checks the source as ``make lint`` does; then a copy of the package with
one upward import added must break the contract, whichever way the import is written.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "torchport"
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(src: Path) -> subprocess.CompletedProcess:
    """Run the contract on the package under ``src`` (a subprocess: this process has
    imported the real torchport, and import-linter finds packages through sys.path)."""
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=src, env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=60)


def test_the_source_keeps_its_layers():
    r = lint_imports(ROOT / "src")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "torchport layers KEPT" in r.stdout and "torchport.ops layers KEPT" in r.stdout


UPWARD = {
    "module level": "from torchport.backend import Backend  # noqa\n",
    "in a function": "def _f():\n    from torchport.backend import Backend  # noqa\n",
    "for type checking": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                         "    from torchport.backend import Backend  # noqa\n",
}


@pytest.mark.parametrize("how", sorted(UPWARD))
def test_an_upward_import_breaks_the_layers(tmp_path: Path, how: str):
    copy = tmp_path / "torchport"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns(
        "__pycache__", "*.so", "*.cpp", "*.h"))
    with open(copy / "runtime.py", "a") as f:  # the bottom layer reaches registration
        f.write("\n" + UPWARD[how])
    r = lint_imports(tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "torchport layers BROKEN" in r.stdout
    assert "torchport.runtime -> torchport.backend" in r.stdout, r.stdout
