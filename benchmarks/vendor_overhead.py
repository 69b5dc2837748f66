"""What torchport adds to a vendor's ``out=`` kernel: a kernel that does nothing, declared
with ``KernelSet.out_kernel("add.out")`` on the sim's host-addressable, synchronous runtime
(device ``vendor``), timed against the CPU op. ``add.out`` is called through ``out=``;
``add.Tensor`` (``a + b``) and ``add_.Tensor`` (``a.add_(b)``) are the overloads torchport
derives from it (the meta kernel's result, a new output or the in-place checks, then the
kernel). The difference to the CPU is the framework's part of every vendor op: PyTorch's
dispatch to Python, the derive wrapper (overlap checks, output specs, allocation) and the
glue; the kernel itself costs nothing here.

    OMP_NUM_THREADS=1 python benchmarks/vendor_overhead.py [--repeat 9] [--number 2000]
        [--profile add_out]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from collections.abc import Callable

import torch

import torchport
from torchport.backends.sim import SimRuntime
from torchport.ops import KernelSet


def register() -> None:
    """Device ``vendor``: the sim's runtime, one kernel set whose ``add.out`` does nothing."""
    ks = KernelSet("noop")

    @ks.out_kernel("add.out", dtypes=[torch.float32])
    def add_out(self: torch.Tensor, other: torch.Tensor, *, alpha: object = 1,
                out: torch.Tensor) -> torch.Tensor:
        return out

    torchport.Backend("vendor", SimRuntime(), [ks]).register()


def bench_pair(dev: Callable[[], object], cpu: Callable[[], object], number: int,
               repeat: int) -> tuple[float, float, float, float]:
    """Medians over ``repeat`` alternating runs of the time per call (us) on the device and
    on the CPU, and the medians of the back-to-back pairs' differences in wall time and in
    the calling thread's CPU time (which a neighbour's load on a shared machine disturbs
    less)."""
    for fn in (dev, cpu):
        for _ in range(200):
            fn()
    runs: tuple[list[float], list[float]] = ([], [])
    cpu_runs: tuple[list[float], list[float]] = ([], [])
    for i in range(repeat):
        order = ((dev, 0), (cpu, 1))
        for fn, k in (order if i % 2 == 0 else order[::-1]):
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(number):
                fn()
            c1, t1 = time.thread_time(), time.perf_counter()
            runs[k].append((t1 - t0) / number * 1e6)
            cpu_runs[k].append((c1 - c0) / number * 1e6)
    extra = [d - c for d, c in zip(*runs, strict=True)]
    extra_cpu = [d - c for d, c in zip(*cpu_runs, strict=True)]
    return (statistics.median(runs[0]), statistics.median(runs[1]), statistics.median(extra),
            statistics.median(extra_cpu))


def cases(device: str) -> dict[str, Callable[[], object]]:
    a, b, d = (torch.randn(8, 8).to(device) for _ in range(3))
    c = torch.empty(8, 8, device=device)
    return {"add_out": lambda: torch.add(a, b, out=c), "add": lambda: a + b,
            "add_": lambda: d.add_(b)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeat", type=int, default=9)
    p.add_argument("--number", type=int, default=2000)
    p.add_argument("--profile", default="", help="a case to profile (cProfile, by own time)")
    args = p.parse_args()
    register()
    dev, cpu = cases("vendor"), cases("cpu")
    print(f"torch threads: {torch.get_num_threads()}")
    print("| call [8x8 float32] | vendor no-op kernel us | CPU us | extra us | extra thread "
          "CPU us |\n|---|---:|---:|---:|---:|")
    for name in dev:
        d, c, extra, extra_cpu = bench_pair(dev[name], cpu[name], args.number, args.repeat)
        print(f"| {name} | {d:.1f} | {c:.1f} | {extra:.1f} | {extra_cpu:.1f} |")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.number):
            dev[args.profile]()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
