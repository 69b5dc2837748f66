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

import os
from pathlib import Path

import pytest

from tests.script_runs import Case, assert_same_results, cpu_run, device_run, migrate

pytestmark = [pytest.mark.strict, pytest.mark.scripts]

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "examples" / "scripts"
FULL = os.environ.get("TORCHPORT_FULL_SCRIPTS", "") not in ("", "0")


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


@pytest.fixture(scope="module")
def migrated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return migrate(SCRIPTS, tmp_path_factory.mktemp("migrated") / "scripts")


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
    out = device_run(case, way, SCRIPTS, migrated, tmp_path)
    assert_same_results(case, out.stdout, cpu_run(case, SCRIPTS, tmp_path).stdout)
