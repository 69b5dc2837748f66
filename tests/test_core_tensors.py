"""Device tensors are real tensors: storage, views, layouts, dtypes (issue 2, item 4)."""

import pytest
import torch

pytestmark = pytest.mark.modes

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.int16,
          torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128,
          torch.uint16, torch.float8_e4m3fn]


def _cpu(n=4, m=6):
    return torch.randn(n, m)


def test_tensor_is_plain_and_on_device():
    t = torch.randn(3, 4, device="sim")
    assert type(t) is torch.Tensor
    assert t.device == torch.device("sim", 0) and t.is_sim
    assert t.data_ptr() != 0 and t.data_ptr() == t.untyped_storage().data_ptr()
    assert t.untyped_storage().device == torch.device("sim", 0)
    assert t.untyped_storage().nbytes() == 48


def test_device_index_1():
    t = torch.ones(2, device="sim:1")
    assert t.device.index == 1 and t.untyped_storage().device.index == 1
    assert torch.equal(t.cpu(), torch.ones(2))


@pytest.mark.parametrize("fn", [
    lambda x: x.view(6, 4), lambda x: x.reshape(2, 12), lambda x: x.t(), lambda x: x.transpose(0, 1),
    lambda x: x.permute(1, 0), lambda x: x[:1].expand(3, 6), lambda x: x.unfold(1, 2, 2),
    lambda x: x.as_strided((2, 2), (1, 2), 1), lambda x: x.diagonal(), lambda x: x[1:, ::2],
    lambda x: x.flatten(), lambda x: x.unsqueeze(0), lambda x: x[None, :, None],
    lambda x: x.narrow(1, 2, 3), lambda x: x.select(1, 3),
], ids=["view", "reshape", "t", "transpose", "permute", "expand", "unfold", "as_strided",
        "diagonal", "slice", "flatten", "unsqueeze", "none_index", "narrow", "select"])
def test_views_share_storage_and_match_cpu(fn):
    c = _cpu()
    d = c.to("sim")
    v = fn(d)
    assert v.untyped_storage().data_ptr() == d.untyped_storage().data_ptr()
    assert v.stride() == fn(c).stride() and v.storage_offset() == fn(c).storage_offset()
    assert v.is_contiguous() == fn(c).is_contiguous()
    assert torch.equal(v.cpu(), fn(c))


@pytest.mark.parametrize("split", ["split", "chunk", "unbind"])
def test_multi_output_views(split):
    c = _cpu()
    d = c.to("sim")
    f = {"split": lambda x: x.split(2, 1), "chunk": lambda x: x.chunk(3, 1),
         "unbind": lambda x: x.unbind(0)}[split]
    for a, b in zip(f(d), f(c), strict=True):
        assert a.untyped_storage().data_ptr() == d.untyped_storage().data_ptr()
        assert torch.equal(a.cpu(), b)


def test_inplace_on_view_mutates_base():
    c = _cpu()
    d = c.to("sim")
    d[:, 1].add_(1)
    d.t()[2].mul_(2)
    c[:, 1].add_(1)
    c.t()[2].mul_(2)
    assert torch.equal(d.cpu(), c)


def test_view_as_real_complex():
    z = torch.randn(3, 2, dtype=torch.complex64)
    dz = z.to("sim")
    r = torch.view_as_real(dz)
    assert r.untyped_storage().data_ptr() == dz.untyped_storage().data_ptr()
    assert torch.equal(r.cpu(), torch.view_as_real(z))
    assert torch.equal(torch.view_as_complex(r).cpu(), z)


def test_resize_grows_and_keeps_data():
    d = torch.arange(4.0, device="sim")
    d.resize_(3, 3)
    assert d.shape == (3, 3) and d.untyped_storage().nbytes() >= 36
    assert torch.equal(d.cpu().flatten()[:4], torch.arange(4.0))
    d.resize_(2)
    assert torch.equal(d.cpu(), torch.arange(2.0))


@pytest.mark.parametrize("size, message", [
    ([2, 4, 2**29, 2**29], "Storage size calculation overflowed"),  # 2**64 bytes
    ([8, 8, 2**29, 2**29], "numel: integer multiplication overflow"),
    ([0, 4, 2**61], "Stride calculation overflowed"),  # no elements, a stride of 2**63
])
def test_resize_past_int64_raises_the_cpus_error_and_keeps_the_tensor(size, message):
    for dev in ("cpu", "sim"):
        x = torch.full((), 3.0, dtype=torch.float64, device=dev)
        with pytest.raises(RuntimeError, match=message):
            x.resize_(size)
        if dev == "sim":  # the CPU sets the sizes before its storage check; the device not
            assert x.shape == () and x.item() == 3.0


_PAST_INT64 = {  # layouts past int64 (Python's integers would carry them to C++ unchecked)
    "empty, 2**64 bytes": lambda d: torch.empty([2, 4, 2**29, 2**29], device=d),
    "empty, a stride of 2**63": lambda d: torch.empty([0, 4, 2**61], device=d),
    "empty_strided": lambda d: torch.empty_strided([2, 2**62], [2**62, 1], device=d),
    "new_empty_strided": lambda d: torch.empty(3, device=d).new_empty_strided([2, 2**62],
                                                                              [2**62, 1]),
    "set_, 2**64 elements": lambda d: torch.empty(3, device=d).set_(
        torch.empty(3, device=d).untyped_storage(), 0, [2**62, 4], [1, 1]),
    "set_, 2**64 bytes": lambda d: torch.empty(3, device=d).set_(
        torch.empty(3, device=d).untyped_storage(), 0, [2**31, 2**31], [2**31, 1]),
}


@pytest.mark.parametrize("make", list(_PAST_INT64.values()), ids=list(_PAST_INT64))
def test_layouts_past_int64_raise_the_cpus_error(make):
    with pytest.raises(RuntimeError) as cpu:
        make("cpu")
    with pytest.raises(RuntimeError) as sim:  # not an OOM, OverflowError or ValueError
        make("sim")
    assert type(sim.value) is type(cpu.value) and str(sim.value) == str(cpu.value)


def test_resize_and_set_grow_the_shared_storage_in_place():
    # as on CUDA (and the CPU): the storage itself grows, so every tensor on it sees the
    # new memory, and set_ past the storage's end grows it too
    before = torch.sim.memory_allocated()
    for dev in ("cpu", "sim"):
        x = torch.arange(1.0, 5.0, device=dev).view(2, 2)
        view = x.view(4)
        x.resize_(3, 3)
        x.fill_(7)
        assert view.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        assert view.untyped_storage().nbytes() == 36 and view.tolist() == [7.0] * 4
        y = torch.arange(1.0, 5.0, device=dev)
        e = torch.empty(0, device=dev).set_(y.untyped_storage(), 2, (3,), (1,))
        e.fill_(9)
        assert y.untyped_storage().nbytes() == 20 and y.tolist() == [1.0, 2.0, 9.0, 9.0]
        del x, view, y, e
    assert torch.sim.memory_allocated() == before  # the outgrown blocks went back too


def test_set_storage_and_tensor():
    c = _cpu()
    d = c.to("sim")
    e = torch.empty(0, device="sim").set_(d.untyped_storage(), 2, (5,), (1,))
    assert torch.equal(e.cpu(), c.flatten()[2:7])
    f = torch.empty(0, device="sim").set_(d)
    assert torch.equal(f.cpu(), c) and f.untyped_storage().data_ptr() == d.data_ptr()
    g = torch.empty(3, device="sim").set_()
    assert g.numel() == 0


def test_set_storage_from_other_device_fails():
    d = torch.ones(3, device="sim:1")
    with pytest.raises(RuntimeError, match="storage is on sim:1"):
        torch.empty(0, device="sim:0").set_(d.untyped_storage(), 0, (3,), (1,))


def test_empty_strided_any_strides():
    t = torch.empty_strided((2, 3), (1, 2), device="sim")
    assert t.stride() == (1, 2) and t.untyped_storage().nbytes() == 24
    t.copy_(torch.arange(6.0).view(2, 3))
    assert torch.equal(t.cpu(), torch.arange(6.0).view(2, 3))


def test_zero_size_and_zero_dim():
    e = torch.randn(0, 3, device="sim")
    assert (e + 1).shape == (0, 3) and e.sum().item() == 0
    s = torch.tensor(3.5, device="sim")
    assert s.dim() == 0 and (s * 2).item() == 7.0


def test_channels_last():
    c = torch.randn(2, 3, 4, 5)
    d = c.to("sim", memory_format=torch.channels_last)
    assert d.is_contiguous(memory_format=torch.channels_last)
    assert d.stride() == c.contiguous(memory_format=torch.channels_last).stride()
    assert torch.equal(d.cpu(), c)
    e = torch.empty(2, 3, 4, 5, device="sim", memory_format=torch.channels_last)
    assert e.stride() == (60, 1, 15, 3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_round_trips(dtype):
    c = torch.arange(6).to(dtype) if dtype != torch.bool else torch.tensor([True, False] * 3)
    d = c.to("sim")
    assert d.dtype == dtype and d.element_size() == c.element_size()
    assert torch.equal(d.cpu().view(torch.uint8), c.view(torch.uint8))
    assert torch.equal(d[1:4].cpu().view(torch.uint8), c[1:4].view(torch.uint8))


def test_storage_methods():
    d = torch.arange(6.0, device="sim")
    s = d.untyped_storage()
    assert s.device.type == "sim" and s.nbytes() == 24
    assert d[2:].storage_offset() == 2
    cpu = s.cpu()
    assert torch.equal(torch.empty(0).set_(cpu), torch.arange(6.0).view(torch.float32))
    s2 = torch.UntypedStorage(16).sim()
    assert s2.device == torch.device("sim", 0) and s2.nbytes() == 16
    s3 = torch.UntypedStorage(8, device="sim:1")
    assert s3.device == torch.device("sim", 1)


def test_item_tolist_repr():
    c = _cpu()
    d = c.to("sim")
    assert d[0, 0].item() == c[0, 0].item()
    assert d[0].tolist() == c[0].tolist()
    assert "device='sim:0'" in repr(d)


def test_repeated_allocations_follow_what_each_call_depends_on():
    # the second call of a kind of allocation reuses the first one's checks and layout:
    # the current device, the default dtype, the memory format and the errors still count
    try:
        for _ in range(2):
            assert torch.empty(2, 3, device="sim").device == torch.device("sim", 0)
            torch.sim.set_device(1)
            assert torch.empty(2, 3, device="sim").device == torch.device("sim", 1)
            assert torch.empty_strided((2, 3), (1, 2), device="sim").device.index == 1
            torch.sim.set_device(0)
            assert torch.empty(2, 3, device="sim:1").device.index == 1
            torch.set_default_dtype(torch.float64)
            assert torch.empty(2, 3, device="sim").dtype == torch.float64
            torch.set_default_dtype(torch.float32)
            assert torch.empty(2, 3, device="sim").dtype == torch.float32
            cl = torch.empty(2, 3, 4, 5, device="sim", memory_format=torch.channels_last)
            assert cl.stride() == torch.empty(2, 3, 4, 5, memory_format=torch.channels_last).stride()
            assert torch.empty_strided((2, 3), (1, 2), device="sim").stride() == (1, 2)
            assert torch.empty(0, 3, device="sim").numel() == 0
            with pytest.raises(RuntimeError, match="channels_last"):
                torch.empty(2, 3, device="sim", memory_format=torch.channels_last)
    finally:
        torch.sim.set_device(0)
        torch.set_default_dtype(torch.float32)


def test_resize_to_the_same_sizes_keeps_the_strides_as_on_the_cpu():
    x = torch.randn(3, 4).t()
    for fmt in (None, torch.contiguous_format):
        cpu = x.clone().t().contiguous().t()
        dev = x.to("sim").t().contiguous().t()
        kw = {} if fmt is None else {"memory_format": fmt}
        assert cpu.resize_as_(torch.empty(4, 3), **kw).stride() == \
            dev.resize_as_(torch.empty(4, 3, device="sim"), **kw).stride()
        assert cpu.resize_(4, 3, **kw).stride() == dev.resize_(4, 3, **kw).stride()
        torch.testing.assert_close(dev.cpu(), cpu, rtol=0, atol=0)
