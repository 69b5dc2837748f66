"""A custom training loop with Hugging Face ``accelerate``: no device code at all, the
``Accelerator`` chooses the device, places model, optimizer and data, and runs backward.

    python accelerate_loop.py --steps 6 [--mixed-precision bf16]
"""

import argparse

import torch
import torch.nn as nn
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--mixed-precision", default="no", choices=["no", "bf16", "fp16"])
    args = parser.parse_args()

    accelerator = Accelerator(mixed_precision=args.mixed_precision)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.LayerNorm(32), nn.SiLU(), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 10, generator=g)
    y = x[:, :2].prod(dim=1, keepdim=True)
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True,
                        generator=torch.Generator().manual_seed(2))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    step, losses = 0, []
    while step < args.steps:
        for xb, yb in loader:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(xb), yb)
            accelerator.backward(loss)
            optimizer.step()
            losses.append(loss.item())
            step += 1
            if step == args.steps:
                break
    accelerator.print(f"device {accelerator.device} mixed_precision {accelerator.mixed_precision}")
    accelerator.print(f"result losses {losses!r}")
    unwrapped = accelerator.unwrap_model(model)
    accelerator.print(
        f"result checksum {sum(p.double().sum().item() for p in unwrapped.parameters())!r}")


if __name__ == "__main__":
    main()
