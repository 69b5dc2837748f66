"""The zoo (examples/zoo/): training code people copy every day, as CUDA code, trained a few
steps on the device and compared with the same script on the CPU.

Each case runs ``torchport run`` (the script unchanged) and the ``torchport migrate``
output; numbers match the CPU's bit for bit where the device does the same math, or within
a tolerance whose reason the case states. ``make test`` runs a subset; ``make zoo``
(``TORCHPORT_FULL_ZOO=1``, with the ``zoo`` extra installed) runs all and, with
``TORCHPORT_ZOO_REPORT=file.jsonl``, records each run's step time beside the CPU's
(docs/zoo.md).

``TORCHPORT_TEST_BACKEND`` runs the cases on another backend (``torchport run -b``, and
``torchport migrate -b``), whose kernels round otherwise than the CPU's: numbers then match
within ``ROUNDING`` (relative) at least, what three to six steps of float32 training drift
when every matmul and sum rounds in another order.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import backend_under_test as but
from tests.script_runs import (
    Case,
    assert_same_results,
    cpu_run,
    device_run,
    env_for,
    migrate,
    skip_missing,
    step_ms,
)

pytestmark = pytest.mark.tools

ROOT = Path(__file__).resolve().parents[1]
ZOO = ROOT / "examples" / "zoo"
FULL = os.environ.get("TORCHPORT_FULL_ZOO", "") not in ("", "0")
REPORT = os.environ.get("TORCHPORT_ZOO_REPORT", "")
WAYS = ("run", "migrate")
ROUNDING = 1e-4  # off sim: the least relative tolerance (its kernels round otherwise)

# PyTorch's group_norm composite makes a channels-last input contiguous on every device but
# the CPU (aten/src/ATen/native/group_norm.cpp), as it does for CUDA: the device runs the
# contiguous kernel where the CPU runs the channels-last one, which rounds otherwise.
GROUP_NORM = "group_norm computes a channels-last input contiguously off the CPU, as on CUDA"
# Compiled in its own process, the CPU's run leaves its own eager numbers in the last bits
# from the second step while the device's compiled run keeps them (both compiled in one
# process agree bit for bit, forward, backward, clipping and AdamW): not isolated further.
COMPILED = "the CPU's compiled run differs from its eager run in the last bits; the device's not"
BF16 = "bfloat16 autocast on the device (nanoGPT's choice for CUDA) against float32 on the CPU"

CASES = {
    # nanoGPT's train.py shape. The CUDA path takes the fused AdamW: so does the CPU run.
    "nanogpt": Case("nanogpt.py", ["--iters", "4", "--compile", "0", "--dtype", "float32"],
                    cpu_args=["--iters", "4", "--compile", "0", "--fused", "1"],
                    quick=("run",)),
    "nanogpt_compile": Case("nanogpt.py", ["--iters", "4", "--dtype", "float32"],
                            cpu_args=["--iters", "4", "--fused", "1"], rel=1e-5, why=COMPILED),
    "nanogpt_bf16": Case("nanogpt.py", ["--iters", "4", "--compile", "0"],
                         cpu_args=["--iters", "4", "--compile", "0", "--fused", "1"], rel=2e-2,
                         why=BF16),
    "nanogpt_ddp": Case("nanogpt.py", ["--iters", "4", "--compile", "0", "--dtype", "float32"],
                        cpu_args=["--iters", "4", "--compile", "0", "--fused", "1",
                                  "--backend", "gloo"], torchrun=2),
    "diffusers_ddpm": Case("diffusers_ddpm.py", ["--steps", "4"], rel=1e-5, why=GROUP_NORM,
                           needs=("diffusers",)),
    "peft_lora": Case("peft_lora.py", ["--steps", "4"], needs=("peft", "transformers")),
    # Trainer(accelerator="gpu"): unchanged, CUDA's accelerator choice is the device's
    "lightning": Case("lightning_module.py", ["--steps", "6"], needs=("pytorch_lightning",),
                      quick=("run",)),
    "lightning_bf16": Case("lightning_module.py", ["--steps", "6", "--precision", "bf16-mixed"],
                           cpu_args=["--steps", "6"], rel=2e-2, needs=("pytorch_lightning",),
                           why="bf16-mixed on the device against 32-true on the CPU"),
}


def _device_name(backend: str) -> str:
    """The device type ``backend`` registers (asked of a fresh interpreter: this one has
    ``sim``)."""
    out = subprocess.run([sys.executable, "-c", "import sys; from torchport.tools.run import "
                          "load_backend; print(load_backend(sys.argv[1]).name)", backend],
                         capture_output=True, text=True, timeout=300, check=True,
                         env=env_for({}, torchport=True))
    return out.stdout.split()[-1]


@pytest.fixture(scope="module")
def migrated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dst = tmp_path_factory.mktemp("migrated") / "zoo"
    if but.EXACT:
        return migrate(ZOO, dst)
    spec = f"{_device_name(but.NAME)}={but.NAME}"
    subprocess.run([sys.executable, "-m", "torchport.tools.cli", "migrate", str(ZOO), "-o",
                    str(dst), "-b", spec, "--report", str(dst.parent / "zoo-report")],
                   check=True, capture_output=True, text=True, env=env_for({}, torchport=True),
                   timeout=300)
    return dst


def _on_backend(case: Case) -> Case:
    """``case`` as it runs on the backend under test."""
    if but.EXACT:
        return case
    return dataclasses.replace(
        case, env={**case.env, "TORCHPORT_BACKEND": but.NAME}, rel=max(case.rel, ROUNDING),
        why=case.why or f"{but.NAME}'s kernels round otherwise than the CPU's")


def _params() -> list[object]:
    out = []
    for name, case in CASES.items():
        for way in WAYS:
            marks = [] if way in case.quick or FULL else [pytest.mark.skip(
                reason="set TORCHPORT_FULL_ZOO=1 (make zoo)")]
            out.append(pytest.param(name, way, id=f"{name}-{way}", marks=marks))
    return out


def test_every_case_states_why_it_is_not_bit_for_bit() -> None:
    assert all(bool(c.why) == (c.rel > 0) for c in CASES.values())
    assert {c.script for c in CASES.values()} == {p.name for p in ZOO.glob("*.py")}


@pytest.mark.parametrize(("name", "way"), _params())
def test_zoo_case_matches_the_cpu(name: str, way: str, tmp_path: Path, migrated: Path) -> None:
    case = _on_backend(CASES[name])
    skip_missing(case)
    device = device_run(case, way, ZOO, migrated, tmp_path)
    trained_on = re.search(r"^device (\S+)", device.stdout, re.M)
    assert trained_on and not trained_on.group(1).startswith("cpu"), device.stdout[-2000:]
    cpu = cpu_run(case, ZOO, tmp_path)
    assert_same_results(case, device.stdout, cpu.stdout)
    if REPORT:
        with open(REPORT, "a") as f:
            f.write(json.dumps({"case": name, "way": way, "device_ms": step_ms(device.stdout),
                                "cpu_ms": step_ms(cpu.stdout), "rel": case.rel,
                                "why": case.why}) + "\n")
