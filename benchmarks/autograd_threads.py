"""Autograd's per-device threads: a training step with the engine's device thread against
the same step run in the calling thread, switched in one process and alternating.

    .venv/bin/python benchmarks/autograd_threads.py [--repeat 15] [--steps 10] [--compile]

Each ``backward()`` on the device hands its graph to the engine's thread for that device
and waits for it (as on CUDA); the difference is the cost of those two hand-offs per step.
Prints the median ms per step for each case: threads on, off, and the CPU beside.
``--compile``: the steps of ``models.py --compile`` (model and optimizer step compiled, on
both devices), whose backward is a compiled graph the engine runs the same way.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from models import CASES, make_step

import torchport.sim  # noqa: F401


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--only", default="small", help="run the cases whose name contains this")
    p.add_argument("--compile", action="store_true", help="torch.compile'd steps on both devices")
    args = p.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of "
          f"{args.repeat} runs x {args.steps} steps, ms per step")
    print(f"{'model':20s} {'threads on':>10s} {'off':>8s} {'cpu':>8s}")
    for case in (c for c in CASES if args.only in c.name):
        fns = {"on": make_step(case, "sim", compiled=args.compile),
               "cpu": make_step(case, "cpu", compiled=args.compile)}
        fns["off"] = fns["on"]
        for fn in fns.values():
            for _ in range(3):  # (compiled: the compiles, then the optimizer's with its state)
                fn()
        times: dict[str, list[float]] = {k: [] for k in ("on", "off", "cpu")}
        for _ in range(args.repeat):
            for side in ("on", "off", "cpu"):
                torch.autograd.set_multithreading_enabled(side != "off")
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    fns[side]()
                times[side].append((time.perf_counter() - t0) / args.steps * 1e3)
        torch.autograd.set_multithreading_enabled(True)
        on, off, cpu = (statistics.median(times[k]) for k in ("on", "off", "cpu"))
        print(f"{case.name:20s} {on:10.2f} {off:8.2f} {cpu:8.2f}")


if __name__ == "__main__":
    main()
