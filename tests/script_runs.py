"""Running a training script on the CPU and on the device and comparing what it prints.

Shared by the real-scripts suite (``test_real_scripts.py``) and the zoo (``test_zoo.py``).
A script prints ``result KEY VALUE`` lines (the numbers compared) and may print
``timing step_ms X`` (milliseconds per step, reported, never asserted). The CPU run is the
original script under plain PyTorch (torchport never imported); the device runs are
``torchport run`` (the CUDA script unchanged), the ``torchport migrate`` output run by
``python``, and ``torchport coverage``. A case launched by ``torchrun`` runs each way under
``torch.distributed.run`` (``--no-python torchport run`` for the unchanged script).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.helpers import free_port

WAYS = ("run", "migrate", "coverage")


@dataclass
class Case:
    script: str
    args: list[str]
    rel: float = 0.0  # 0: bit for bit
    cpu_args: list[str] | None = None  # the CPU run's arguments, when they differ
    env: dict[str, str] = field(default_factory=dict)
    quick: tuple[str, ...] = ()  # the ways make test runs
    ways: tuple[str, ...] = WAYS
    scale: dict[str, float] = field(default_factory=dict)  # expected = CPU value x scale
    timeout: float = 300
    torchrun: int = 0  # processes torchrun starts (0: plain python)
    needs: tuple[str, ...] = ()  # modules the script imports (skipped, named, when missing)
    why: str = ""  # why the numbers are not bit for bit, when rel > 0


def env_for(extra: dict[str, str], torchport: bool) -> dict[str, str]:
    """The environment of a run: no TORCHPORT_ setting leaks but the sim's mode."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHPORT_")
           or k.startswith(("TORCHPORT_SIM_", "TORCHPORT_NATIVE"))}
    env.update(OMP_NUM_THREADS="1", TORCHPORT_FALLBACK_WARN="0", PYTHONHASHSEED="0")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    if torchport:
        env.update(extra)
    return env


def results(stdout: str) -> dict[str, str]:
    return dict(m.groups() for m in re.finditer(r"^result (\S+) (.*)$", stdout, re.M))


def step_ms(stdout: str) -> float | None:
    m = re.search(r"^timing step_ms (\S+)$", stdout, re.M)
    return float(m.group(1)) if m else None


def numbers(text: str) -> list[float]:
    return [float(v) for v in re.findall(r"-?\d+\.?\d*(?:e[-+]?\d+)?", text)]


def call(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float
         ) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, (cmd, out.stdout[-3000:], out.stderr[-5000:])
    return out


def skip_missing(case: Case) -> None:
    """Skip, naming the module, when the script needs a library this venv lacks."""
    for name in case.needs:
        pytest.importorskip(name, reason=f"{case.script} needs {name} (make zoo installs the "
                                         f"zoo extra)")


def launcher(case: Case, unchanged_on_device: bool) -> list[str]:
    """The command before the script: python, torchport run, or torchrun with either."""
    if case.torchrun:
        head = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                str(case.torchrun), "--master-port", str(free_port())]
        return [*head, "--no-python", "torchport", "run"] if unchanged_on_device else head
    if unchanged_on_device:
        return [sys.executable, "-m", "torchport.tools.cli", "run"]
    return [sys.executable]


def with_port(case: Case, args: list[str]) -> list[str]:
    return [*args, "--port", str(free_port())] if case.script == "ddp_spawn.py" else args


_CPU: dict[tuple[str, ...], subprocess.CompletedProcess[str]] = {}


def cpu_run(case: Case, scripts: Path, tmp: Path) -> subprocess.CompletedProcess[str]:
    """The original script on the CPU with plain PyTorch (torchport never imported)."""
    args = case.cpu_args if case.cpu_args is not None else case.args
    key = (str(scripts), case.script, *args)
    if key not in _CPU:
        _CPU[key] = call([*launcher(case, False), str(scripts / case.script),
                          *with_port(case, args)], tmp, env_for({}, torchport=False),
                         case.timeout)
    return _CPU[key]


def migrate(scripts: Path, dst: Path) -> Path:
    """``torchport migrate`` of a folder of scripts into ``dst``; returns ``dst``."""
    subprocess.run([sys.executable, "-m", "torchport.tools.cli", "migrate", str(scripts), "-o",
                    str(dst), "--report", str(dst.parent / f"{dst.name}-report")],
                   check=True, capture_output=True, text=True, env=env_for({}, torchport=True),
                   timeout=300)
    return dst


def device_run(case: Case, way: str, scripts: Path, migrated: Path, tmp: Path
               ) -> subprocess.CompletedProcess[str]:
    """The script on the device one way: run (unchanged), migrate, or coverage."""
    env = env_for(case.env, torchport=True)
    args = with_port(case, case.args)
    if way == "run":
        cmd = [*launcher(case, True), str(scripts / case.script), *args]
    elif way == "migrate":
        cmd = [*launcher(case, False), str(migrated / case.script), *args]
    else:
        cmd = [sys.executable, "-m", "torchport.tools.cli", "coverage", "--json",
               str(tmp / "cov.json"), "-q", str(scripts / case.script), *args]
    out = call(cmd, tmp, env, case.timeout)
    if way == "migrate":
        assert "torchport.transfer" not in out.stderr  # the rewritten code stands alone
    if way == "coverage":
        cov = json.loads((tmp / "cov.json").read_text())
        assert sum(o["calls"] for o in cov["ops"]) > 0 and cov["exit_code"] == 0
    return out


def assert_same_results(case: Case, got_out: str, want_out: str) -> None:
    """The device's printed results against the CPU's: equal, or within ``case.rel``."""
    got, want = results(got_out), results(want_out)
    assert got.keys() == want.keys() and got, (got, want, got_out[-2000:])
    for key in want:
        if case.rel == 0.0:
            assert got[key] == want[key], (key, got[key], want[key])
        else:
            a = numbers(got[key])
            b = [v * case.scale.get(key, 1.0) for v in numbers(want[key])]
            assert len(a) == len(b) and a == pytest.approx(b, rel=case.rel, abs=case.rel), key
