"""Copies between CPU and device and across devices (issue 2, item 6)."""

import pytest
import torch

pytestmark = pytest.mark.modes


def test_to_and_back_bitwise():
    c = torch.randn(5, 7)
    assert torch.equal(c.to("sim").cpu(), c)
    assert torch.equal(c.to("sim:1").to("cpu"), c)


@pytest.mark.parametrize("non_blocking", [False, True])
def test_non_blocking(non_blocking):
    c = torch.randn(64)
    d = c.to("sim", non_blocking=non_blocking)
    torch.sim.synchronize()
    assert torch.equal(d.to("cpu", non_blocking=non_blocking), c)


def test_dtype_converting_copies():
    c = torch.randn(4, 4)
    assert torch.equal(c.to("sim", torch.float64).cpu(), c.double())
    assert torch.equal(c.to("sim").to(torch.float16).cpu(), c.half())
    assert torch.equal(c.to("sim").to("cpu", torch.int32), c.to(torch.int32))
    d = torch.zeros(4, 4, dtype=torch.float64, device="sim")
    d.copy_(c)
    assert torch.equal(d.cpu(), c.double())


def test_non_contiguous_source_and_destination():
    c = torch.randn(6, 4)
    d = c.to("sim")
    assert torch.equal(d.t().cpu(), c.t())
    assert torch.equal(d[:, ::2].cpu(), c[:, ::2])
    dst = torch.zeros(4, 6, device="sim")
    dst.t().copy_(c)  # strided destination
    assert torch.equal(dst.cpu(), c.t())
    dst2 = torch.zeros(6, 8, device="sim")
    dst2[:, ::2] = d  # strided slice assignment
    ref = torch.zeros(6, 8)
    ref[:, ::2] = c
    assert torch.equal(dst2.cpu(), ref)
    out = torch.zeros(4, 6)
    out.t().copy_(d)  # device -> strided CPU
    assert torch.equal(out, c.t())


def test_to_keeps_the_dimension_order_of_a_tensor_with_gaps():
    # preserve_format on a tensor that is not dense: dense strides in its own order of
    # dimensions (PyTorch's infer_dense_strides), as the CPU's and CUDA's .to() give
    base = torch.randn(2, 3, 4, 5)
    views = [lambda t: t.reshape(-1)[:8].as_strided((2, 2, 1), (2, 4, 1)),
             lambda t: t.reshape(6, 20)[:3, :4].t()[::2],
             lambda t: t.contiguous(memory_format=torch.channels_last)[:, :, ::2],
             lambda t: t.permute(3, 0, 2, 1)[::2]]
    for view in views:
        x = view(base)
        want = x.to(torch.float64).stride()  # the CPU's own _to_copy
        for d in (x.to("sim"), x.to("sim:1", torch.float64)):
            assert d.stride() == want and torch.equal(d.cpu(), x.to(d.dtype))
        dv = view(base.to("sim"))  # the same view on the device
        for moved in (dv.cpu(), dv.to(torch.float64), dv.to("sim:1"), dv.clone()):
            assert moved.stride() == want and torch.equal(moved.cpu(), x.to(moved.dtype))
    x = views[1](base)
    assert x.to("sim", memory_format=torch.contiguous_format).is_contiguous()


def test_copy_between_overlapping_views_is_refused_as_on_cpu():
    # ATen refuses a copy whose source and destination share only some memory (or share
    # it in another layout); a full, same-layout overlap and disjoint views are fine
    cases = [lambda x: x[1:].copy_(x[:-1]), lambda x: x.view(2, 2).t().copy_(x.view(2, 2)),
             lambda x: x[:3].copy_(x[2:3]), lambda x: x.copy_(x), lambda x: x[2:].copy_(x[:2]),
             lambda x: x[1:].copy_(x[:1]), lambda x: x[1:].copy_(x[:-1].double()),
             # an output with internal overlap, from the device and from the host
             lambda x: x[:1].expand(3).copy_(x[1:]),
             lambda x: x[:1].expand(3).copy_(torch.ones(3)), lambda x: x.copy_(x[:1].expand(4)),
             lambda x: x[:1].expand(3).copy_(x[:1].expand(3))]
    def outcome(case, dev: str) -> object:
        x = torch.arange(4.0, device=dev)
        try:
            case(x)
        except RuntimeError as e:
            return str(e)
        return x.tolist()
    outcomes = [(outcome(case, "sim"), outcome(case, "cpu")) for case in cases]
    assert all(got == want for got, want in outcomes)
    assert ["single memory location" in str(o) for o, _ in outcomes] == \
        [True, True, True, False, False, False, False, True, True, False, False]


def test_across_device_indices():
    c = torch.randn(3, 5)
    d0 = c.to("sim:0")
    d1 = d0.to("sim:1")
    assert d1.device.index == 1 and torch.equal(d1.cpu(), c)
    assert torch.equal(d0.t().to("sim:1").cpu(), c.t())
    e = torch.zeros(3, 5, dtype=torch.float64, device="sim:1")
    e.copy_(d0)
    assert torch.equal(e.cpu(), c.double())


def test_broadcasting_copy():
    d = torch.zeros(3, 4, device="sim")
    d.copy_(torch.arange(4.0))
    assert torch.equal(d.cpu(), torch.arange(4.0).expand(3, 4))


def test_copies_go_through_runtime(sim_backend, monkeypatch):
    """On device-only memory the bytes move by the runtime's copies: its Python methods, or
    the C copies it gives (``Runtime.native_copies``), which C++ calls for small blocking
    copies without Python."""
    from torchport.ops import native_hostops

    calls = []
    rt = sim_backend.runtime
    kernels = sim_backend.host_op_kernels
    for name in ("copy_h2d", "copy_d2h"):
        orig = getattr(rt, name)
        monkeypatch.setattr(rt, name, lambda *a, _o=orig, _n=name, **k: (calls.append(_n), _o(*a, **k))[1])

    def restage() -> None:  # C++ takes the runtime's copy methods as they are now
        if kernels.staged_core:
            kernels._staged = None
            assert kernels.staged()
    restage()
    try:
        in_c = kernels.staged_core and rt.native_copies() is not None
        c = torch.randn(8)
        served = native_hostops.counts()[0]
        d = c.to("sim")
        back = d.cpu()
        assert torch.equal(back, c)
        if kernels.staged_core:
            assert native_hostops.counts()[0] - served == 2
        if in_c:
            assert calls == []
        elif not rt.host_addressable:
            assert "copy_h2d" in calls and "copy_d2h" in calls
    finally:
        monkeypatch.undo()
        restage()


@pytest.mark.parametrize("view", ["conj", "neg", "plain"])
@pytest.mark.parametrize("dst_conj", [False, True])
def test_copy_honours_conj_and_neg_bits(view: str, dst_conj: bool) -> None:
    z = torch.randn(5, dtype=torch.complex64)
    make = {"conj": torch.conj, "neg": torch._neg_view, "plain": lambda t: t}[view]
    want = make(z).resolve_conj().resolve_neg()
    d = make(z.to("sim"))
    out = torch.empty(5, dtype=torch.complex64, device="sim")
    ref = torch.empty(5, dtype=torch.complex64)
    if dst_conj:
        out, ref = out.conj(), ref.conj()
    out.copy_(d)
    ref.copy_(make(z))
    assert torch.equal(out.cpu().resolve_conj(), ref.resolve_conj())
    assert torch.equal(out.cpu().resolve_conj(), want)
    assert torch.equal(d.cpu().resolve_conj().resolve_neg(), want)      # device -> CPU
    assert torch.equal(d.to("sim:1").cpu().resolve_conj().resolve_neg(), want)  # across devices
