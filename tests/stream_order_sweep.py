"""Every operation that reads or writes device memory outside a launched kernel, issued
right after kernels queued on the stream, against the CPU: run in a child interpreter on
one backend (``python -m tests.stream_order_sweep BACKEND [-n ELEMENTS]``; ``sim`` takes the sim's mode
from the environment). Prints one ``MISMATCH name: ...`` line per difference, then
``checked N``.

A runtime that runs its queues only when the host synchronises (the walkthrough) shows an
operation that overtakes queued work at once: the kernel's result is not there yet. One
with a worker per queue shows it when the queued kernels are slow, so every kernel here
works on tensors large enough to still be running when the host goes on.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable

import torch

from tests.helpers import sweep

warnings.simplefilter("ignore")

# elements: on a runtime with queue workers, a queued kernel still runs when the host
# issues the next call (a queue run only at synchronisation needs no size: ``-n``)
N = int(sys.argv[sys.argv.index("-n") + 1]) if "-n" in sys.argv else 1 << 16


def _produced(dev: str) -> torch.Tensor:
    """A tensor whose values come from kernels queued on the current stream."""
    a = torch.ones(N, device=dev)
    return (a + a) * 3 + 1  # 7.0 everywhere, once the queue has run


def _cases(dev: str) -> dict[str, Callable[[str], object]]:
    """name -> f(device) whose result (a tensor, a number or a list) is compared with the CPU's."""
    def copy_same_layout(d):
        b = _produced(d)
        c = torch.empty(N, device=d)
        return c.copy_(b)

    def copy_strided(d):
        b = _produced(d).view(N // 256, 256)
        c = torch.empty(256, N // 256, device=d).t()
        return c.copy_(b)

    def copy_into_slice(d):
        b = _produced(d)
        c = torch.zeros(2 * N, device=d)
        c[N:].copy_(b)
        return c

    def copy_other_dtype(d):
        return torch.empty(N, dtype=torch.float64, device=d).copy_(_produced(d))

    def copy_from_cpu_then_kernel(d):
        c = torch.empty(N, device=d)
        c.copy_(torch.full((N,), 2.0))
        return c * 5

    def kernel_then_copy_from_cpu(d):
        b = _produced(d)
        s = b * 1  # a kernel reading b, queued before the host overwrites b
        b.copy_(torch.zeros(N))
        return torch.stack([s, b])

    def clone(d):
        return _produced(d).clone()

    def clone_channels_last(d):
        return _produced(d).view(4, 4, N // 1024, 64).clone(memory_format=torch.channels_last)

    def contiguous(d):
        return _produced(d).view(N // 256, 256).t().contiguous()

    def to_dtype(d):
        return _produced(d).to(torch.float16)

    def to_cpu(d):
        return _produced(d).cpu()

    def to_cpu_non_blocking(d):
        r = _produced(d).to("cpu", non_blocking=True)
        getattr(torch, d.split(":")[0]).synchronize()
        return r

    def item(d):
        return _produced(d)[-1].item()

    def tolist(d):
        return _produced(d)[:8].tolist()

    def sum_item(d):
        return _produced(d).sum().item()

    def fill(d):
        b = _produced(d)
        s = b * 1
        b.fill_(2.0)
        return torch.stack([s, b])

    def zero(d):
        b = _produced(d)
        s = b * 1
        b.zero_()
        return torch.stack([s, b])

    def fill_then_kernel(d):
        b = torch.empty(N, device=d).fill_(3.0)
        return b * b

    def factories(d):
        z = torch.zeros(N, device=d)
        o = torch.ones(N, device=d)
        f = torch.full((N,), 4.0, device=d)
        r = torch.arange(N, dtype=torch.float32, device=d)
        return z + o * 2 + f + r

    def tensor_factory(d):
        b = _produced(d)
        t = torch.tensor([1.0, 2.0, 3.0], device=d)
        return torch.cat([b[:3] + t, t])

    def fallback_op(d):
        return torch.special.erfcx(_produced(d) / 8)  # no kernel on a kernel-light device

    def fallback_inplace(d):
        b = _produced(d)
        s = b * 1
        b.atan_()
        return torch.stack([s, b])

    def index_put(d):
        b = _produced(d)
        b[torch.arange(0, N, 7, device=d)] = 5.0
        return b

    def free_then_reuse(d):
        out = []
        for _ in range(3):
            b = _produced(d)
            s = b * 2          # queued: reads b
            del b              # the block may go back to the allocator now
            c = torch.empty(N, device=d).fill_(-1.0)  # may get b's block
            out.append(s + c)
        return torch.stack(out)

    def free_then_empty_cache(d):
        b = _produced(d)
        s = b * 2          # queued: reads b
        del b
        if d != "cpu":     # the cached block goes back to the runtime: after s has run
            getattr(torch, d.split(":")[0]).empty_cache()
        return s + torch.empty(N, device=d).fill_(1.0)

    def resize(d):
        b = _produced(d)
        b.resize_(2 * N)
        return b[:N]

    def storage_bytes(d):
        return torch.frombuffer(bytearray(bytes(_produced(d).untyped_storage().cpu())),
                                dtype=torch.float32)

    def side_stream(d):
        mod = getattr(torch, d.split(":")[0])
        b = _produced(d)
        s = mod.Stream()
        s.wait_stream(mod.current_stream())
        with mod.stream(s):
            c = b.clone()
            e = torch.empty(N, device=d)
            e.copy_(c)
            r = e * 2
        mod.current_stream().wait_stream(s)
        return r

    def two_devices(d):
        mod = getattr(torch, d.split(":")[0])
        if mod.device_count() < 2:
            return _produced(d)
        b = _produced(d)
        return b.to(d.split(":")[0] + ":1").to(d)

    def grad(d):
        w = _produced(d).requires_grad_()
        (w * w).sum().backward()
        return w.grad

    return {k: v for k, v in locals().items() if callable(v) and not k.startswith("_")
            and k != "dev"}


def _same(a: object, b: object) -> str | None:
    if isinstance(a, torch.Tensor):
        a = a.cpu()
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"{a.shape} {a.dtype} vs {b.shape} {b.dtype}"
        if not torch.equal(a, b):
            bad = (a != b).nonzero()[:3].flatten().tolist()
            return f"differs at {bad}: {a.flatten()[:4].tolist()} vs {b.flatten()[:4].tolist()}"
        return None
    return None if a == b else f"{a!r} vs {b!r}"


def _lazy(rt: object) -> None:
    """The walkthrough runs a queue when asked whether it finished (as a driver may make
    progress when polled); here its queues run only when the host synchronises, so that an
    operation that overtakes queued work reads or writes before it, every time."""
    rt.query_stream = lambda index, stream: not rt._q(index, stream).work
    rt.query_event = lambda index, event: event.queue is None or not event.queue.work


def main(backend: str) -> int:
    if backend == "sim":
        importlib.import_module("torchport.sim")
        dev = "sim"
    else:
        mod = importlib.import_module(backend)
        dev = torch._C._get_privateuse1_backend_name()
        if backend.endswith("vendor_walkthrough.backend"):
            _lazy(mod.runtime)
    cases = _cases(dev)
    sweep(cases, dev, _same, rounds=2)  # the second round: every path already learnt
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
