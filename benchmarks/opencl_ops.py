"""The OpenCL backend (device ``ocl``) against the CPU: per-op time of the native kernels, of
the same op forced to the CPU fallback (copies to the host and back), and of the CPU op; then
an MLP training step (AdamW) on ``ocl`` vs the CPU. Every time includes the device finishing
its queue (``torch.ocl.synchronize()``). Each figure is the median of ``--repeat`` rounds of
``--number`` calls; the native, fallback and CPU rounds alternate, so that a noisy neighbour
hits them alike, and the ratio column is the median of each round's native/CPU ratio. The
first line is the driver's own floor: an empty kernel launched and finished in raw pyopencl.

    OMP_NUM_THREADS=1 python benchmarks/opencl_ops.py [--size 256] [--number 50] [--repeat 7]
        [--ops mm,softmax] [--no-steps]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import numpy as np
import torch

import torchport
import torchport.opencl  # noqa: F401  (registers ocl)
from torchport.ops import set_force_fallback


def rounds(fns: list[Callable[[], object]], syncs: list[Callable[[], None]], number: int,
           repeat: int, around: list[Callable[[], AbstractContextManager[object]]] | None = None
           ) -> list[list[float]]:
    """Microseconds per call of each of ``fns`` in ``repeat`` rounds of ``number`` calls
    (warm: built, cached), the functions taking turns within a round; ``around[k]()``: a
    context entered for each round of ``fns[k]``."""
    around = around or [contextlib.nullcontext] * len(fns)
    for fn, sync, ctx in zip(fns, syncs, around, strict=True):
        with ctx():
            fn()
            sync()
    out: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for fn, sync, ctx, times in zip(fns, syncs, around, out, strict=True):
            with ctx():
                t0 = time.perf_counter()
                for _ in range(number):
                    fn()
                sync()
                times.append((time.perf_counter() - t0) / number * 1e6)
    return out


@contextlib.contextmanager
def forced(overload: str) -> Iterator[None]:
    """``overload`` forced to the CPU fallback (copies to the host and back)."""
    old = set_force_fallback([overload])
    try:
        yield
    finally:
        set_force_fallback(old)


def timed(fn: Callable[[], object], sync: Callable[[], None], number: int,
          repeat: int = 7) -> float:
    """Microseconds per call, the median of ``repeat`` rounds of ``number`` calls."""
    return statistics.median(rounds([fn], [sync], number, repeat)[0])


def driver_floor(repeat: int) -> tuple[float, float]:
    """Microseconds of an empty kernel (one work-item) in raw pyopencl on the device's
    default queue: launched and finished one at a time, and launched back to back."""
    import pyopencl as cl
    rt = torchport.current_backend().runtime
    queue = rt.default[0].queue
    kernel = cl.Program(rt.contexts[0], "__kernel void empty(long n) {}").build().empty
    kernel.set_scalar_arg_dtypes([np.int64])

    def one() -> None:
        kernel(queue, (1,), None, 1)
        queue.finish()
    alone = timed(one, lambda: None, 200, repeat)
    piped = timed(lambda: kernel(queue, (1,), None, 1), queue.finish, 200, repeat)
    return alone, piped


Op = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]


def ops(n: int) -> dict[str, tuple[str | None, Op]]:
    """Name -> (the overload to force to the CPU, or None: a core kernel, never forced; the
    call on ``a``, ``b`` (n x n) and ``i`` (n indices below n))."""
    return {
        f"add [{n}x{n}]": ("add.Tensor", lambda a, b, i: a + b),
        f"mul scalar [{n}x{n}]": ("mul.Tensor", lambda a, b, i: a * 2.0),
        f"exp [{n}x{n}]": ("exp", lambda a, b, i: a.exp()),
        f"sum dim 1 [{n}x{n}]": ("sum.dim_IntList", lambda a, b, i: a.sum(1)),
        f"mm [{n}x{n}]": ("mm", lambda a, b, i: a @ b),
        f"softmax [{n}x{n}]": ("_softmax", lambda a, b, i: torch.softmax(a, 1)),
        f"copy_ transposed [{n}x{n}]": (None, lambda a, b, i: b.copy_(a.t())),
        f"mm float16 [{n}x{n}]": ("mm", lambda a, b, i: a.half() @ b.half()),
        f"layer_norm [{n}x{n}]": ("native_layer_norm",
                                  lambda a, b, i: torch.nn.functional.layer_norm(a, (n,))),
        f"index_select rows [{n} of {n}x{n}]": ("index_select",
                                                 lambda a, b, i: a.index_select(0, i)),
        f"var dim 1 [{n}x{n}]": ("var.correction", lambda a, b, i: a.var(1)),
        f"dropout p=0.1 [{n}x{n}]": ("native_dropout",
                                     lambda a, b, i: torch.nn.functional.dropout(a, 0.1)),
    }


def step_fn(device: str, block: bool) -> Callable[[], None]:
    """One AdamW step of the MLP, or (``block``) of a transformer-ish block: embedding,
    layer norm, linear, softmax over the vocabulary."""
    torch.manual_seed(0)
    if block:
        model = torch.nn.Sequential(torch.nn.Embedding(1000, 128), torch.nn.LayerNorm(128),
                                    torch.nn.Linear(128, 256), torch.nn.ReLU(),
                                    torch.nn.Linear(256, 1000)).to(device)
        x = torch.randint(0, 1000, (256,)).to(device)
        y = torch.randint(0, 1000, (256,)).to(device)
    else:
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                    torch.nn.Linear(512, 10)).to(device)
        x, y = torch.randn(128, 256).to(device), torch.randint(0, 10, (128,)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return step


def step_times(number: int, repeat: int, block: bool) -> tuple[float, float, float]:
    """Milliseconds per step on ``ocl`` and on the CPU (medians, the rounds alternating),
    and the median of the rounds' ratios."""
    times = rounds([step_fn("ocl", block), step_fn("cpu", block)],
                   [torch.ocl.synchronize, lambda: None], number, repeat)
    ratio = statistics.median(d / c for d, c in zip(*times, strict=True))
    return statistics.median(times[0]) / 1e3, statistics.median(times[1]) / 1e3, ratio


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--number", type=int, default=50)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--ops", default="", help="comma-separated name prefixes (default: all)")
    p.add_argument("--no-steps", action="store_true", help="skip the training steps")
    args = p.parse_args()
    warnings.simplefilter("ignore")
    torchport.ops.set_fallback_warn(False)
    n = args.size
    a, b = torch.randn(n, n), torch.randn(n, n)
    i = torch.randint(0, n, (n,))
    da, db, di = a.to("ocl"), b.to("ocl"), i.to("ocl")
    print(f"device: {torch.ocl.get_device_name(0)}; torch threads: {torch.get_num_threads()}")
    alone, piped = driver_floor(args.repeat)
    print(f"empty kernel in raw pyopencl: {alone:.1f} us launched and finished, "
          f"{piped:.1f} us back to back")
    print("| op | ocl native us | ocl CPU fallback us | CPU us | native / CPU |\n"
          "|---|---:|---:|---:|---:|")
    wanted = [w for w in args.ops.split(",") if w]
    sync = torch.ocl.synchronize
    for name, (overload, fn) in ops(n).items():
        if wanted and not any(name.startswith(w) for w in wanted):
            continue
        fns: list[Callable[[], object]] = [lambda fn=fn: fn(da, db, di), lambda fn=fn: fn(a, b, i)]
        syncs = [sync, lambda: None]
        around: list[Callable[[], AbstractContextManager[object]]] = [contextlib.nullcontext] * 2
        if overload is not None:
            fns.append(fns[0])
            syncs.append(sync)
            around.append(lambda overload=overload: forced(overload))
        times = rounds(fns, syncs, args.number, args.repeat, around)
        native, cpu = statistics.median(times[0]), statistics.median(times[1])
        ratio = statistics.median(d / c for d, c in zip(times[0], times[1], strict=True))
        fallback = f"{statistics.median(times[2]):.0f}" if overload is not None else "-"
        print(f"| {name} | {native:.0f} | {fallback} | {cpu:.0f} | {ratio:.1f} |")
    if args.no_steps:
        return
    for block, what in ((False, "MLP 256-512-10, batch 128"),
                        (True, "embedding 1000x128 -> layer norm -> 128-256-1000, 256 tokens")):
        ocl_ms, cpu_ms, ratio = step_times(10, args.repeat, block)
        print(f"{what}, AdamW step: ocl {ocl_ms:.2f} ms, CPU {cpu_ms:.2f} ms, "
              f"ratio {ratio:.1f}")


if __name__ == "__main__":
    main()
