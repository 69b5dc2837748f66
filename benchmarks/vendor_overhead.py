"""What torchport adds to a vendor's ``out=`` kernel: a kernel that does nothing, declared
with ``KernelSet.out_kernel("add.out")`` on the sim's host-addressable, synchronous runtime
(device ``vendor``), timed against the CPU op. ``add.out`` is called through ``out=``;
``add.Tensor`` (``a + b``) and ``add_.Tensor`` (``a.add_(b)``) are the overloads torchport
derives from it (the meta kernel's result, a new output or the in-place checks, then the
kernel). The ``mul`` rows are the same for a C kernel that does nothing
(``KernelSet.c_out_kernel("mul.out", ...)``, compiled here with ``$CC``; left out without a
compiler). The difference to the CPU is the framework's part of every vendor op (the kernel
itself costs nothing here, the CPU's computes 8x8 elements); ``--python`` times the Python
path (what serves without torchport's C++ library, and while ops are intercepted).

    OMP_NUM_THREADS=1 python benchmarks/vendor_overhead.py [--repeat 9] [--number 2000]
        [--profile add_out] [--python]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import ctypes
import os
import pstats
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

import torchport
from torchport.backends.sim import SimRuntime
from torchport.ops import KernelSet, c_kernels, native_vendor

_C_NOOP = r"""
#include "torchport_kernel.h"
int noop(const TorchportCall* call) { return call->nargs == 3 ? TORCHPORT_OK : TORCHPORT_ERROR; }
"""


def c_noop(directory: str) -> ctypes.CDLL | None:
    """A C kernel that does nothing (``None``: no compiler)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    src, lib = Path(directory) / "noop.c", Path(directory) / "libnoop.so"
    src.write_text(_C_NOOP)
    subprocess.run([cc, "-O2", "-shared", "-fPIC", f"-I{c_kernels.HEADER.parent}",
                    f"-I{Path(torch.__file__).parent / 'include'}", str(src), "-o", str(lib)],
                   check=True)
    return ctypes.CDLL(str(lib))


def register(c_library: ctypes.CDLL | None) -> None:
    """Device ``vendor``: the sim's runtime, one kernel set whose ``add.out`` (and, given a
    C library, ``mul.out``) does nothing."""
    ks = KernelSet("noop")

    @ks.out_kernel("add.out", dtypes=[torch.float32])
    def add_out(self: torch.Tensor, other: torch.Tensor, *, alpha: object = 1,
                out: torch.Tensor) -> torch.Tensor:
        return out

    if c_library is not None:
        ks.c_out_kernel("mul.out", c_library.noop, dtypes=[torch.float32])
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


def cases(device: str, c_kernel: bool) -> dict[str, Callable[[], object]]:
    a, b, d = (torch.randn(8, 8).to(device) for _ in range(3))
    c = torch.empty(8, 8, device=device)
    out: dict[str, Callable[[], object]] = {
        "add_out": lambda: torch.add(a, b, out=c), "add": lambda: a + b,
        "add_": lambda: d.add_(b)}
    if c_kernel:
        out.update({"mul_out (C)": lambda: torch.mul(a, b, out=c), "mul (C)": lambda: a * b,
                    "mul_ (C)": lambda: d.mul_(b)})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeat", type=int, default=9)
    p.add_argument("--number", type=int, default=2000)
    p.add_argument("--profile", default="", help="a case to profile (cProfile, by own time)")
    p.add_argument("--python", action="store_true", help="the Python path (no C++ caller)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        c_library = c_noop(directory)
        register(c_library)
        with native_vendor.python_only() if args.python else contextlib.nullcontext():
            run(args, c_library is not None)


def run(args: argparse.Namespace, c_kernel: bool) -> None:
    dev, cpu = cases("vendor", c_kernel), cases("cpu", c_kernel)
    print(f"torch threads: {torch.get_num_threads()}; path: "
          f"{'Python' if args.python else 'C++ where the library is built'}")
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
