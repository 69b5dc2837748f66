"""The OpenCL backend (device ``ocl``) against the CPU: per-op time of the native kernels, of
the same op forced to the CPU fallback (copies to the host and back), and of the CPU op; then
an MLP training step (AdamW) on ``ocl`` vs the CPU. Every time includes the device finishing
its queue (``torch.ocl.synchronize()``).

    OMP_NUM_THREADS=1 python benchmarks/opencl_ops.py [--size 256] [--number 50]
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable

import torch

import torchport
import torchport.opencl  # noqa: F401  (registers ocl)
from torchport.ops import set_force_fallback


def timed(fn: Callable[[], object], sync: Callable[[], None], number: int) -> float:
    """Microseconds per call, best of 3 rounds of ``number`` calls (warm: built, cached)."""
    fn()
    sync()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / number)
    return best * 1e6


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


def step_time(device: str, number: int, block: bool = False) -> float:
    """Milliseconds per AdamW step of the MLP, or (``block``) of a transformer-ish block:
    embedding, layer norm, linear, softmax over the vocabulary."""
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
    sync = torch.ocl.synchronize if device == "ocl" else (lambda: None)
    return timed(step, sync, number) / 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--number", type=int, default=50)
    args = p.parse_args()
    warnings.simplefilter("ignore")
    torchport.ops.set_fallback_warn(False)
    n = args.size
    a, b = torch.randn(n, n), torch.randn(n, n)
    i = torch.randint(0, n, (n,))
    da, db, di = a.to("ocl"), b.to("ocl"), i.to("ocl")
    print(f"device: {torch.ocl.get_device_name(0)}; torch threads: {torch.get_num_threads()}")
    print("| op | ocl native us | ocl CPU fallback us | CPU us |\n|---|---:|---:|---:|")
    for name, (overload, fn) in ops(n).items():
        native = timed(lambda fn=fn: fn(da, db, di), torch.ocl.synchronize, args.number)
        fallback = "-"
        if overload is not None:
            old = set_force_fallback([overload])
            try:
                fallback = f"{timed(lambda fn=fn: fn(da, db, di), torch.ocl.synchronize, args.number):.0f}"
            finally:
                set_force_fallback(old)
        cpu = timed(lambda fn=fn: fn(a, b, i), lambda: None, args.number)
        print(f"| {name} | {native:.0f} | {fallback} | {cpu:.0f} |")
    ocl_ms, cpu_ms = step_time("ocl", 10), step_time("cpu", 10)
    print(f"\nMLP 256-512-10, batch 128, AdamW step: ocl {ocl_ms:.2f} ms, CPU {cpu_ms:.2f} ms, "
          f"ratio {ocl_ms / cpu_ms:.2f}")
    ocl_ms, cpu_ms = step_time("ocl", 10, True), step_time("cpu", 10, True)
    print(f"embedding 1000x128 -> layer norm -> 128-256-1000, 256 tokens, AdamW step: ocl "
          f"{ocl_ms:.2f} ms, CPU {cpu_ms:.2f} ms, ratio {ocl_ms / cpu_ms:.2f}")


if __name__ == "__main__":
    main()
