"""``opt.step()`` timed inside training steps: the CPU's per-tensor loop, the CPU with
``foreach=True``, and the device (whose optimizers take the foreach path, as on CUDA).

Tells whether the device's extra in an optimizer step comes from the foreach order (each op
streaming every parameter through the caches) or from per-tensor host work: when the two
CPU columns agree, the order costs nothing. Steps of the three run in turn, so that the
machine's changes of speed hit all alike; medians over ``--steps``.

    .venv/bin/python benchmarks/optimizer_step.py [--steps 30] [--only mlp-small]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from models import CASES, Case

import torchport.sim  # noqa: F401


def make_step(case: Case, device: str, foreach: bool) -> tuple[Callable[[], None], list[float]]:
    """A training step of ``case``; each call appends its ``opt.step()`` seconds to the list."""
    torch.manual_seed(0)
    model = case.make_model().to(device)
    x, y = (t.to(device) for t in case.make_batch())
    params = model.parameters()
    opt = (torch.optim.AdamW(params, lr=1e-3, foreach=foreach) if case.optimizer == "adamw"
           else torch.optim.SGD(params, lr=0.01, momentum=0.9, foreach=foreach))
    times: list[float] = []

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = case.loss(model(x), y)
        loss.backward()
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
        loss.item()

    return step, times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--only", default=None, help="run the cases whose name contains this")
    args = p.parse_args()
    print(f"opt.step() in us, median of {args.steps} steps each")
    print(f"{'model':<20}{'cpu loop':>10}{'cpu foreach':>13}{'sim':>8}{'sim/loop':>10}")
    for case in CASES:
        if args.only and args.only not in case.name:
            continue
        runs = [make_step(case, d, f) for d, f in (("cpu", False), ("cpu", True), ("sim", True))]
        for step, times in runs:
            for _ in range(5):
                step()
            times.clear()
        for _ in range(args.steps):
            for step, _ in runs:
                step()
        loop, fe, sim = (statistics.median(t) * 1e6 for _, t in runs)
        print(f"{case.name:<20}{loop:>10.0f}{fe:>13.0f}{sim:>8.0f}{sim / loop:>10.2f}")


if __name__ == "__main__":
    main()
