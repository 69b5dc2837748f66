"""`make demo`: train a small CNN on synthetic data on sim, check it against CPU.

The same seeded run is done on the sim device and on the CPU; the loss curves
must match (bit for bit: the sim computes with ATen's CPU kernels). Then the
device's memory statistics are printed.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

import torchport.sim  # noqa: F401  (registers the "sim" device and torch.sim)


def make_data(n: int = 512, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic 16x16 images whose class is the quadrant holding a bright blob."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 16, 16, generator=g) * 0.3
    y = torch.randint(0, 4, (n,), generator=g)
    for i in range(n):
        r, c = divmod(int(y[i]), 2)
        x[i, 0, r * 8 + 2:r * 8 + 6, c * 8 + 2:c * 8 + 6] += 1.5
    return x, y


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.MaxPool2d(2), torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(2), torch.nn.Flatten(), torch.nn.Linear(64, 4))


def train(model: torch.nn.Module, device: str, steps: int, batch: int) -> list[float]:
    x, y = make_data()
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        i = (step * batch) % len(x)
        xb, yb = x[i:i + batch].to(device), y[i:i + batch].to(device)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=32)
    args = p.parse_args()
    base = make_model()
    t0 = time.perf_counter()
    sim_losses = train(copy.deepcopy(base), "sim", args.steps, args.batch)
    t_sim = time.perf_counter() - t0
    t0 = time.perf_counter()
    cpu_losses = train(copy.deepcopy(base), "cpu", args.steps, args.batch)
    t_cpu = time.perf_counter() - t0
    print(f"device: {torch.sim.get_device_name(0)}; {torch.sim.device_count()} sim devices")
    print(f"{'step':>6} {'loss (sim)':>12} {'loss (cpu)':>12}")
    for s in range(0, args.steps, max(args.steps // 15, 1)):
        print(f"{s:>6} {sim_losses[s]:>12.6f} {cpu_losses[s]:>12.6f}")
    print(f"{args.steps - 1:>6} {sim_losses[-1]:>12.6f} {cpu_losses[-1]:>12.6f}")
    same = sim_losses == cpu_losses
    print(f"loss curves identical to CPU: {same}; time sim {t_sim:.1f}s, cpu {t_cpu:.1f}s")
    torch.sim.synchronize()
    print(torch.sim.memory_summary())
    if not same:
        raise SystemExit("the sim run diverged from the CPU run")
    if sim_losses[-1] > sim_losses[0] * 0.5:
        raise SystemExit("the model did not learn")


if __name__ == "__main__":
    main()
