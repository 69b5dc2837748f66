"""Typical CUDA training scripts (examples/scripts/), each run three ways on the sim --
``torchport run`` unchanged, ``torchport migrate`` then plain ``python``, and ``torchport
coverage`` -- against the original run by plain PyTorch on the CPU (no torchport).

The scripts are written in the styles found in the wild: pytorch/examples' current
``torch.accelerator`` style with ``pin_memory`` in a kwargs dict, the older ``.cuda()`` style
with checkpoint resume through ``map_location=f"cuda:{gpu}"``, ``mp.spawn`` DDP over NCCL,
``nn.DataParallel``, a Hugging Face ``Trainer`` fine-tune (fp32, bf16, fp16) and an
``accelerate`` loop. Every way must end with exit 0 and print the CPU's numbers: bit for bit
where the device does the same math; with a tolerance only where the work is split
differently (DataParallel's and DDP's gradient sums) or precision is lowered (bf16/fp16).

``make test`` runs a subset; ``TORCHPORT_FULL_SCRIPTS=1`` (``make examples``) runs all.
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

pytestmark = [pytest.mark.strict, pytest.mark.scripts]

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "examples" / "scripts"
FULL = os.environ.get("TORCHPORT_FULL_SCRIPTS", "") not in ("", "0")
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


CASES = {
    "mnist": Case("mnist_accelerator.py", ["--epochs", "1", "--dropout", "0"],
                  quick=("run", "migrate")),
    "classic": Case("classic_cuda.py", ["--epochs", "2"]),
    "data_parallel": Case("data_parallel.py", ["--steps", "3"], rel=1e-12),
    "ddp_spawn": Case("ddp_spawn.py", ["--epochs", "1"], rel=1e-6, timeout=400),
    "trainer_fp32": Case("hf_trainer.py", ["--steps", "4"],
                         env={"TORCHPORT_VISIBLE_DEVICES": "0"}),
    # Under transfer the Trainer sees two GPUs: nn.DataParallel over sim:0/sim:1 with 4
    # samples each, against one CPU batch of 8; transformers logs the loss times n_gpu
    # there (trainer.py: ``loss *= ... n_gpu``), as on two GPUs. Migrated, the device is
    # one device per process (as transformers treats XPU/NPU): no DataParallel.
    "trainer_dp": Case("hf_trainer.py", ["--steps", "4", "--batch-size", "4"], rel=1e-4,
                       cpu_args=["--steps", "4", "--batch-size", "8"], ways=("run", "coverage"),
                       scale={"losses": 2.0}),
    "trainer_bf16": Case("hf_trainer.py", ["--steps", "4", "--precision", "bf16"], rel=5e-2,
                         cpu_args=["--steps", "4"], env={"TORCHPORT_VISIBLE_DEVICES": "0"}),
    "trainer_fp16": Case("hf_trainer.py", ["--steps", "4", "--precision", "fp16"], rel=5e-2,
                         cpu_args=["--steps", "4"], env={"TORCHPORT_VISIBLE_DEVICES": "0"}),
    "accelerate": Case("accelerate_loop.py", ["--steps", "6"],
                       env={"TORCHPORT_VISIBLE_DEVICES": "0"}),
    "accelerate_bf16": Case("accelerate_loop.py", ["--steps", "6", "--mixed-precision", "bf16"],
                            rel=5e-2, cpu_args=["--steps", "6"],
                            env={"TORCHPORT_VISIBLE_DEVICES": "0"}),
}


def _env(extra: dict[str, str], torchport: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHPORT_")
           or k.startswith(("TORCHPORT_SIM_", "TORCHPORT_NATIVE"))}
    env.update(OMP_NUM_THREADS="1", TORCHPORT_FALLBACK_WARN="0", PYTHONHASHSEED="0")
    if torchport:
        env.update(extra)
    return env


def _results(stdout: str) -> dict[str, str]:
    return dict(m.groups() for m in re.finditer(r"^result (\S+) (.*)$", stdout, re.M))


def _numbers(text: str) -> list[float]:
    return [float(v) for v in re.findall(r"-?\d+\.?\d*(?:e[-+]?\d+)?", text)]


def _call(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float
          ) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, (cmd, out.stdout[-3000:], out.stderr[-5000:])
    return out


_CPU: dict[tuple[str, ...], dict[str, str]] = {}


def _cpu(case: Case, tmp: Path) -> dict[str, str]:
    """The original script on the CPU with plain PyTorch (torchport never imported)."""
    args = case.cpu_args if case.cpu_args is not None else case.args
    key = (case.script, *args)
    if key not in _CPU:
        out = _call([sys.executable, str(SCRIPTS / case.script), *_port(case, args)], tmp,
                    _env({}, torchport=False), case.timeout)
        _CPU[key] = _results(out.stdout)
    return _CPU[key]


def _port(case: Case, args: list[str]) -> list[str]:
    return [*args, "--port", str(free_port())] if case.script == "ddp_spawn.py" else args


@pytest.fixture(scope="module")
def migrated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dst = tmp_path_factory.mktemp("migrated") / "scripts"
    report = dst.parent / "report"
    subprocess.run([sys.executable, "-m", "torchport.cli", "migrate", str(SCRIPTS), "-o", str(dst),
                    "--report", str(report)], check=True, capture_output=True, text=True,
                   env=_env({}, torchport=True), timeout=300)
    return dst


def _params() -> list[object]:
    out = []
    for name, case in CASES.items():
        for way in case.ways:
            quick = way in case.quick
            marks = [] if quick or FULL else [pytest.mark.skip(
                reason="set TORCHPORT_FULL_SCRIPTS=1 (make examples)")]
            out.append(pytest.param(name, way, id=f"{name}-{way}", marks=marks))
    return out


@pytest.mark.parametrize(("name", "way"), _params())
def test_script_matches_the_cpu(name: str, way: str, tmp_path: Path,
                                migrated: Path) -> None:
    case = CASES[name]
    env = _env(case.env, torchport=True)
    args = _port(case, case.args)
    if way == "run":
        cmd = [sys.executable, "-m", "torchport.cli", "run", str(SCRIPTS / case.script), *args]
    elif way == "migrate":
        cmd = [sys.executable, str(migrated / case.script), *args]
    else:
        cmd = [sys.executable, "-m", "torchport.cli", "coverage", "--json",
               str(tmp_path / "cov.json"), "-q", str(SCRIPTS / case.script), *args]
    out = _call(cmd, tmp_path, env, case.timeout)
    if way == "migrate":
        assert "torchport.transfer" not in out.stderr  # the rewritten code stands alone
    if way == "coverage":
        cov = json.loads((tmp_path / "cov.json").read_text())
        assert sum(o["calls"] for o in cov["ops"]) > 0 and cov["exit_code"] == 0
    got, want = _results(out.stdout), _cpu(case, tmp_path)
    assert got.keys() == want.keys() and got, (got, want, out.stdout[-2000:])
    for key in want:
        if case.rel == 0.0:
            assert got[key] == want[key], (key, got[key], want[key])
        else:
            a = _numbers(got[key])
            b = [v * case.scale.get(key, 1.0) for v in _numbers(want[key])]
            assert len(a) == len(b) and a == pytest.approx(b, rel=case.rel, abs=case.rel), key
