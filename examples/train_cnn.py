"""`make demo`: train a small CNN on synthetic data on sim, check it against CPU.

The same seeded run is done on the sim device and on the CPU; the loss curves
must match (bit for bit: the sim computes with ATen's CPU kernels). The two runs step
in turn; the time per step is the median after a few warm-up steps on each side, so that
neither side's one-time costs (the C++ library's load, each op's first call) count. Then the
device's memory statistics are printed.
"""

from __future__ import annotations

import argparse
import copy
import statistics
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


class Trainer:
    """One side of the comparison: a model, its optimizer and the data, stepped one at a time."""

    def __init__(self, model: torch.nn.Module, device: str, batch: int) -> None:
        self.x, self.y = make_data()
        self.device, self.batch = device, batch
        self.model = model.to(device)
        # foreach: the device's default, as on CUDA (the CPU's is a loop over the parameters),
        # so that both sides run the same ops and their times compare.
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-3, foreach=True)
        self.losses: list[float] = []
        self.times: list[float] = []

    def step(self) -> None:
        """A whole training step, timed: batch copy, forward, backward, AdamW, ``loss.item()``."""
        t0 = time.perf_counter()
        i = (len(self.losses) * self.batch) % len(self.x)
        xb = self.x[i:i + self.batch].to(self.device)
        yb = self.y[i:i + self.batch].to(self.device)
        self.opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(self.model(xb), yb)
        loss.backward()
        self.opt.step()
        self.losses.append(loss.item())  # waits for the device
        self.times.append(time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--warmup", type=int, default=10,
                   help="steps on each side left out of the timing (one-time costs)")
    args = p.parse_args()
    if not 0 < args.warmup < args.steps:
        p.error("--warmup must be at least 1 and less than --steps")
    base = make_model()
    sim = Trainer(copy.deepcopy(base), "sim", args.batch)
    cpu = Trainer(copy.deepcopy(base), "cpu", args.batch)
    # Both sides step in turn, the first alternating, so that neither is the warm one and
    # a busy machine slows both alike.
    for step in range(args.steps):
        for side in ((sim, cpu) if step % 2 == 0 else (cpu, sim)):
            side.step()
    print(f"device: {torch.sim.get_device_name(0)}; {torch.sim.device_count()} sim devices")
    print(f"{'step':>6} {'loss (sim)':>12} {'loss (cpu)':>12}")
    for s in range(0, args.steps, max(args.steps // 15, 1)):
        print(f"{s:>6} {sim.losses[s]:>12.6f} {cpu.losses[s]:>12.6f}")
    print(f"{args.steps - 1:>6} {sim.losses[-1]:>12.6f} {cpu.losses[-1]:>12.6f}")
    same = sim.losses == cpu.losses
    print(f"loss curves identical to CPU: {same}")
    t_sim = statistics.median(sim.times[args.warmup:]) * 1e3
    t_cpu = statistics.median(cpu.times[args.warmup:]) * 1e3
    print(f"time per training step, median of steps {args.warmup}-{args.steps - 1} "
          f"(sim and CPU step in turn, after {args.warmup} warm-up steps each): "
          f"sim {t_sim:.2f} ms, cpu {t_cpu:.2f} ms, sim/cpu {t_sim / t_cpu:.2f}x")
    print(f"  a step: batch {args.batch} copied in, forward, backward, AdamW, loss.item(); the sim "
          f"computes with the CPU's kernels, so the difference is torchport's cost per op")
    print(f"first step, left out (one-time costs: the C++ library's load, each op's first call): "
          f"sim {sim.times[0] * 1e3:.0f} ms, cpu {cpu.times[0] * 1e3:.0f} ms")
    torch.sim.synchronize()
    print(torch.sim.memory_summary())
    if not same:
        raise SystemExit("the sim run diverged from the CPU run")
    if sim.losses[-1] > sim.losses[0] * 0.5:
        raise SystemExit("the model did not learn")


if __name__ == "__main__":
    main()
