"""A PyTorch Lightning module trained by ``Trainer(accelerator="gpu")``, as CUDA code.

The shape of Lightning's getting-started examples: a ``LightningModule`` with
``training_step``/``configure_optimizers`` (AdamW, a step LR scheduler), a ``DataLoader``,
``Trainer(accelerator="gpu", devices=1, max_steps=...)`` with gradient accumulation and
clipping, on a seeded synthetic regression task. ``--precision bf16-mixed`` trains as
Lightning does on an Ampere GPU. A callback collects every step's loss.

Prints ``result losses`` and ``result checksum``, and a ``timing`` line.
"""

from __future__ import annotations

import argparse
import time
import warnings

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> dict:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)}


class Losses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.times: list[float] = []
        self.t0 = 0.0
        self.device: torch.device | None = None  # where the module trained

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule,
                             *args: object) -> None:
        self.device = self.device or module.device
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule,
                           outputs: dict, *args: object) -> None:
        self.losses.append(outputs["loss"].item())
        self.times.append(time.perf_counter() - self.t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--precision", default="32-true")
    p.add_argument("--accelerator", default="gpu" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    y = (x[:, :3].sum(1, keepdim=True) * x[:, 3:4]).tanh()
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True,
                        generator=torch.Generator().manual_seed(1))
    model = Regressor()
    losses = Losses()
    trainer = pl.Trainer(accelerator=args.accelerator, devices=1, max_steps=args.steps,
                         precision=args.precision, accumulate_grad_batches=2,
                         gradient_clip_val=1.0, callbacks=[losses], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(model, loader)
    print(f"device {losses.device} precision {args.precision}")
    print(f"result losses {losses.losses!r}")
    print(f"result checksum {sum(p.detach().double().sum().item() for p in model.parameters())!r}")
    steady = sorted(losses.times[1:]) or losses.times
    print(f"timing step_ms {1000 * steady[len(steady) // 2]:.3f}")


if __name__ == "__main__":
    main()
