"""Strided inputs on the host-op fast path: the ``out=`` overload is used only where a trial
proves it gives the functional CPU kernel's bits for that layout (the CPU's
``native_batch_norm.out`` leaves its saved statistics unwritten for a strided input).
Every check is bit for bit against the CPU, in each sim mode."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F

import torchport.sim  # noqa: F401
from tests.helpers import host_kernels_of, python_host_kernels
from torchport.backend import active_backend
from torchport.ops.hostkernels import trials

pytestmark = pytest.mark.modes


@pytest.fixture(autouse=True)
def _python_host_kernels() -> Iterator[None]:
    """These tests follow the Python host kernels' paths (C++ serves their common calls
    where it can: tests/test_native_hostops.py)."""
    with python_host_kernels():
        yield

ASYNC = active_backend().runtime.asynchronous

# the same values and layout on both sides: (x on its device) -> a non-contiguous view
LAYOUTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "every_other": lambda t: t[..., ::2],
    "hw_transposed": lambda t: t.transpose(2, 3).contiguous().transpose(2, 3),
    "channels_last": lambda t: t.contiguous(memory_format=torch.channels_last),
    "offset": lambda t: t[1:],
}


def _bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    def raw(t: torch.Tensor) -> torch.Tensor:
        flat = torch.empty(t.numel(), dtype=t.dtype)  # (a size-1 dimension keeps any stride)
        flat.view(t.shape).copy_(t)
        return flat.view(torch.uint8)
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(raw(a), raw(b))


def _inputs(seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 3, 8, 10, generator=g) * 2 + 0.5
    w, b = torch.randn(3, generator=g), torch.randn(3, generator=g)
    return x, w, b


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_native_batch_norm_saved_statistics_on_strided_inputs(layout: str) -> None:
    x, _, _ = _inputs(0)
    view = LAYOUTS[layout]
    xs = x.to("sim")
    for _ in range(3):  # the first call of a layout is the trial, the others its plan
        got = torch.ops.aten.native_batch_norm(view(xs), None, None, None, None, True,
                                               0.1, 1e-5)
        want = torch.ops.aten.native_batch_norm(view(x), None, None, None, None, True,
                                                0.1, 1e-5)
        for g, r in zip(got, want, strict=True):
            assert (g.shape, g.stride()) == (r.shape, r.stride())
            assert _bits(g.cpu(), r)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("mode", ["train", "train_running", "eval"])
def test_batch_norm_on_strided_inputs_matches_cpu_bits(layout: str, mode: str) -> None:
    x, w, b = _inputs(1)
    view = LAYOUTS[layout]
    rm, rv = torch.randn(3) * 0.1, torch.rand(3) + 0.5
    rms, rvs = rm.to("sim"), rv.to("sim")
    xs = x.to("sim")
    training = mode != "eval"
    stats = mode != "train"
    for _ in range(3):
        got = F.batch_norm(view(xs), rms if stats else None, rvs if stats else None, w.to("sim"),
                           b.to("sim"), training=training, momentum=0.1, eps=1e-5)
        want = F.batch_norm(view(x), rm if stats else None, rv if stats else None, w, b,
                            training=training, momentum=0.1, eps=1e-5)
        assert _bits(got.cpu(), want)
        # the running statistics are updated once per call, as on the CPU
        assert _bits(rms.cpu(), rm) and _bits(rvs.cpu(), rv)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_batch_norm_backward_on_strided_inputs_matches_cpu_bits(layout: str) -> None:
    x, w, b = _inputs(2)
    view = LAYOUTS[layout]
    gy = torch.randn_like(view(x), generator=torch.Generator().manual_seed(3))
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    dev = [t.detach().to("sim").requires_grad_() for t in (x, w, b)]
    for _ in range(2):
        for t in (*leaves, *dev):
            t.grad = None
        F.batch_norm(view(leaves[0]), None, None, leaves[1], leaves[2],
                     training=True).backward(gy)
        F.batch_norm(view(dev[0]), None, None, dev[1], dev[2],
                     training=True).backward(gy.to("sim"))
        for d, c in zip(dev, leaves, strict=True):
            assert _bits(d.grad.cpu(), c.grad)


@pytest.mark.skipif(ASYNC, reason="the synchronous trial (the asynchronous one: below)")
def test_an_out_kernel_that_leaves_an_output_unwritten_is_not_used(
        monkeypatch: pytest.MonkeyPatch) -> None:
    op = torch.ops.aten.atan2.default
    a, b = torch.randn(5, 7), torch.randn(5, 7)
    torch.atan2(a.to("sim"), b.to("sim"))  # makes the op's kernel
    intos = host_kernels_of(op)
    assert intos
    for into in intos:  # an out= kernel writing nothing: the output keeps the trial's pattern
        into.layouts.clear()
        monkeypatch.setattr(into, "out_call", lambda ks, *args, out: out)
        monkeypatch.setattr(into, "binding", None)
    for _ in range(3):
        assert _bits(torch.atan2(a.to("sim"), b.to("sim")).cpu(), torch.atan2(a, b))
    assert all(v is False for into in intos for v in into.layouts.values())


@pytest.mark.skipif(ASYNC, reason="the synchronous trial (the asynchronous one: below)")
def test_an_out_kernel_giving_other_bits_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    op = torch.ops.aten.atan2.default
    a, b = torch.randn(4, 6), torch.randn(4, 6)
    torch.atan2(a.to("sim"), b.to("sim"))
    intos = host_kernels_of(op)
    sub = torch.ops.aten.sub.out._handle.redispatch_boxed
    for into in intos:  # an out= kernel of the right layout and other values
        into.layouts.clear()
        monkeypatch.setattr(into, "out_call", sub)
        monkeypatch.setattr(into, "binding", None)
    for _ in range(3):
        assert _bits(torch.atan2(a.to("sim"), b.to("sim")).cpu(), torch.atan2(a, b))
    assert all(v is False for into in intos for v in into.layouts.values())
    assert any(into.layouts for into in intos)  # the trial ran, and refused


def test_launch_trial_refuses_unwritten_outputs_and_other_bits() -> None:
    # the asynchronous path's trial, asked directly (it runs on stand-ins, on the host)
    x = torch.randn(4, 3, 8, 10).to("sim")
    bn, bn_out = torch.ops.aten.native_batch_norm.default, torch.ops.aten.native_batch_norm.out
    names = ["out", "save_mean", "save_invstd"]
    args = (x[..., ::2], None, None, None, None, True, 0.1, 1e-5)
    assert trials.launch_specs(bn, bn_out, names, args, {}) is None  # save_mean/invstd unwritten
    contiguous = (x, None, None, None, None, True, 0.1, 1e-5)
    assert trials.launch_specs(bn, bn_out, names, contiguous, {}) is not None

    atan2 = torch.ops.aten.atan2.default
    pair = (torch.randn(3, 5).to("sim"), torch.randn(3, 5).to("sim"))
    assert trials.launch_specs(atan2, torch.ops.aten.atan2.out, ["out"], pair, {}) is not None
    # the right layout, other values; then an out= writing nothing
    assert trials.launch_specs(atan2, torch.ops.aten.sub.out, ["out"], pair, {}) is None
    assert trials.launch_specs(atan2, lambda *args, out: out, ["out"], pair, {}) is None


def test_random_ops_never_take_the_trial() -> None:
    x = torch.randn(6, 8).to("sim")[:, ::2]
    with torchport.ops.record() as rec:
        for _ in range(2):
            y = F.dropout(x, 0.5, training=True)
            assert y.shape == x.shape and y.device.type == "sim"
    torch.sim.synchronize()
    subs = rec.subpaths_of("native_dropout")
    assert sum(subs.values()) == 2
    layouts = [v for o in host_kernels_of(torch.ops.aten.native_dropout.default)
               for v in o.layouts.values()]
    if active_backend().runtime.asynchronous:
        # its mask drawn by the host at the call, once; the layout proven against the CPU
        # kernel with the CPU's generator put back
        assert set(subs) == {"native:launch"}
        assert layouts and all(type(v).__name__ == "Dropped" for v in layouts)
    else:
        assert set(subs) <= {"native:random", "native:general"}
        assert not any(layouts)


def test_a_size_one_dimension_with_any_stride() -> None:
    # x[0, 1::6]: one element of stride 6 (a size-one dimension keeps any stride), which
    # the trial's byte comparison must flatten by copying, not by a view
    x = torch.randn(2, 6)
    for view in (lambda t: t[0, 1::6], lambda t: t[:, 1::6], lambda t: t[1:, ::5],
                 lambda t: t[:1, :1].expand(3, 1)):
        for _ in range(2):
            assert _bits(torch.sigmoid(view(x.to("sim"))).cpu(), torch.sigmoid(view(x)))
            assert _bits((view(x.to("sim")) * 2).cpu(), view(x) * 2)
