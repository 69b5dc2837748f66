"""Quantized tensors on the device (QuantizedPrivateUse1) and the int8/int4 matmul kernels
torchao's int8 paths reach; the CPU is the oracle, bit for bit.

Default memory only in ``make test``; ``make quant`` runs the module in the three modes."""

import io

import pytest
import torch

import torchport.ops as tops
from tests.helpers import check_python

pytestmark = [pytest.mark.filterwarnings("ignore::torchport.ops.FallbackWarning"),
              pytest.mark.filterwarnings("ignore:.*quantized tensor creation.*:UserWarning")]

DTYPES = [torch.qint8, torch.quint8, torch.qint32]


def _zero_point(dtype: torch.dtype) -> int:
    return 0 if dtype == torch.qint8 else 3


def assert_same_q(d: torch.Tensor, c: torch.Tensor) -> None:
    """``d`` (device) is ``c`` (CPU): dtype, layout, quantization parameters, integers."""
    assert d.device.type == "sim" and c.device.type == "cpu"
    assert d.is_quantized and d.dtype == c.dtype and d.qscheme() == c.qscheme()
    assert d.shape == c.shape and d.stride() == c.stride()
    assert d.storage_offset() == c.storage_offset()
    if c.qscheme() == torch.per_tensor_affine:
        assert d.q_scale() == c.q_scale() and d.q_zero_point() == c.q_zero_point()
    else:
        assert d.q_per_channel_axis() == c.q_per_channel_axis()
        assert d.q_per_channel_scales().device.type == "sim"
        assert torch.equal(d.q_per_channel_scales().cpu(), c.q_per_channel_scales())
        assert torch.equal(d.q_per_channel_zero_points().cpu(), c.q_per_channel_zero_points())
    assert torch.equal(d.int_repr().cpu(), c.int_repr())
    assert torch.equal(d.dequantize().cpu(), c.dequantize())


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_per_tensor_matches_the_cpu(dtype: torch.dtype) -> None:
    x = torch.randn(5, 7) * 3
    d = torch.quantize_per_tensor(x.to("sim"), 0.037, _zero_point(dtype), dtype)
    c = torch.quantize_per_tensor(x, 0.037, _zero_point(dtype), dtype)
    assert_same_q(d, c)
    assert d.int_repr().device.type == "sim" and d.dequantize().device.type == "sim"


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("float_qparams", [False, True])
def test_quantize_per_channel_matches_the_cpu(axis: int, float_qparams: bool) -> None:
    x = torch.randn(6, 4) * 2
    n = x.shape[axis]
    scales = torch.rand(n, dtype=torch.float64) * 0.1 + 0.01
    zps = torch.rand(n) * 5 if float_qparams else torch.randint(0, 20, (n,))
    dtype = torch.quint8
    c = torch.quantize_per_channel(x, scales, zps, axis, dtype)
    d = torch.quantize_per_channel(x.to("sim"), scales.to("sim"), zps.to("sim"), axis, dtype)
    assert d.qscheme() == (torch.per_channel_affine_float_qparams if float_qparams
                           else torch.per_channel_affine)
    assert_same_q(d, c)


def test_sub_byte_dtypes() -> None:
    """quint4x2: made on the device; its copies fail with the CPU's own error (its copy
    kernel has no sub-byte case: ``clone`` fails there too)."""
    x = torch.rand(3, 5)
    c = torch.quantize_per_tensor(x, 0.1, 0, torch.quint4x2)
    d = torch.quantize_per_tensor(x.to("sim"), 0.1, 0, torch.quint4x2)
    assert d.dtype == torch.quint4x2 and d.device.type == "sim"
    assert torch.equal(d.int_repr().cpu(), c.int_repr())
    assert torch.equal(d.dequantize().cpu(), c.dequantize())
    with pytest.raises(NotImplementedError) as want:
        c.clone()
    with pytest.raises(NotImplementedError) as got:
        c.to("sim")
    assert str(got.value) == str(want.value)


@pytest.mark.parametrize("dtype", DTYPES)
def test_to_device_and_back(dtype: torch.dtype) -> None:
    x = torch.rand(4, 6) * 2
    c = torch.quantize_per_tensor(x, 0.01, _zero_point(dtype), dtype)
    d = c.to("sim")
    assert d.device == torch.device("sim", 0) and d.dtype == dtype
    back = d.cpu()
    assert back.q_scale() == c.q_scale() and back.q_zero_point() == c.q_zero_point()
    assert torch.equal(back.int_repr(), c.int_repr())
    assert torch.equal(back.dequantize(), c.dequantize())
    assert torch.equal(c.to("sim:1").to("sim:0").cpu().int_repr(), c.int_repr())


def test_to_device_of_strided_cpu_tensors() -> None:
    c = torch.quantize_per_tensor(torch.randn(6, 8), 0.02, 0, torch.qint8)
    for v in (c.t(), c[1:5, ::2], c[2]):
        d = v.to("sim")
        assert torch.equal(d.int_repr().cpu(), v.int_repr())
        assert torch.equal(d.dequantize().cpu(), v.dequantize())
        assert d.stride() == v.to("cpu", copy=True).stride()  # the layout the CPU's copy has


def test_per_channel_to_device_and_back() -> None:
    c = torch.quantize_per_channel(torch.randn(3, 5), torch.tensor([0.1, 0.02, 0.3]),
                                   torch.tensor([1, 0, 7]), 0, torch.quint8)
    d = c.to("sim")
    assert_same_q(d, c)
    assert torch.equal(d.cpu().dequantize(), c.dequantize())
    assert d.cpu().q_per_channel_scales().device.type == "cpu"


VIEWS = {
    "flatten": lambda t: t.flatten(),
    "ravel": lambda t: t.ravel(),
    "view": lambda t: t.view(8, 6),
    "reshape": lambda t: t.reshape(2, -1),
    "select": lambda t: t[1],
    "slice": lambda t: t[:, 1:5:2],
    "transpose": lambda t: t.t(),
    "permute": lambda t: t.unsqueeze(0).permute(2, 0, 1),
    "narrow": lambda t: t.narrow(0, 1, 2),
    "contiguous": lambda t: t.t().contiguous(),
    "reshape-copy": lambda t: t.t().reshape(-1),
    "clone": lambda t: t.clone(),
    "detach": lambda t: t.detach(),
}


@pytest.mark.parametrize("name", list(VIEWS))
def test_views_and_copies(name: str) -> None:
    f = VIEWS[name]
    c = torch.quantize_per_tensor(torch.randn(6, 8), 0.05, 2, torch.quint8)
    d = c.to("sim")
    assert_same_q(f(d), f(c))
    aliases = f(c).untyped_storage().data_ptr() == c.untyped_storage().data_ptr()
    assert (f(d).untyped_storage().data_ptr() == d.untyped_storage().data_ptr()) == aliases


@pytest.mark.parametrize("size", [[0, 2, 3], [3, 0, 2], [5, 5]])
def test_ravel_and_flatten_of_new_tensors(size: list[int]) -> None:
    """As PyTorch's own device-generic view tests do it: an uninitialised tensor made on the
    device, its views and copies (also with no elements)."""
    d = torch._empty_affine_quantized(size, scale=2, zero_point=3, dtype=torch.quint8,
                                      device="sim")
    c = d.cpu()
    flat = d.ravel()
    assert flat._base is d and flat.is_contiguous() and flat.shape == (c.numel(),)
    assert torch.equal(flat.dequantize().cpu(), c.ravel().dequantize())
    assert torch.equal(d.flatten(0, -1).int_repr().cpu(), c.flatten(0, -1).int_repr())
    nc = d.t() if len(size) == 2 else d.transpose(0, 2)
    flat = nc.ravel()  # a copy where not contiguous, as on the CPU
    c_nc = c.t() if len(size) == 2 else c.transpose(0, 2)
    assert (flat._base is d) == (c_nc.ravel()._base is c) and flat.is_contiguous()
    assert torch.equal(flat.int_repr().cpu(), nc.cpu().ravel().int_repr())


def test_per_channel_views() -> None:
    c = torch.quantize_per_channel(torch.randn(4, 6), torch.rand(4) + 0.01,
                                   torch.randint(0, 9, (4,)), 0, torch.qint8)
    d = c.to("sim")
    for f in (lambda t: t.view(4, 2, 3), lambda t: t.clone(), lambda t: t[1:3]):
        assert_same_q(f(d), f(c))
    with pytest.raises(RuntimeError, match="uniformly quantized"):  # as on the CPU
        c.t()
    with pytest.raises(RuntimeError, match="uniformly quantized"):
        d.t()


def test_a_view_sees_writes_to_its_base() -> None:
    c = torch.quantize_per_tensor(torch.randn(4, 4), 0.1, 0, torch.qint8)
    other = torch.quantize_per_tensor(torch.randn(4, 4), 0.1, 0, torch.qint8)
    d = c.to("sim")
    row = d[2]
    d.copy_(other.to("sim"))
    assert torch.equal(row.int_repr().cpu(), other[2].int_repr())
    assert torch.equal(d.int_repr().cpu(), other.int_repr())


@pytest.mark.parametrize("size", [(3, 3), (1, 2), (4, 5, 2)])
def test_resize_keeps_the_bytes(size: tuple) -> None:
    c = torch.quantize_per_tensor(torch.randn(2, 3), 0.1, 0, torch.qint8)
    d = c.to("sim").resize_(size)
    c = c.clone().resize_(size)
    assert d.shape == c.shape and d.stride() == c.stride() and d.q_scale() == c.q_scale()
    assert torch.equal(d.int_repr().cpu().flatten()[:6], c.int_repr().flatten()[:6])


def test_repr() -> None:
    c = torch.quantize_per_tensor(torch.randn(2, 3), 0.1, 0, torch.qint8)
    assert " ".join(repr(c.to("sim")).replace("device='sim:0', ", "").split()) \
        == " ".join(repr(c).split())


def test_copy_and_equal() -> None:
    c = torch.quantize_per_tensor(torch.randn(3, 4), 0.1, 1, torch.quint8)
    d = c.to("sim")
    e = torch.empty_like(d)
    assert e.device.type == "sim" and e.q_scale() == 0.1 and e.q_zero_point() == 1
    e.copy_(d)
    assert torch.equal(e, d) and e.equal(d)
    e.copy_(c)  # from the host
    assert torch.equal(e.int_repr().cpu(), c.int_repr())
    host = torch.empty_like(c)
    host.copy_(d)  # to the host
    assert torch.equal(host.int_repr(), c.int_repr())
    other = torch.quantize_per_tensor(torch.randn(3, 4), 0.1, 1, torch.quint8)
    assert torch.equal(d, other.to("sim")) == torch.equal(c, other)
    x = torch.randn(3, 4)
    e.copy_(x.to("sim"))  # a float source is quantized with the destination's parameters
    host.copy_(x)
    assert torch.equal(e.int_repr().cpu(), host.int_repr())


def test_copy_errors_are_the_cpus() -> None:
    c = torch.quantize_per_tensor(torch.randn(3), 0.1, 0, torch.qint8)
    with pytest.raises(RuntimeError, match="quantized Tensor to non-quantized") as want:
        torch.empty(3).copy_(c)
    with pytest.raises(RuntimeError) as got:
        torch.empty(3, device="sim").copy_(c.to("sim"))
    assert str(got.value) == str(want.value)


def test_copy_that_changes_the_quantizer_is_refused() -> None:
    d = torch.quantize_per_tensor(torch.randn(3), 0.1, 0, torch.qint8).to("sim")
    src = torch.quantize_per_tensor(torch.randn(3), 0.2, 0, torch.qint8).to("sim")
    with pytest.raises(tops.QuantizerMismatchError, match="clone"):
        d.copy_(src)
    assert isinstance(tops.QuantizerMismatchError("x"), NotImplementedError)


@pytest.mark.parametrize("per_channel", [False, True])
def test_serialization_both_ways(per_channel: bool) -> None:
    x = torch.randn(4, 5)
    if per_channel:
        c = torch.quantize_per_channel(x, torch.rand(4, dtype=torch.float64) + 0.01,
                                       torch.randint(0, 9, (4,)), 0, torch.quint8)
    else:
        c = torch.quantize_per_tensor(x, 0.03, 4, torch.quint8)
    buf = io.BytesIO()
    torch.save({"q": c.to("sim")}, buf)
    buf.seek(0)
    assert_same_q(torch.load(buf)["q"], c)
    buf.seek(0)
    host = torch.load(buf, map_location="cpu")["q"]
    assert host.device.type == "cpu" and torch.equal(host.int_repr(), c.int_repr())
    buf = io.BytesIO()
    torch.save(c, buf)
    buf.seek(0)
    assert_same_q(torch.load(buf, map_location="sim"), c)


def test_device_memory_is_taken_and_returned() -> None:
    torch.sim.synchronize()
    before = torch.sim.memory_allocated()
    d = torch.quantize_per_tensor(torch.randn(1024, 64, device="sim"), 0.1, 0, torch.qint8)
    assert torch.sim.memory_allocated() >= before + 1024 * 64
    del d
    torch.sim.synchronize()
    assert torch.sim.memory_allocated() == before


def test_quantized_factories_on_the_device() -> None:
    q = torch._empty_affine_quantized([2, 3], scale=0.5, zero_point=2, dtype=torch.quint8,
                                      device="sim")
    assert q.device.type == "sim" and q.shape == (2, 3) and q.q_scale() == 0.5
    e = torch.empty(3, dtype=torch.qint8, device="sim")
    assert e.device.type == "sim" and e.dtype == torch.qint8


def test_without_the_cpp_allocator_the_error_says_why() -> None:
    out = check_python("""
        import warnings
        import torch
        import torchport.sim
        import torchport.ops as tops
        warnings.simplefilter("ignore")
        for make in (lambda: torch.quantize_per_tensor(torch.ones(3, device="sim"), 0.1, 0,
                                                       torch.qint8),
                     lambda: torch.quantize_per_tensor(torch.ones(3), 0.1, 0,
                                                       torch.qint8).to("sim")):
            try:
                make()
            except tops.QuantizedUnavailableError as e:
                print("ERR", "TORCHPORT_NATIVE=0" in str(e))
        print("ALIVE", torch.ones(2, device="sim").sum().item())
    """, TORCHPORT_NATIVE="0")
    assert out.count("ERR True") == 2 and "ALIVE 2.0" in out


F = torch.nn.functional
QUANTIZED_OPS = {
    "relu": lambda q: F.relu(q),
    "hardtanh": lambda q: F.hardtanh(q),
    "sigmoid": lambda q: torch.sigmoid(q),
    "max_pool2d": lambda q: F.max_pool2d(q, 2),
    "avg_pool2d": lambda q: F.avg_pool2d(q, 2),
    "adaptive_avg_pool2d": lambda q: F.adaptive_avg_pool2d(q, 1),
    "upsample_nearest": lambda q: F.interpolate(q, scale_factor=2, mode="nearest"),
    "cat": lambda q: torch.cat([q, q], 1),
    "mean": lambda q: q.mean((2, 3)),
    "topk": lambda q: q.flatten().topk(3)[0],
    "fill_": lambda q: q.clone().fill_(0.5),
    "index_select": lambda q: q.index_select(1, torch.tensor([2, 0], device=q.device)),
    "quantized::add": lambda q: torch.ops.quantized.add(q, q, 0.1, 10),
    "quantized::mul": lambda q: torch.ops.quantized.mul(q, q, 0.2, 10),
}


@pytest.mark.parametrize("name", list(QUANTIZED_OPS))
def test_quantized_ops_compute_as_the_cpu(name: str) -> None:
    f = QUANTIZED_OPS[name]
    c = torch.quantize_per_tensor(torch.randn(2, 3, 6, 6), 0.05, 64, torch.quint8)
    assert_same_q(f(c.to("sim")), f(c))


def _quantizing_calls(dev: str) -> list:
    """Quantization on ``dev``: the dense ops that make quantized tensors, ``int_repr`` and
    ``dequantize`` of each scheme and sub-byte dtype, quantized kernels, fake quantization."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 3, 4, 4, generator=g) * 2).to(dev)
    scales, zps = torch.tensor([0.05, 0.1, 0.02]).to(dev), torch.tensor([3, 0, 7]).to(dev)
    qt = torch.quantize_per_tensor(x, 0.05, 64, torch.quint8)
    qs = torch.quantize_per_tensor(x, torch.tensor(0.03).to(dev), torch.tensor(2).to(dev),
                                   torch.qint8)
    qc = torch.quantize_per_channel(x, scales, zps, 1, torch.qint32)
    q4 = torch.quantize_per_tensor(x, 0.3, 8, torch.quint4x2)
    qd = torch.quantize_per_tensor_dynamic(x, torch.quint8, False)
    made = torch._make_per_tensor_quantized_tensor(qt.int_repr(), 0.05, 64)
    fake, mask = torch.ops.aten.fake_quantize_per_tensor_affine_cachemask(x, 0.1, 3, 0, 255)
    return [*(q.int_repr() for q in (qt, qs, qc, q4, qd, made)),
            *(q.dequantize() for q in (qt, qs, qc, q4, qd, made)),
            F.max_pool2d(qt, 2).int_repr(), torch.ops.quantized.add(qt, qt, 0.1, 10).int_repr(),
            qt.mean((2, 3)).int_repr(), fake, mask]


def test_quantized_ops_are_the_sims_own_kernels() -> None:
    """The sim computes with the CPU's kernels and declares its quantized ones its own (as
    its sparse ones): no fallback warning, the native path, the CPU's results."""
    import warnings
    expected = _quantizing_calls("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error", tops.FallbackWarning)
        with tops.record() as r:
            got = _quantizing_calls("sim")
    for g, e in zip(got, expected, strict=True):
        assert g.device.type == "sim" and g.dtype == e.dtype and g.stride() == e.stride()
        assert torch.equal(g.cpu(), e)
    for name in ("quantize_per_tensor", "quantize_per_tensor.tensor_qparams",
                 "quantize_per_channel", "quantize_per_tensor_dynamic", "int_repr",
                 "dequantize.self", "quantized_max_pool2d", "fake_quantize_per_tensor_affine_cachemask"):
        assert r.path_of(name) == "native", (name, r.ops[name].paths)


@pytest.fixture
def without_quantized_host_ops(monkeypatch):
    """The sim as a backend that did not declare the CPU's quantized kernels its own."""
    from torchport.ops import fallback, quantized
    monkeypatch.setattr(quantized, "_HOST_VIEW", [])
    monkeypatch.setattr(fallback, "_WARNED", set())
    monkeypatch.setattr(fallback, "_WARNED_SITES", set())


@pytest.mark.usefixtures("without_quantized_host_ops")
def test_other_backends_take_the_cpu_fallback_with_its_warning() -> None:
    x = torch.randn(3, 5)
    with pytest.warns(tops.FallbackWarning, match="quantize_per_tensor"), tops.record() as r:
        d = torch.quantize_per_tensor(x.to("sim"), 0.05, 3, torch.quint8)
    with pytest.warns(tops.FallbackWarning, match="int_repr"):
        ints = d.int_repr()
    c = torch.quantize_per_tensor(x, 0.05, 3, torch.quint8)
    assert torch.equal(ints.cpu(), c.int_repr())
    assert r.path_of("quantize_per_tensor") == "fallback"


def test_eager_mode_quantized_modules() -> None:
    """torch.ao's quantized modules (packed weights stay the CPU's objects) on device inputs."""
    import torch.ao.nn.quantized as nnq
    import torch.ao.nn.quantized.dynamic as nnqd
    lin = nnq.Linear(8, 4)
    lin.set_weight_bias(torch.quantize_per_tensor(torch.randn(4, 8), 0.05, 0, torch.qint8),
                        torch.randn(4))
    lin.scale, lin.zero_point = 0.1, 64
    x = torch.quantize_per_tensor(torch.randn(5, 8), 0.05, 64, torch.quint8)
    assert_same_q(lin(x.to("sim")), lin(x))
    conv = nnq.Conv2d(3, 4, 3)
    xi = torch.quantize_per_tensor(torch.randn(1, 3, 8, 8), 0.05, 64, torch.quint8)
    assert_same_q(conv(xi.to("sim")), conv(xi))
    dyn = nnqd.Linear(8, 4)
    xf = torch.randn(5, 8)
    y = dyn(xf.to("sim"))
    assert y.device.type == "sim" and torch.equal(y.cpu(), dyn(xf))


def test_a_runtime_may_refuse_quantized_dtypes() -> None:
    out = check_python("""
        import warnings
        import torch
        from torchport.backends.sim import SimRuntime, make_backend
        warnings.simplefilter("ignore")
        make_backend(SimRuntime(unsupported_dtypes={torch.qint8})).register()
        for make in (lambda: torch.quantize_per_tensor(torch.ones(3, device="sim"), 0.1, 0,
                                                       torch.qint8),
                     lambda: torch.quantize_per_tensor(torch.ones(3), 0.1, 0,
                                                       torch.qint8).to("sim"),
                     lambda: torch._empty_affine_quantized([2], scale=1.0, zero_point=0,
                                                           dtype=torch.qint8, device="sim")):
            try:
                make()
                print("MADE")
            except TypeError as e:
                print("ERR", e)
        q = torch.quantize_per_tensor(torch.ones(3, device="sim"), 0.1, 0, torch.quint8)
        print("QUINT8", q.device, q.int_repr().cpu().tolist())
    """)
    assert out.count("ERR sim does not support torch.qint8") == 3, out
    assert "QUINT8 sim:0 [10, 10, 10]" in out


# ---- the int8/int4 matmul kernels -------------------------------------------------------

def _paths(fn) -> dict[str, str]:
    with tops.record() as r:
        fn()
    return {n: r.path_of(n) for n in ("_int_mm", "_weight_int8pack_mm", "mm")}


def test_low_bit_kernels_are_native_and_exact() -> None:
    a = torch.randint(-128, 128, (16, 32), dtype=torch.int8)
    b = torch.randint(-128, 128, (32, 24), dtype=torch.int8)
    x, w, s = torch.randn(5, 32), torch.randint(-128, 128, (24, 32), dtype=torch.int8), \
        torch.rand(24)
    out: dict[str, torch.Tensor] = {}

    def run() -> None:
        out["int_mm"] = torch._int_mm(a.to("sim"), b.to("sim"))
        out["int8pack"] = torch._weight_int8pack_mm(x.to("sim"), w.to("sim"), s.to("sim"))
    paths = _paths(run)
    assert paths["_int_mm"] == "native" and paths["_weight_int8pack_mm"] == "native"
    assert torch.equal(out["int_mm"].cpu(), torch._int_mm(a, b))
    assert torch.equal(out["int8pack"].cpu(), torch._weight_int8pack_mm(x, w, s))
    o = torch.empty(16, 24, dtype=torch.int32, device="sim")
    torch._int_mm(a.to("sim"), b.to("sim"), out=o)
    assert torch.equal(o.cpu(), torch._int_mm(a, b))


def test_int4_cpu_kernels_run_on_the_device() -> None:
    n, k, group = 16, 64, 32
    w = torch.randint(0, 16, (n, k), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w, 1)
    packed_d = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.to("sim"), 1)
    assert torch.equal(packed_d.cpu(), packed)
    sz = torch.rand(k // group, n, 2)
    x = torch.randn(3, k)
    want = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, sz)
    got = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to("sim"), packed_d, group, sz.to("sim"))
    assert torch.equal(got.cpu(), want)


def test_out_dtype_int8_mm_reaches_int_mm() -> None:
    from torch._higher_order_ops.out_dtype import out_dtype
    a = torch.randint(-128, 128, (8, 16), dtype=torch.int8)
    b = torch.randint(-128, 128, (16, 8), dtype=torch.int8)
    out: dict[str, torch.Tensor] = {}

    def run() -> None:
        out["r"] = out_dtype(torch.ops.aten.mm.default, torch.int32, a.to("sim"), b.to("sim"))
    assert _paths(run)["_int_mm"] == "native"
    assert torch.equal(out["r"].cpu(), torch._int_mm(a, b))
    f = out_dtype(torch.ops.aten.mm.default, torch.float64, a.float().to("sim"),
                  b.float().to("sim"))  # anything else: PyTorch's own lowering
    assert torch.equal(f.cpu(), out_dtype(torch.ops.aten.mm.default, torch.float64,
                                          a.float(), b.float()))


def test_a_vendor_declares_its_own_int8_kernel() -> None:
    out = check_python("""
        import torch
        from torchport.backends.sim import make_backend
        from torchport.ops import KernelSet
        ks = KernelSet("vendor-int8")
        calls = []

        @ks.kernel("_int_mm")
        def int_mm(a, b):
            calls.append(a.shape)
            return torch.ops.aten.mm(a.to(torch.int32), b.to(torch.int32))

        backend = make_backend()
        backend.kernel_sets.insert(0, ks)
        backend.register()
        a = torch.randint(-128, 128, (4, 8), dtype=torch.int8)
        b = torch.randint(-128, 128, (8, 4), dtype=torch.int8)
        r = torch._int_mm(a.to("sim"), b.to("sim"))
        print("CALLS", len(calls), torch.equal(r.cpu(), torch._int_mm(a, b)))
    """)
    assert "CALLS 1 True" in out


# ---- torchao ----------------------------------------------------------------------------

def _torchao_model(config_name: str):
    torchao = pytest.importorskip(
        "torchao", reason="torchao is optional: pip install -e '.[quant]' (torchao 0.18.0)")
    import torchao.quantization as tq
    from torchao.quantization import quantize_
    assert torchao.__version__.startswith("0.18")
    torch.manual_seed(0)
    cpu = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    dev = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    dev.load_state_dict(cpu.state_dict())
    dev = dev.to("sim")
    quantize_(cpu, getattr(tq, config_name)())
    quantize_(dev, getattr(tq, config_name)())
    return cpu, dev


@pytest.mark.parametrize("config_name", ["Int8WeightOnlyConfig",
                                         "Int8DynamicActivationInt8WeightConfig"])
def test_torchao_int8_matches_the_cpu(config_name: str) -> None:
    cpu, dev = _torchao_model(config_name)
    x = torch.randn(8, 64)
    out: dict[str, torch.Tensor] = {}

    def run() -> None:
        out["y"] = dev(x.to("sim"))
    paths = _paths(run)
    assert torch.equal(out["y"].cpu(), cpu(x))
    if config_name == "Int8DynamicActivationInt8WeightConfig":
        assert paths["_int_mm"] == "native"  # the int8 kernel, not widened int32 mm
    else:
        assert paths["mm"] == "native"


def test_the_example_matches_the_cpu() -> None:
    pytest.importorskip("torchao", reason="torchao is optional: pip install -e '.[quant]'")
    out = check_python("""
        import runpy
        import sys
        sys.argv = ["quantize_int8.py"]
        try:
            runpy.run_path("examples/quantize_int8.py", run_name="__main__")
        except SystemExit as e:
            print("EXIT", e.code)
    """)
    assert out.count("device == CPU: True") == 3 and "EXIT 0" in out, out
    assert "'_int_mm': 'native'" in out
