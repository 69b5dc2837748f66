"""Per-op host overhead: median time per call of tiny ops on sim vs native CPU.

The per-op host cost is the performance frontier of a Python backend. Run:
``.venv/bin/python benchmarks/op_overhead.py [--repeat 7] [--number 2000]``.

``--cold`` times each call alone right after streaming through a buffer larger than
the caches, as a training step's large kernels do between its small ops: the host code
of an op (PyTorch's, and a Python backend's much larger share) then runs from memory.

``-b`` times another backend's device in the "sim" columns (``reference``: kernel-light,
device-only memory; ``bare_sim``; a module), as ``models.py -b``. On an asynchronous device a
run's time is what the host took to issue its calls; ``--drain`` adds the wait for the work
they queued (each run ends with a synchronisation), the device's throughput.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from torchport.tools.run import load_backend


def bench_pair(dev: Callable[[], object], cpu: Callable[[], object], number: int,
               repeat: int, flush: Callable[[], object] | None = None,
               drain: Callable[[], object] | None = None) -> tuple[float, float, float, float]:
    """Medians over ``repeat`` runs of the mean time per call, in microseconds, of the
    device and the CPU case, and the medians of the ratio and of the difference of
    back-to-back run pairs. The pairs alternate their order, so that a noisy neighbour or
    a clock change hits both sides alike. ``flush``: called before each run (``--cold``);
    ``drain``: at the end of each device run, inside its time (``--drain``)."""
    for fn in (dev, cpu):
        for _ in range(200):
            fn()
    runs: tuple[list[float], list[float]] = ([], [])
    for i in range(repeat):
        order = ((dev, runs[0]), (cpu, runs[1]))
        for fn, out in (order if i % 2 == 0 else order[::-1]):
            if flush is not None:
                flush()
            t0 = time.perf_counter()
            for _ in range(number):
                fn()
            if drain is not None and fn is dev:
                drain()
            out.append((time.perf_counter() - t0) / number * 1e6)
    ratios = [d / c for d, c in zip(*runs, strict=True)]
    extras = [d - c for d, c in zip(*runs, strict=True)]
    return (statistics.median(runs[0]), statistics.median(runs[1]), statistics.median(ratios),
            statistics.median(extras))


def cases(device: str) -> dict[str, Callable[[], object]]:
    a = torch.randn(8, 8, device=device)
    b = torch.randn(8, 8, device=device)
    w = torch.randn(8, 8, device=device)
    idx = torch.tensor([0, 3, 5], device=device)
    c = torch.empty(8, 8, device=device)
    host = torch.randn(8, 8)
    s = a.sum()
    two = torch.tensor(2.0)  # a 0-dim CPU tensor: an operand beside device tensors
    x = torch.randn(8, 16, device=device)
    w1 = torch.randn(32, 16, device=device)
    w2 = torch.randn(8, 32, device=device)
    bias = torch.randn(32, device=device)
    img = torch.randn(2, 3, 8, 8, device=device)
    kernel = torch.randn(4, 3, 3, 3, device=device)
    gain = torch.randn(8, device=device)

    def autocast_linear_softmax() -> object:
        """Two autocast policies in one region: the linear cast to bfloat16 (its weight's
        cast cached), the softmax computed in float32."""
        with torch.autocast(device, dtype=torch.bfloat16):
            return torch.nn.functional.linear(a, w).softmax(1)

    def fallback_mlp() -> object:
        """A small MLP's forward pass whose element-wise ops have no sim kernel (the CPU
        fallback, warm): hypot with a bias as its activation, nextafter and i1e on its
        output."""
        h = torch.hypot(torch.nn.functional.linear(x, w1), bias)
        y = torch.nn.functional.linear(h, w2)
        return torch.special.i1e(torch.nextafter(y, a)).sum()

    return {
        "add": lambda: a + b,
        "mul": lambda: a * b,
        "view": lambda: a.view(64),
        "sum": lambda: a.sum(),
        "linear": lambda: torch.nn.functional.linear(a, w),
        "index_select": lambda: a.index_select(0, idx),
        "getitem[idx]": lambda: a[idx],
        "cat": lambda: torch.cat([a, b]),
        "empty": lambda: torch.empty(8, 8, device=device),
        "copy_": lambda: c.copy_(a),
        "copy_ from cpu": lambda: c.copy_(host),
        # (copy=True: on the CPU, a copy too, not the tensor itself)
        "to(device) from cpu": lambda: host.to(device, copy=True),
        "to('cpu')": lambda: a.to("cpu", copy=True),
        "to(half)": lambda: a.to(torch.half),
        "item": lambda: s.item(),
        # factories whose CPU kernel is PyTorch's composite (arange's out= starts empty
        # and grows); resize_ past the storage's end
        "full": lambda: torch.full((8, 8), 2.0, device=device),
        "arange": lambda: torch.arange(64, device=device),
        "resize_ (grow)": lambda: torch.empty(0, device=device).resize_(64),
        "autocast linear+softmax": autocast_linear_softmax,
        # autograd's accumulation of a gradient laid out otherwise than its parameter
        "new_empty_strided": lambda: a.new_empty_strided((8, 8), (1, 8)),
        # random ops: the device's generator (a training step's dropout: native_dropout on
        # the device, the CPU's composite on the CPU)
        "randn": lambda: torch.randn(8, 8, device=device),
        "normal_": lambda: c.normal_(),
        "dropout": lambda: torch.nn.functional.dropout(a, 0.5),
        # an operand that is a 0-dim CPU tensor (TensorIterator's CPU scalar)
        "mul 0-dim cpu": lambda: a * two,
        # ops without a sim kernel: the CPU fallback, warm
        "hypot (fallback)": lambda: torch.hypot(a, b),
        # ops every device but the CPU and CUDA gets a composite kernel of (or, for the
        # convolution, a route to convolution_overrideable); copies within the device
        "conv2d": lambda: torch.nn.functional.conv2d(img, kernel, padding=1),
        "layer_norm": lambda: torch.nn.functional.layer_norm(a, (8,), gain, gain),
        "contiguous (a transpose)": lambda: a.t().contiguous(),
        "clone": lambda: a.clone(),
        "mlp fwd (fallback)": fallback_mlp,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--number", type=int, default=2000)
    p.add_argument("--cold", action="store_true",
                   help="time single calls after flushing the caches (--number pairs)")
    p.add_argument("--only", default="", help="comma-separated rows to time (all: empty)")
    p.add_argument("-b", "--backend", default="sim",
                   help="the device's backend, as torchport run's -b: sim, reference (kernel-"
                        "light, device-only memory), bare_sim (the sim with no kernels), a module")
    p.add_argument("--drain", action="store_true",
                   help="each device run ends with a synchronisation, inside its time")
    args = p.parse_args()
    backend = load_backend(args.backend)
    drain = torch.accelerator.synchronize if args.drain else None
    sim, cpu = cases(backend.name), cases("cpu")
    if args.only:
        keep = {n.strip() for n in args.only.split(",")}
        sim = {n: f for n, f in sim.items() if n in keep}
    memory = f"device {backend.name}, " + ("host-addressable" if backend.runtime.host_addressable
                                           else "device-only")
    if args.cold:
        src, dst = torch.randn(8 << 20), torch.empty(8 << 20)  # 32 MiB each
        print(f"torch {torch.__version__}; cold caches (a 32 MiB copy before each call); "
              f"median of {args.number} call pairs; {memory} memory")
    else:
        print(f"torch {torch.__version__}; median of {args.repeat} runs x {args.number} "
              f"calls; {memory} memory" + ("; queued work drained" if drain else ""))
    print(f"{'op':<14}{'sim (us)':>10}{'cpu (us)':>10}{'ratio':>8}{'extra (us)':>12}")
    for name in sim:
        if args.cold:  # single calls, each after the flush
            ts, tc, ratio, extra = bench_pair(sim[name], cpu[name], 1, args.number,
                                              lambda: dst.copy_(src))
        else:
            ts, tc, ratio, extra = bench_pair(sim[name], cpu[name], args.number, args.repeat,
                                              drain=drain)
        print(f"{name:<14}{ts:>10.2f}{tc:>10.2f}{ratio:>8.1f}{extra:>12.2f}")


if __name__ == "__main__":
    main()
