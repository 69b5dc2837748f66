"""A plain ``pip install .`` (no extras) gives a working ``torchport`` command.

The checkout is installed, not in editable mode, into a fresh virtual environment that
has nothing but torch (and what torch itself requires, linked from this interpreter's
environment, so that torch's gigabytes are not installed again), not even pip: this
interpreter's pip (``pip --python``) installs the project's declared dependencies from the package index as a user's
``pip install .`` does. Every command's ``--help`` and a tiny ``torchport run`` (and
``coverage``, ``migrate``, ``info``) must work there, in a directory outside the checkout,
with none of the test extra's packages present: a module importing something only the
extras bring fails here, not on a user's machine.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.tools

ROOT = Path(__file__).resolve().parent.parent
#: Packages the test extra brings (and import names of them): none may be importable.
EXTRAS_ONLY = ("pytest", "importlinter", "transformers", "accelerate", "ruff")
COMMANDS = ("info", "migrate", "run", "coverage", "compare-dumps")

SCRIPT = """\
import argparse
import torch
p = argparse.ArgumentParser(); p.add_argument("--n", type=int, default=3)
n = p.parse_args().n
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
x = torch.arange(n, dtype=torch.float32).to(dev)
w = torch.nn.Linear(n, 2).cuda()
print("result", x.device.type, round(float((x * 2).sum()), 3), w(x).shape[0])
"""


def _requirements(dist: md.Distribution) -> list[str]:
    """The names of the distributions ``dist`` requires here (markers evaluated, no
    extras), as pip would install them."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pip vendors it
        from pip._vendor.packaging.requirements import Requirement
    names = []
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            names.append(req.name)
    return names


def _closure(name: str) -> list[md.Distribution]:
    """``name``'s installed distribution and every one it requires, recursively."""
    seen: dict[str, md.Distribution] = {}
    todo = [name]
    while todo:
        key = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if key in seen:
            continue
        try:
            dist = md.distribution(key)
        except md.PackageNotFoundError:
            continue  # an optional requirement this environment lacks
        seen[key] = dist
        todo.extend(_requirements(dist))
    return list(seen.values())


def _link_torch(site: Path) -> list[str]:
    """Link torch and its requirements (their files' top-level entries, metadata included,
    so pip counts them installed) into ``site``; the distributions' names."""
    linked = []
    for dist in _closure("torch"):
        base = Path(dist.locate_file(""))
        tops = {Path(f).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in sorted(tops):
            src, dst = base / top, site / top
            if src.exists() and not dst.exists() and top != "__pycache__":
                dst.symlink_to(src)
        linked.append(dist.metadata["Name"])
    return linked


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh environment with torch linked in and the checkout pip-installed (no extras)."""
    where = tmp_path_factory.mktemp("clean")
    env_dir = where / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True,
                   timeout=300)
    py = env_dir / "bin" / "python"
    site = Path(subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True).stdout.strip())
    linked = _link_torch(site)
    assert "torch" in linked
    # a copy of the checkout's tracked files: pip's build must not write into the checkout
    src = where / "src"
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns(
        "__pycache__", "*.egg-info", "*.so"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    # the torch linked in stays: a pip constraint elsewhere (a machine's cap) must not
    # make pip replace it, as it stays where a user installs the project beside their torch
    pin = where / "constraints.txt"
    pin.write_text(f"torch=={md.version('torch')}\n")
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q",
                        str(src)], capture_output=True, text=True, timeout=900,
                       env={**_env(), "PIP_CONSTRAINT": str(pin)})
    assert r.returncode == 0, r.stdout + r.stderr
    return env_dir


def _env() -> dict[str, str]:
    """The environment of a user's shell: no PYTHONPATH, no torchport settings."""
    env = {k: v for k, v in os.environ.items()
           if k != "PYTHONPATH" and not k.startswith("TORCHPORT_")}
    return env


def _run(venv: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    exe = args[0] if args[0].startswith("/") else str(venv / "bin" / args[0])
    return subprocess.run([exe, *args[1:]], capture_output=True, text=True, timeout=300,
                          cwd=cwd, env=_env())


def test_no_extras_are_installed_and_torchport_is_the_copy(venv: Path, tmp_path: Path):
    code = ("import importlib.util as u, torchport; "
            f"print([m for m in {EXTRAS_ONLY!r} if u.find_spec(m)]); print(torchport.__file__)")
    r = _run(venv, "python", "-c", code, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    found, where = r.stdout.splitlines()[-2:]
    assert found == "[]", found
    assert where.startswith(str(venv)), where  # installed, not the checkout's src


def test_import_sim(venv: Path, tmp_path: Path):
    r = _run(venv, "python", "-c",
             "import torch, torchport.sim; x = torch.ones(2, device='sim'); "
             "print((x + 1).sum().item())", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[-1] == "4.0"


def test_every_command_has_help(venv: Path, tmp_path: Path):
    top = _run(venv, "torchport", "--help", cwd=tmp_path)
    assert top.returncode == 0, top.stderr
    for name in COMMANDS:
        assert name in top.stdout, name
        r = _run(venv, "torchport", name, "--help", cwd=tmp_path)
        assert r.returncode == 0 and "Usage" in r.stdout, (name, r.stdout + r.stderr)
    for module in ("torchport.tools.run", "torchport.tools.conformance"):
        r = _run(venv, "python", "-m", module, "--help", cwd=tmp_path)
        assert r.returncode == 0 and "usage" in r.stdout.lower(), (module, r.stdout + r.stderr)


def test_run_coverage_migrate_and_info(venv: Path, tmp_path: Path):
    script = tmp_path / "tiny.py"
    script.write_text(SCRIPT)
    r = _run(venv, "torchport", "run", str(script), "--n", "4", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.split()[-4:] == ["result", "sim", "12.0", "2"], r.stdout
    r = _run(venv, "torchport", "run", "-b", "nosuch", str(script), cwd=tmp_path)
    assert r.returncode == 2 and "unknown backend 'nosuch'" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr  # a usage error, not the script's
    r = _run(venv, "torchport", "coverage", str(script), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "op coverage" in r.stdout and "native" in r.stdout, r.stdout
    r = _run(venv, "torchport", "migrate", str(script), "-o", str(tmp_path / "out.py"),
             cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert ".cuda()" not in (tmp_path / "out.py").read_text()
    r = _run(venv, "torchport", "info", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
