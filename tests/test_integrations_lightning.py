"""PyTorch Lightning on the device: ``Trainer(accelerator="sim")`` (torchport.integrations.lightning).

A LightningModule (a small MLP regressor, SGD) trains a few steps on one device, in fp32
(bit for bit the CPU run's losses: the same math), ``bf16-mixed`` and ``16-mixed`` (the
device's autocast, CUDA's policy, and for fp16 the device's GradScaler; their losses are
compared with the fp32 CPU run within a stated tolerance), and on two devices with
Lightning's ``ddp`` (the script launched again per rank) and ``ddp_spawn`` (a CUDA script
with ``accelerator="gpu"``, migrated), each rank's losses bit for bit those of Lightning's
CPU DDP over Gloo. The accelerator is registered
when Lightning is imported, never by importing torchport; ``"gpu"`` and ``"auto"`` choose
the device as they choose a GPU, so migrated CUDA scripts need no edit.

``TORCHPORT_TEST_BACKEND`` runs the module on another backend (:mod:`tests.backend_under_test`,
under ``pytest --noconftest``): its kernels round otherwise, so losses compare within
float32's default tolerances there, and ops may decompose or fall back (the sim's "nothing
falls back" checks are the sim's alone).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import torchport.ops as ops
from tests import backend_under_test as but
from tests.helpers import check_python

pl = pytest.importorskip("pytorch_lightning",
                         reason="pytorch-lightning is not installed (pip install '.[lightning]')")

pytestmark = pytest.mark.tools

DEVICE = but.load()
STEPS = 4
FULL = os.environ.get("TORCHPORT_FULL_SCRIPTS", "") not in ("", "0")


class Regressor(pl.LightningModule):
    """An MLP regressor recording each step's loss and where its batch and weights were."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(),
                                       torch.nn.Linear(32, 1))
        self.losses: list[float] = []
        self.seen: set[tuple[str, str]] = set()

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        x, y = batch
        self.seen.add((str(x.device), str(self.net[0].weight.device)))
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _loader() -> torch.utils.data.DataLoader:
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sin().sum(1, keepdim=True)),
                                       batch_size=8)


def _fit(accelerator: str, precision: str = "32-true") -> tuple[Regressor, Any]:
    model = Regressor()
    trainer = pl.Trainer(accelerator=accelerator, devices=1, precision=precision,
                         max_steps=STEPS, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, _loader())
    return model, trainer


def _ran(rec: ops.Recorder, name: str, dtype: str) -> bool:
    return any(k.split(".")[0] == name and dtype in s.dtypes for k, s in rec.ops.items())


def _native_only(rec: ops.Recorder, name: str, dtype: str) -> bool:
    """``name`` ran in ``dtype`` and nothing fell back: the sim's promise, which a backend
    with a handful of kernels (another TORCHPORT_TEST_BACKEND) does not make."""
    return not but.EXACT or (_ran(rec, name, dtype) and rec.totals()["fallback"] == 0)


def _same_losses(got: list[float], want: list[float]) -> bool:
    if but.EXACT:
        return got == want
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want))
    return True


# ---- registration and choice of the device ---------------------------------------------------
def test_registered_when_lightning_is_imported() -> None:
    """Importing the backend imports nothing of Lightning; importing Lightning afterwards
    registers the accelerator (a fresh interpreter)."""
    code = ("import sys\nfrom torchport.tools.run import load_backend\n"
            f"load_backend({but.NAME!r})\n"
            "assert 'pytorch_lightning' not in sys.modules\n"
            "from pytorch_lightning.accelerators import AcceleratorRegistry\n"
            f"print({DEVICE!r} in AcceleratorRegistry)\n")
    assert check_python(code, timeout=120).strip() == "True"


def test_uninstall_gives_lightning_back() -> None:
    """:func:`uninstall` removes the accelerator and restores the connector and DDP (what
    ``TORCHPORT_LIGHTNING_INTEGRATION=0`` leaves), :func:`install` adapts the loaded
    modules again."""
    from pytorch_lightning.accelerators import AcceleratorRegistry
    from pytorch_lightning.trainer.connectors.accelerator_connector import _AcceleratorConnector

    from torchport.integrations import lightning

    assert DEVICE in AcceleratorRegistry and lightning.installed() == DEVICE
    assert len(lightning.patched()) == 3, lightning.patched()
    patched = _AcceleratorConnector.__dict__["_choose_strategy"]
    lightning.uninstall()
    try:
        assert DEVICE not in AcceleratorRegistry and lightning.patched() == []
        assert _AcceleratorConnector.__dict__["_choose_strategy"] is not patched
        assert pl.Trainer(accelerator="auto", logger=False).strategy.root_device.type == "cpu"
    finally:
        lightning.install(DEVICE)
    assert DEVICE in AcceleratorRegistry and len(lightning.patched()) == 3
    assert pl.Trainer(accelerator="auto", logger=False).strategy.root_device.type == DEVICE


@pytest.mark.parametrize("flag", [DEVICE, "gpu", "auto"])
def test_accelerator_flags_choose_the_device(flag: str) -> None:
    """``"sim"``, ``"gpu"`` and ``"auto"`` give the device's accelerator and one-device
    strategy on ``sim:0``; ``devices=2`` gives DDP over the device's c10d backend."""
    trainer = pl.Trainer(accelerator=flag, devices=1, logger=False)
    assert type(trainer.accelerator).__name__ == f"{DEVICE.capitalize()}Accelerator"
    assert isinstance(trainer.strategy, pl.strategies.SingleDeviceStrategy)
    assert trainer.strategy.root_device == torch.device(DEVICE, 0)
    ddp = pl.Trainer(accelerator=flag, devices=2, logger=False).strategy
    assert isinstance(ddp, pl.strategies.DDPStrategy)
    assert ddp.parallel_devices == [torch.device(DEVICE, 0), torch.device(DEVICE, 1)]
    assert ddp._get_process_group_backend() == f"{DEVICE}ccl"
    assert pl.Trainer(accelerator="cpu", logger=False).strategy.root_device.type == "cpu"


def test_devices_are_checked() -> None:
    """Device lists are parsed as Lightning parses GPU ids; missing devices are refused."""
    from torchport.integrations.lightning import DeviceSelectionError, parse_devices

    assert parse_devices(-1, 2) == [0, 1] and parse_devices("0,1", 2) == [0, 1]
    assert parse_devices([1], 2) == [1] and parse_devices("1", 2) == [0]
    with pytest.raises(DeviceSelectionError, match="does not have"):
        pl.Trainer(accelerator=DEVICE, devices=[0, 5], logger=False)


# ---- one device ------------------------------------------------------------------------------
def test_fp32_matches_cpu() -> None:
    """fp32 on the device: batches and weights on ``sim:0``, the CPU's losses bit for bit."""
    with ops.record() as rec:
        dev, _ = _fit(DEVICE)
    cpu, _ = _fit("cpu")
    assert dev.seen == {(f"{DEVICE}:0", f"{DEVICE}:0")} and cpu.seen == {("cpu", "cpu")}
    assert _native_only(rec, "addmm", "float32")
    assert len(dev.losses) == STEPS and _same_losses(dev.losses, cpu.losses)
    assert dev.losses[0] != dev.losses[-1]


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision(precision: str) -> None:
    """``bf16-mixed``/``16-mixed``: the device's autocast (linear layers in the low dtype),
    fp16 with the device's GradScaler (it unscales on the device, and skips the steps whose
    scaled gradients overflow, as on CUDA). Losses within 1% of the fp32 CPU run's up to the
    first skipped step (bf16/fp16 matmuls over rows of 8 and 32)."""
    low = "bfloat16" if precision == "bf16-mixed" else "float16"
    with ops.record() as rec:
        dev, trainer = _fit(DEVICE, precision)
    plugin = trainer.precision_plugin
    assert isinstance(plugin, pl.plugins.precision.MixedPrecision) and plugin.device == DEVICE
    assert dev.seen == {(f"{DEVICE}:0", f"{DEVICE}:0")}
    assert _native_only(rec, "addmm", low)
    cpu, _ = _fit("cpu")
    assert all(torch.isfinite(torch.tensor(dev.losses)))
    compared = dev.losses
    if precision == "16-mixed":
        scaler = plugin.scaler
        assert isinstance(scaler, torch.amp.GradScaler) and scaler._device == DEVICE
        assert not but.EXACT or \
            rec.ops["_amp_foreach_non_finite_check_and_unscale_"].paths.get("native")
        # the initial scale (2**16) overflows fp16 on the first step, which is skipped
        assert scaler.get_scale() < 2.0 ** 16
        compared = dev.losses[:1]
    else:
        assert plugin.scaler is None
    torch.testing.assert_close(torch.tensor(compared), torch.tensor(cpu.losses[:len(compared)]),
                               rtol=1e-2, atol=0)


# ---- two devices -----------------------------------------------------------------------------
# A CUDA script (``accelerator="gpu"``), migrated before it runs on the device; the CPU
# reference is the original with ``accelerator="cpu"``.
SCRIPT = '''\
"""``lit.py [ACCELERATOR [STRATEGY]]``: a LightningModule on two GPUs."""
import sys

import pytorch_lightning as pl
import torch


class Regressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(),
                                       torch.nn.Linear(32, 1))
        self.losses, self.seen = [], set()

    def training_step(self, batch, index):
        x, y = batch
        self.seen.add((str(x.device), str(self.net[0].weight.device)))
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def on_train_end(self):
        # one write: the ranks share the pipe
        sys.stdout.write(f"result {self.global_rank} {sorted(self.seen)!r} {self.losses!r}\\n")
        sys.stdout.flush()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


if __name__ == "__main__":
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.TensorDataset(x, x.sin().sum(1, keepdim=True))
    accelerator = sys.argv[1] if len(sys.argv) > 1 else "gpu"
    strategy = sys.argv[2] if len(sys.argv) > 2 else "ddp"
    trainer = pl.Trainer(accelerator=accelerator, devices=2, strategy=strategy, max_steps=4,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(Regressor(), torch.utils.data.DataLoader(data, batch_size=8))
'''
_CPU_DDP: dict[str, dict[int, list[float]]] = {}


def _two(tmp: Path, accelerator: str, strategy: str) -> dict[int, tuple[list[Any], list[float]]]:
    """Run the script on two devices (migrated first unless on the CPU); each rank's
    devices seen and losses."""
    from torchport.tools.migrate import rewrite_source

    script = tmp / "lit.py"
    if accelerator == "cpu":
        script.write_text(SCRIPT)
    else:
        result = rewrite_source(SCRIPT, "sim" if but.EXACT else f"{DEVICE}={but.NAME}",
                                path="lit.py")
        assert [c.libraries for c in result.changes] == [("pytorch_lightning",)]
        assert isinstance(result.code, str)
        script.write_text(result.code)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", TORCHPORT_FALLBACK_WARN="0")
    out = subprocess.run([sys.executable, str(script), accelerator, strategy], cwd=tmp, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-5000:])
    ranks = {}
    for m in re.finditer(r"^result (\d) (\[.*?\]) (\[.*?\])$", out.stdout, re.M):
        ranks[int(m[1])] = (ast.literal_eval(m[2]), ast.literal_eval(m[3]))
    assert sorted(ranks) == [0, 1], out.stdout
    return ranks


@pytest.mark.parametrize("strategy", [
    "ddp", pytest.param("ddp_spawn", marks=[pytest.mark.slow, pytest.mark.skipif(
        not FULL, reason="spawns two interpreters more; set TORCHPORT_FULL_SCRIPTS=1")])])
def test_two_devices_match_cpu_ddp(tmp_path: Path, strategy: str) -> None:
    """A CUDA script's ``Trainer(accelerator="gpu", devices=2)``, migrated: rank r trains
    on ``sim:r`` over the c10d backend, each rank's losses bit for bit those of Lightning's
    CPU DDP over Gloo."""
    if "cpu" not in _CPU_DDP:
        cpu = _two(tmp_path, "cpu", "ddp")
        _CPU_DDP["cpu"] = {r: losses for r, (_, losses) in cpu.items()}
    dev = _two(tmp_path, "gpu", strategy)
    for rank in (0, 1):
        seen, losses = dev[rank]
        assert seen == [(f"{DEVICE}:{rank}", f"{DEVICE}:{rank}")], seen
        assert len(losses) == STEPS and _same_losses(losses, _CPU_DDP["cpu"][rank])
    assert dev[0][1] != dev[1][1]  # the ranks saw different batches
