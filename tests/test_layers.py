"""torchport's layers (pyproject.toml, [tool.importlinter]; docs/architecture.md, Layers).

``lint-imports`` checks the source as ``make lint`` does; then a copy of the package with
one upward import added must break the contract, whichever way the import is written. The
package root holds only what docs/architecture.md's Layout names.
"""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "torchport"
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
# import-linter comes with the test extra; a venv without it (a bare install) skips the
# contract's tests rather than failing them.
NEEDS_LINT_IMPORTS = pytest.mark.skipif(
    not LINT_IMPORTS.exists(), reason="lint-imports is not installed (pip install -e '.[test]')")


def lint_imports(src: Path) -> subprocess.CompletedProcess:
    """Run the contract on the package under ``src`` (a subprocess: this process has
    imported the real torchport, and import-linter finds packages through sys.path)."""
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=src, env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=60)


@NEEDS_LINT_IMPORTS
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


@NEEDS_LINT_IMPORTS
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


def _python(code: str, **env: str) -> str:
    """Run ``code`` in a fresh interpreter on this checkout; its stdout."""
    import os
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT / "src"),
                                         **env})
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


# What each leaf module loads of torchport today: itself and its packages.
# (each with its packages, and torchport.core.lazy, which resolves their names)
LEAF_MODULES = {"torchport.ops.plan": 5, "torchport.core.settings": 4, "torchport.runtime": 4}


@pytest.mark.parametrize("leaf", sorted(LEAF_MODULES))
def test_importing_a_leaf_module_loads_only_what_it_needs(leaf: str):
    # the package __init__s resolve their names lazily: neither registration (backend)
    # nor the op layer's fallback and registry come with a leaf
    out = _python(f"import sys, {leaf}\n"
                  "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torchport'))")
    loaded = eval(out)
    assert leaf in loaded and len(loaded) <= LEAF_MODULES[leaf], loaded
    assert "torchport.backend" not in loaded and "torchport.ops.registry" not in loaded


def test_every_public_name_of_the_packages_resolves():
    out = _python(
        "import importlib, sys, torchport, torchport.ops\n"
        "for pkg in (torchport, torchport.ops):\n"
        "    assert set(pkg.__all__) <= set(dir(pkg)), pkg\n"
        "    for name in pkg.__all__:\n"
        "        value = getattr(pkg, name)\n"
        "        exec(f'from {pkg.__name__} import {name} as again')\n"
        "        assert again is value, name\n"
        "        where = getattr(value, '__module__', None)\n"
        "        if where is not None and where.startswith('torchport'):\n"
        "            assert getattr(importlib.import_module(where), name, value) is value\n"
        "    try:\n"
        "        pkg.no_such_name\n"
        "    except AttributeError as e:\n"
        "        assert 'no_such_name' in str(e)\n"
        "    else:\n"
        "        raise AssertionError('a missing name resolved')\n"
        "from torchport import Backend\n"
        "from torchport.ops import KernelSet\n"
        "print(torchport.Backend is Backend, torchport.ops.KernelSet is KernelSet,\n"
        "      torchport.__version__)\n"
        "from torchport.ops import *\n"
        "print(sorted(k for k in torchport.ops.__all__ if k not in globals()))\n")
    assert out.split("\n")[:2] == ["True True 0.1.0", "[]"], out


def test_import_torchport_still_registers_what_it_registered():
    # the autoload entry point and `import torchport.sim` register the backend, with the
    # feature layers installed, whatever was imported of torchport first
    out = _python("import torch, torchport\n"
                  "print(torch._C._get_privateuse1_backend_name(), torchport.active_backend().name,"
                  " hasattr(torch.sim, 'Stream'))", TORCHPORT_AUTOLOAD="sim")
    assert out.split() == ["sim", "sim", "True"], out
    out = _python("import torchport, torchport.ops, torch\n"
                  "import torchport.sim\n"
                  "print(torchport.active_backend() is torchport.sim.BACKEND, torch.sim.amp.__name__)")
    assert out.split() == ["True", "torch.sim.amp"], out


def test_importing_a_feature_module_changes_no_device_module():
    # every feature module imported before any backend: nothing is registered by that; a
    # device module made then has the declared names only; registering installs them all
    out = _python(
        "import importlib, sys\n"
        "from multiprocessing.reduction import ForkingPickler\n"
        "import torch, torch.multiprocessing.reductions\n"
        "reducer = ForkingPickler._extra_reducers.get(torch.UntypedStorage)\n"
        "from torchport import features\nfrom torchport.device import device_module\n"
        "from torchport.ops import hooks\n"
        "for name in features.FEATURE_MODULES:\n"
        "    importlib.import_module(name)\n"
        "print(ForkingPickler._extra_reducers.get(torch.UntypedStorage) is reducer)\n"
        "print(len(hooks._ENV_STARTERS))\n"
        "from torchport.backend import Backend\n"
        "from torchport.backends.sim.runtime import SimRuntime\n"
        "mod = device_module.make_device_module(Backend('npu', SimRuntime(num_devices=1,"
        " memory=1 << 20)))\n"
        "print(sorted(n for n in vars(mod) if not n.startswith('_')) =="
        " sorted(device_module.EXPORTS))\n"
        "import torchport.sim\n"
        "print(ForkingPickler._extra_reducers.get(torch.UntypedStorage) is reducer)\n"
        "print(len(hooks._ENV_STARTERS))\n"
        "print(all(hasattr(torch.sim, n) for n in ('Stream', 'Event', 'amp',"
        " 'init_device_from_env')), 'torch.sim.amp' in sys.modules)\n")
    assert out.split() == ["True", "0", "True", "False", "1", "True", "True"], out


def test_two_hooks_on_one_module_import_both_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the ocl backend and torchport's dynamo feature both wait for dynamo's trace_rules
    from torchport.core import lazy

    (tmp_path / "tp_lazy_probe.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[str] = []
    lazy.when_imported("tp_lazy_probe", lambda m: seen.append(f"first {m.VALUE}"))
    lazy.when_imported("tp_lazy_probe", lambda m: seen.append(f"second {m.VALUE}"))
    import tp_lazy_probe  # noqa: F401

    assert seen == ["first 1", "second 1"]
    lazy.when_imported("tp_lazy_probe", lambda m: seen.append("later"))  # already imported
    assert seen[-1] == "later"


def _documented_layout() -> set[str]:
    """The top-level entries of src/torchport/ that docs/architecture.md's Layout block
    names: its lines indented by two spaces, each a path (or paths, comma-separated) then
    its description; ``ops/plan.py`` names ``ops``."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    lines = block.split("src/torchport/\n", 1)[1].splitlines()
    names = set()
    for line in lines:
        if not line.startswith("  "):
            break  # the next top-level entry (src/_torchport_autoload/)
        if line.startswith("   "):
            continue  # a subfolder's entry or a description's continuation
        paths = re.match(r"  ((?:[\w./]+, )*[\w./]+)", line).group(1)
        names |= {path.split("/")[0] for path in paths.split(", ")}
    return names


def test_the_package_root_holds_only_the_documented_modules():
    """src/torchport/ holds the public modules and the layer folders, each named in
    docs/architecture.md's Layout; a module moved into a layer leaves no file (or empty
    folder, which Python would import as a namespace package) behind."""
    documented = _documented_layout()
    assert {"__init__.py", "runtime.py", "backend.py", "core", "ops", "tools"} <= documented
    present = {p.name for p in PACKAGE.iterdir() if p.name != "__pycache__"}
    assert present == documented, (
        f"src/torchport/ and docs/architecture.md's Layout differ: not documented "
        f"{sorted(present - documented)}, documented but missing {sorted(documented - present)}")
