"""Ops PyTorch calls only for non-CPU devices (``torchport.ops.device_routes``).

On a PrivateUse1 device PyTorch's C++ routes LSTM/GRU cells to ``_thnn_fused_*``,
integer ``histc`` to a kernel the CPU lacks, and convolution without a device
kernel to ``convolution_overrideable``: none has a CPU kernel for the fallback.

RNN tolerances: on a non-CPU device ``RNN.cpp`` computes a cell's gates as
``matmul`` without bias, then the fused cell adds ``((x W_ih^T + h W_hh^T) + b_ih) +
b_hh``; the CPU's path adds each bias inside ``linear``. Same math, other rounding
order: a few ULPs (the bounds below), not bit for bit. Everything else is bit for bit.
"""

from __future__ import annotations

import copy
import os
import textwrap
import warnings

import pytest
import torch
import torch.nn as nn
from torch.testing import assert_close

import torchport
from tests.helpers import run_python
from torchport.core import native
from torchport.ops import FallbackWarning, fallback, plan
from torchport.ops.plan import plan_for

pytestmark = pytest.mark.modes

# a few ULPs of float32/float64 after two layers and a few time steps
RNN_TOL = {torch.float32: {"rtol": 2e-6, "atol": 2e-6},
           torch.float64: {"rtol": 1e-14, "atol": 1e-14}}


@pytest.fixture(autouse=True)
def _quiet_fallback():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        yield


# ---- LSTM / GRU ----------------------------------------------------------------------
def _rnn_run(mod: nn.Module, dev: str, x: torch.Tensor, hx, lengths=None, grad: bool = True):
    """Forward (+ backward of a loss over every output) on ``dev``; returns outputs then
    the gradients of input, initial states and parameters, all on the CPU."""
    m = copy.deepcopy(mod).to(dev)
    xd = x.detach().to(dev).requires_grad_(grad)
    hs = hx if isinstance(hx, tuple) else (hx,)
    hd = tuple(h.detach().to(dev).requires_grad_(grad) for h in hs)
    arg = hd if isinstance(hx, tuple) else hd[0]
    inp = xd
    if lengths is not None:
        inp = nn.utils.rnn.pack_padded_sequence(xd, lengths, batch_first=m.batch_first,
                                                enforce_sorted=False)
    out, h = m(inp, arg)
    if lengths is not None:
        out = out.data
    finals = h if isinstance(h, tuple) else (h,)
    res = [out, *finals]
    if grad:
        loss = (out * out.detach().cos()).sum() + sum((t * t).sum() for t in finals)
        loss.backward()
        res += [xd.grad, *[t.grad for t in hd], *[p.grad for p in m.parameters()]]
    return [r.cpu() for r in res]


def _compare(mod, x, hx, dev="sim", lengths=None, grad=True):
    want = _rnn_run(mod, "cpu", x, hx, lengths, grad)
    got = _rnn_run(mod, dev, x, hx, lengths, grad)
    assert len(want) == len(got)
    for w, g in zip(want, got, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert_close(g, w, **RNN_TOL[w.dtype])


def _make(kind: str, dtype: torch.dtype, *, layers=2, bidirectional=False, batch_first=False,
          bias=True, proj_size=0, batch=3, steps=5, inp=4, hidden=6):
    d = 2 if bidirectional else 1
    if kind == "lstm":
        mod = nn.LSTM(inp, hidden, num_layers=layers, bidirectional=bidirectional,
                      batch_first=batch_first, bias=bias, proj_size=proj_size)
        hr = proj_size or hidden
        hx = (torch.randn(layers * d, batch, hr, dtype=dtype),
              torch.randn(layers * d, batch, hidden, dtype=dtype))
    else:
        mod = nn.GRU(inp, hidden, num_layers=layers, bidirectional=bidirectional,
                     batch_first=batch_first, bias=bias)
        hx = torch.randn(layers * d, batch, hidden, dtype=dtype)
    shape = (batch, steps, inp) if batch_first else (steps, batch, inp)
    return mod.to(dtype), torch.randn(shape, dtype=dtype), hx


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("bidirectional,batch_first", [(False, False), (True, True)])
def test_rnn_forward_backward_match_cpu(kind, dtype, bidirectional, batch_first):
    mod, x, hx = _make(kind, dtype, bidirectional=bidirectional, batch_first=batch_first)
    _compare(mod, x, hx)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_rnn_without_bias(kind):
    mod, x, hx = _make(kind, torch.float32, bias=False, bidirectional=True)
    _compare(mod, x, hx)


def test_lstm_proj_size():
    mod, x, hx = _make("lstm", torch.float64, proj_size=3, bidirectional=True)
    _compare(mod, x, hx)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("batch_first", [False, True])
def test_rnn_packed_sequence(kind, batch_first):
    mod, x, hx = _make(kind, torch.float32, bidirectional=True, batch_first=batch_first,
                       batch=4)
    _compare(mod, x, hx, lengths=torch.tensor([5, 2, 4, 1]))


def test_rnn_second_device_and_no_grad():
    mod, x, hx = _make("lstm", torch.float32)
    _compare(mod, x, hx, dev="sim:1")
    mod, x, hx = _make("gru", torch.float32)
    with torch.no_grad():
        want = _rnn_run(mod, "cpu", x, hx, grad=False)
        got = _rnn_run(mod, "sim:1", x, hx, grad=False)
    for w, g in zip(want, got, strict=True):
        assert_close(g, w, **RNN_TOL[torch.float32])


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cells_match_cpu(bias, dtype):
    x = torch.randn(3, 4, dtype=dtype)
    for cell, hx in ((nn.LSTMCell(4, 5, bias=bias), (torch.randn(3, 5, dtype=dtype),
                                                      torch.randn(3, 5, dtype=dtype))),
                     (nn.GRUCell(4, 5, bias=bias), torch.randn(3, 5, dtype=dtype))):
        cell = cell.to(dtype)
        res = {}
        for dev in ("cpu", "sim"):
            c = copy.deepcopy(cell).to(dev)
            xd = x.detach().to(dev).requires_grad_()
            hs = hx if isinstance(hx, tuple) else (hx,)
            hd = tuple(h.detach().to(dev).requires_grad_() for h in hs)
            out = c(xd, hd if isinstance(hx, tuple) else hd[0])
            outs = out if isinstance(out, tuple) else (out,)
            sum((o * o).sum() for o in outs).backward()
            res[dev] = [*outs, xd.grad, *[h.grad for h in hd], *[p.grad for p in c.parameters()]]
        for w, g in zip(res["cpu"], res["sim"], strict=True):
            assert_close(g.cpu(), w, **RNN_TOL[dtype])


@pytest.mark.parametrize("cell", [nn.GRUCell, nn.LSTMCell])
def test_rnn_double_backward_takes_differentiable_formula(cell):
    # create_graph=True: autograd uses the differentiable ATen formula, not the fused one
    cell = cell(3, 4).double()
    x = torch.randn(2, 3, dtype=torch.double)
    res = {}
    for dev in ("cpu", "sim"):
        c = copy.deepcopy(cell).to(dev)
        xd = x.detach().to(dev).requires_grad_()
        out = c(xd)
        y = sum(o.pow(2).sum() for o in (out if isinstance(out, tuple) else (out,)))
        g, = torch.autograd.grad(y, xd, create_graph=True)
        g.pow(2).sum().backward()
        res[dev] = [g.detach(), xd.grad]
    for w, g in zip(res["cpu"], res["sim"], strict=True):
        assert_close(g.cpu(), w, **RNN_TOL[torch.float64])


def _lstm_reference(ig, hg, cx, b1, b2):
    """LSTM cell by its definition (CPU, float64)."""
    g = ig.double() + hg.double()
    if b1 is not None:
        g = g + b1.double() + b2.double()
    i, f, c, o = g.chunk(4, 1)
    i, f, c, o = torch.sigmoid(i), torch.sigmoid(f), torch.tanh(c), torch.sigmoid(o)
    cy = f * cx.double() + i * c
    return o * torch.tanh(cy), cy, torch.cat([i, f, c, o], 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_fused_lstm_cell_op_outputs_and_workspace(dtype, bias):
    B, H = 3, 5
    ig, hg = torch.randn(B, 4 * H), torch.randn(B, 4 * H)
    cx = torch.randn(B, H)
    b1 = torch.randn(4 * H) if bias else None
    b2 = torch.randn(4 * H) if bias else None
    args = [t.to(dtype) if t is not None else None for t in (ig, hg, cx, b1, b2)]
    dev = [t.to("sim") if t is not None else None for t in args]
    hy, cy, ws = torch.ops.aten._thnn_fused_lstm_cell(*dev)
    want = _lstm_reference(*args)
    eps = torch.finfo(dtype).eps
    for got, w in zip((hy, cy, ws), want, strict=True):
        assert got.dtype == dtype and got.device.type == "sim" and got.is_contiguous()
        assert got.shape == w.shape
        assert_close(got.cpu().double(), w, rtol=4 * eps, atol=4 * eps)
    # backward reads the workspace: grad of hy only, of cy only, of both
    ghy, gcy = torch.randn(B, H).to(dtype), torch.randn(B, H).to(dtype)
    for gh, gc in ((ghy, None), (None, gcy), (ghy, gcy)):
        gg, gcx, gb = torch.ops.aten._thnn_fused_lstm_cell_backward_impl(
            None if gh is None else gh.to("sim"), None if gc is None else gc.to("sim"),
            dev[2], cy, ws, bias)
        leaves = [t.double().requires_grad_() for t in (args[0], args[2])]
        h2, c2, _ = _lstm_reference(leaves[0], args[1], leaves[1], args[3], args[4])
        terms = []
        if gh is not None:
            terms.append((h2 * gh.double()).sum())
        if gc is not None:
            terms.append((c2 * gc.double()).sum())
        want_gates, want_cx = torch.autograd.grad(sum(terms), leaves)
        assert gg.dtype == dtype and gcx.dtype == dtype
        tol = 16 * eps
        assert_close(gg.cpu().double(), want_gates, rtol=tol, atol=tol)
        assert_close(gcx.cpu().double(), want_cx, rtol=tol, atol=tol)
        if bias:
            assert torch.equal(gb.cpu(), gg.cpu().sum(0))
        else:
            assert gb is None
    assert torch.ops.aten._thnn_fused_lstm_cell_backward_impl(None, None, dev[2], cy, ws,
                                                              bias) == (None, None, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_fused_gru_cell_op_workspace_layout(dtype):
    B, H = 2, 4
    ig, hg, hx = torch.randn(B, 3 * H), torch.randn(B, 3 * H), torch.randn(B, H)
    b1, b2 = torch.randn(3 * H), torch.randn(3 * H)
    args = [t.to(dtype) for t in (ig, hg, hx, b1, b2)]
    hy, ws = torch.ops.aten._thnn_fused_gru_cell(*[t.to("sim") for t in args])
    assert hy.dtype == dtype and ws.dtype == dtype and ws.shape == (B, 5 * H)
    d = [t.double() for t in args]
    ir, ii, in_ = (d[0] + d[3]).chunk(3, 1)
    hr, hi, hn = (d[1] + d[4]).chunk(3, 1)
    r, z = torch.sigmoid(ir + hr), torch.sigmoid(ii + hi)
    n = torch.tanh(in_ + r * hn)
    eps = torch.finfo(dtype).eps
    assert_close(hy.cpu().double(), (1 - z) * n + z * d[2], rtol=4 * eps, atol=4 * eps)
    want_ws = torch.cat([r, z, n, d[2], hn], 1)
    assert_close(ws.cpu().double(), want_ws, rtol=4 * eps, atol=4 * eps)
    gy = torch.randn(B, H).to(dtype)
    gi, gh, ghx, gbi, gbh = torch.ops.aten._thnn_fused_gru_cell_backward(gy.to("sim"), ws, True)
    assert torch.equal(gi.cpu()[:, :2 * H], gh.cpu()[:, :2 * H])  # r, z gates shared
    assert torch.equal(gbi.cpu(), gi.cpu().sum(0)) and torch.equal(gbh.cpu(), gh.cpu().sum(0))
    assert torch.ops.aten._thnn_fused_gru_cell_backward(gy.to("sim"), ws, False)[3:] == (None,
                                                                                         None)
    with pytest.raises(RuntimeError, match="workspace shape"):
        torch.ops.aten._thnn_fused_gru_cell_backward(gy.to("sim"), ws[:, :H], True)


def test_fused_cell_shape_errors():
    with pytest.raises(RuntimeError, match="hidden_gates shape"):
        torch.ops.aten._thnn_fused_lstm_cell(torch.randn(2, 8, device="sim"),
                                             torch.randn(2, 4, device="sim"),
                                             torch.randn(2, 2, device="sim"))


# ---- integer histc -------------------------------------------------------------------
def _histc_reference(values: list[int], bins: int, lo, hi, dtype: torch.dtype) -> torch.Tensor:
    """CUDA's integer histc derived with Python integers: bounds truncated to ints, the
    data's range for equal bounds, +-1 widening, bin ``(v - min) * bins // (max - min)``,
    ``max`` in the last bin, outside values dropped, counts wrapping in ``dtype``."""
    lo, hi = int(lo), int(hi)
    if lo == hi and values:
        lo, hi = min(values), max(values)
    if lo == hi:
        lo, hi = lo - 1, hi + 1
    counts = [0] * bins
    for v in values:
        if lo <= v <= hi:
            b = (v - lo) * bins // (hi - lo)
            counts[min(b, bins - 1)] += 1
    return torch.tensor(counts, dtype=torch.int64).to(dtype)


def test_histc_int32_example():
    x = torch.tensor([0, 1, 2, 3, 3], dtype=torch.int32)
    got = torch.histc(x.to("sim"), bins=4, min=0, max=3)
    assert got.dtype == torch.int32 and got.device.type == "sim"
    assert torch.equal(got.cpu(), torch.tensor([1, 1, 1, 2], dtype=torch.int32))


HISTC_CASES = [
    # values, bins, min, max
    ([-5, -3, -1, 0, 2, 4, 7, 9, 9], 5, -5, 9),  # negatives, edges, max in last bin
    ([-5, -3, -1, 0, 2, 4, 7, 9, 9], 4, -2, 5),  # out-of-range elements dropped
    ([-4, 1, 1, 6, 8], 3, 0, 0),  # min == max: the data's range
    ([7, 7, 7], 3, 0, 0),  # constant data: widened to [6, 8]
    ([3, 4, 5, 6], 2, 4, 4),  # equal explicit bounds: [3, 5]
    ([0, 1, 2, 3, 4, 5, 6, 7, 8, 9], 3, 0, 9),  # uneven bins
    ([1, 2, 3, 10, 11], 7, -1.7, 10.9),  # float bounds truncated toward zero: [-1, 10]
    ([0, 2, 4], 10, 0, 4),  # more bins than values
    ([], 4, 0, 0),  # empty input: [-1, 1]
]


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.int64,
                                   torch.uint8])
@pytest.mark.parametrize("case", range(len(HISTC_CASES)))
def test_histc_integer_matches_cuda_semantics(dtype, case):
    values, bins, lo, hi = HISTC_CASES[case]
    if dtype == torch.uint8:
        values = [v for v in values if v >= 0]
    x = torch.tensor(values, dtype=dtype)
    got = torch.histc(x.to("sim"), bins=bins, min=lo, max=hi)
    want = _histc_reference(values, bins, lo, hi, dtype)
    assert got.dtype == dtype
    assert torch.equal(got.cpu(), want)
    # and against torch.bucketize on the CPU for the in-range elements
    if values and lo != hi:
        lo_i, hi_i = int(lo), int(hi)
        xs = torch.tensor([v for v in values if lo_i <= v <= hi_i], dtype=torch.int64)
        edges = torch.tensor([lo_i + -(-k * (hi_i - lo_i) // bins) for k in range(1, bins)])
        idx = torch.bucketize(xs, edges, right=True)
        assert torch.equal(got.cpu().to(torch.int64), torch.bincount(idx, minlength=bins))


def test_histc_integer_2d_input_counts_wrap_in_dtype_and_sim1():
    x = torch.ones(20, 15, dtype=torch.uint8)  # 300 ones: the count wraps to 44 in uint8
    got = torch.histc(x.to("sim:1"), bins=2, min=0, max=1)
    assert got.device == torch.device("sim:1")
    assert torch.equal(got.cpu(), torch.tensor([0, 300 % 256], dtype=torch.uint8))


def test_histc_integer_out_and_errors():
    x = torch.tensor([1, 2, 2, 5], dtype=torch.int64).to("sim")
    out = torch.empty(0, dtype=torch.int64, device="sim")
    r = torch.histc(x, bins=3, min=1, max=5, out=out)
    assert r is out and torch.equal(out.cpu(), torch.tensor([3, 0, 1]))
    with pytest.raises(RuntimeError, match="bins must be > 0"):
        torch.histc(x, bins=0)
    with pytest.raises(RuntimeError, match="max must be larger than min"):
        torch.histc(x, bins=3, min=5, max=1)
    with pytest.raises(RuntimeError, match="int64"):
        torch.histc(x, bins=3, min=0, max=float("inf"))


def test_histc_floating_keeps_cpu_kernel():
    x = torch.randn(50, dtype=torch.float32)
    for lo, hi in ((0.0, 0.0), (-1.0, 1.5)):
        assert torch.equal(torch.histc(x.to("sim"), bins=7, min=lo, max=hi).cpu(),
                           torch.histc(x, bins=7, min=lo, max=hi))


# ---- scaled dot-product attention, overrideable --------------------------------------
_SDPA_OV = torch.ops.aten._scaled_dot_product_fused_attention_overrideable.default
_MATH = torch.ops.aten._scaled_dot_product_attention_math.default

SDPA_CASES = [
    # q shape, kv heads, mask kind, causal, scale
    ((2, 3, 5, 4), 3, None, False, None),
    ((2, 3, 5, 4), 3, None, True, 0.3),
    ((2, 3, 5, 4), 3, "float", False, None),
    ((2, 3, 5, 4), 3, "bool", False, None),
    ((2, 4, 5, 4), 2, None, True, None),  # grouped-query attention
    ((3, 6, 4), 3, "float", False, None),  # 3-D (heads, seq, dim)
]


@pytest.mark.parametrize("case", range(len(SDPA_CASES)))
def test_sdpa_overrideable_matches_math_path(case):
    qshape, kvh, mask, causal, scale = SDPA_CASES[case]
    S, Ev = 6, 7
    q = torch.randn(qshape, dtype=torch.float64)
    kshape = (*qshape[:-3], kvh, S, qshape[-1])
    k = torch.randn(kshape, dtype=torch.float64)
    v = torch.randn((*kshape[:-1], Ev), dtype=torch.float64)
    bias = None
    if mask == "float":
        bias = torch.randn(qshape[-2], S, dtype=torch.float64)
    elif mask == "bool":
        bias = torch.rand(qshape[-2], S) > 0.3
        bias[:, 0] = True
    gqa = kvh != qshape[-3]
    cpu_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    cpu_bias = bias.clone().requires_grad_() if mask == "float" else bias
    want, _ = _MATH(*cpu_leaves, cpu_bias, 0.0, causal, None, scale=scale, enable_gqa=gqa)
    go = torch.randn(want.shape, dtype=torch.float64)
    want.backward(go)

    dev = [t.to("sim").requires_grad_() for t in (q, k, v)]
    dbias = None if bias is None else bias.to("sim")
    if mask == "float":
        dbias.requires_grad_()
    out, lse, cq, ck, mq, mk, seed, off, dbg = _SDPA_OV(*dev, dbias, 0.0, causal, False,
                                                        scale=scale)
    assert torch.equal(out.detach().cpu(), want.detach())
    assert out.shape == want.shape and out.stride() == want.stride()
    assert (cq, ck, dbg) == (None, None, None) and (mq, mk) == (qshape[-2], S)
    assert seed.shape == () and off.shape == () and seed.dtype == torch.int64
    # logsumexp: float32, (B, H, L), of the scaled scores (its definition, in float64)
    B = qshape[0] if len(qshape) == 4 else 1
    assert lse.dtype == torch.float32 and lse.shape == (B, qshape[-3], qshape[-2])
    kk = k.repeat_interleave(qshape[-3] // kvh, dim=-3)
    sc = (q @ kk.transpose(-2, -1)) * (scale if scale is not None else qshape[-1] ** -0.5)
    if causal:
        sc = sc.masked_fill(~torch.ones(qshape[-2], S, dtype=torch.bool).tril(), float("-inf"))
    if mask == "float":
        sc = sc + bias
    elif mask == "bool":
        sc = sc.masked_fill(~bias, float("-inf"))
    assert_close(lse.cpu(), torch.logsumexp(sc, -1).reshape(lse.shape).float(),
                 rtol=1e-6, atol=1e-6)
    # backward through the op's derivative (the overrideable backward): the math path's
    out.backward(go.to("sim"))
    for d, c in zip(dev, cpu_leaves, strict=True):
        assert torch.equal(d.grad.cpu(), c.grad)
    if mask == "float":
        assert torch.equal(dbias.grad.cpu(), cpu_bias.grad)


def test_sdpa_overrideable_rejects_dropout():
    q = torch.randn(1, 2, 3, 4, device="sim")
    with pytest.raises(NotImplementedError, match="dropout_p"):
        _SDPA_OV(q, q, q, None, 0.5)


# ---- convolution_overrideable: a backend without a convolution kernel ---------------
_VENDOR = textwrap.dedent("""
    import copy
    import warnings

    import torch
    import torch.nn as nn
    from torchport.backend import Backend
    from torchport.backends.sim import SimRuntime
    from torchport.ops import KernelSet, record

    warnings.simplefilter("ignore")
    # A new vendor's first backend: no kernels but one, histc, which must win over
    # torchport's route kernel for it (declared by the backend, installed first).
    ks = KernelSet("vendor")

    @ks.kernel("histc.default")
    def histc(self, bins=100, min=0, max=0):
        return torch.full((bins,), 42, dtype=self.dtype, device=self.device)

    Backend("vendor", SimRuntime(), [ks]).register()
    x = torch.tensor([1, 2], dtype=torch.int32, device="vendor")
    assert torch.histc(x, bins=3).cpu().tolist() == [42, 42, 42]

    def grads(dev, model, x):
        m = model.to(dev)
        xd = x.detach().to(dev).requires_grad_()
        y = m(xd)
        (y * y).sum().backward()
        return [y.detach().cpu(), xd.grad.cpu(), *[p.grad.cpu() for p in m.parameters()]]

    torch.manual_seed(0)
    cnn = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(),
                        nn.Linear(4 * 6 * 6, 5))
    x = torch.randn(2, 3, 6, 6)
    with record() as rec:
        want = grads("cpu", copy.deepcopy(cnn), x)
        got = grads("vendor", copy.deepcopy(cnn), x)
    assert len(want) == len(got) == 6
    for w, g in zip(want, got):
        assert torch.equal(w, g), (w - g).abs().max()
    # no convolution kernel at any level: convolution itself is the fallback's, and a direct
    # _convolution call still reaches the overrideable route
    assert rec.path_of("convolution") == "fallback", rec.table()
    assert rec.path_of("convolution_backward") == "fallback", rec.table()
    args = ([1, 1], [1, 1], [1, 1], False, [0, 0], 1, False, False, True, True)
    w, b = cnn[0].weight.detach(), cnn[0].bias.detach()
    with record() as rec:
        got = torch.ops.aten._convolution(x.to("vendor"), w.to("vendor"), b.to("vendor"), *args)
    assert torch.equal(got.cpu(), torch.ops.aten._convolution(x, w, b, *args))
    assert rec.path_of("convolution_overrideable") == "native", rec.table()
    print("VENDOR-OK")
""")


CONV_CASES = [
    # input, weight, bias, stride, padding, dilation, transposed, output_padding, groups
    ((2, 3, 6, 6), (4, 3, 3, 3), True, [1, 1], [1, 1], [1, 1], False, [0, 0], 1),
    ((2, 4, 9), (6, 2, 3), False, [2], [0], [1], False, [0], 2),
    ((2, 4, 5, 5), (4, 3, 3, 3), True, [2, 2], [1, 1], [1, 1], True, [1, 1], 1),
    ((1, 2, 7, 7), (2, 2, 2, 2), True, [1, 1], [1, 1], [2, 2], False, [0, 0], 1),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", range(len(CONV_CASES)))
def test_convolution_overrideable_ops_match_cpu_convolution(case, dtype):
    # the ops themselves, and their derivative (convolution_backward_overrideable), against
    # the CPU's convolution and its backward: the same CPU kernels, bit for bit
    ishape, wshape, bias, *params = CONV_CASES[case]
    ts = [torch.randn(ishape, dtype=dtype), torch.randn(wshape, dtype=dtype)]
    if bias:
        ts.append(torch.randn(wshape[1] * params[-1] if params[3] else wshape[0], dtype=dtype))
    res = {}
    for dev, op in (("cpu", torch.ops.aten.convolution.default),
                    ("sim", torch.ops.aten.convolution_overrideable.default)):
        leaves = [t.detach().to(dev).requires_grad_() for t in ts]
        y = op(leaves[0], leaves[1], leaves[2] if bias else None, *params)
        g = torch.randn(y.shape, dtype=dtype, generator=torch.Generator().manual_seed(1))
        y.backward(g.to(dev))
        res[dev] = [y.detach(), *[t.grad for t in leaves]]
    for w, g in zip(res["cpu"], res["sim"], strict=True):
        assert g.device.type == "sim" and torch.equal(g.cpu(), w)


def test_convolution_overrideable_on_backend_without_conv_kernel():
    # The sim declares convolution natively (forcing it to the CPU keeps its kernel's
    # route), and a process has one PrivateUse1 backend: a child process registers a
    # backend without kernels, where _convolution picks ConvBackend::Overrideable.
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHPORT_FALLBACK_WARN="0")
    r = run_python(_VENDOR, env=env, timeout=240)
    assert r.returncode == 0 and "VENDOR-OK" in r.stdout, r.stdout + r.stderr


_ROUTED = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    from torchport.backend import Backend
    from torchport.backends.sim import SimRuntime
    from torchport.ops import native_hostops, set_fallback_warn

    set_fallback_warn(False)
    Backend("vendor", SimRuntime(), []).register()  # no kernels of its own
    for name in ("aten::native_layer_norm", "aten::native_group_norm", "aten::convolution",
                 "aten::convolution_backward", "aten::addr"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "PrivateUse1"), name
    torch.manual_seed(0)
    x, w, b = torch.randn(2, 6, 8), torch.randn(8), torch.randn(8)
    img, k, kb = torch.randn(2, 3, 7, 7), torch.randn(4, 3, 3, 3), torch.randn(4)
    u, v, m = torch.randn(5), torch.randn(3), torch.randn(5, 3)

    def step(d):
        leaves = [t.detach().to(d).requires_grad_() for t in (x, w, b, img, k, kb)]
        xd, wd, bd, imgd, kd, kbd = leaves
        y = F.layer_norm(xd, (8,), wd, bd)
        z = F.conv2d(imgd, kd, kbd, padding=1)
        g = F.group_norm(z, 2)
        r = torch.addr(m.to(d), u.to(d), v.to(d))
        ((y * y).sum() + (g * z).sum()).backward()
        return [t.detach().cpu() for t in (y, z, g, r)] + [t.grad.cpu() for t in leaves]

    want = step("cpu")
    for _ in range(3):
        got = step("vendor")
        for i, (w_, g_) in enumerate(zip(want, got, strict=True)):
            assert torch.equal(w_, g_), (i, (w_ - g_).abs().max())
    handed = native_hostops.fallback_counts()[1]
    step("vendor")
    # the warm step's routed ops are C++'s, as any learnt fallback op: none handed to Python
    print("HANDED", native_hostops.fallback_counts()[1] - handed)
    from torchport.ops import fallback
    print("INCPP", fallback._DENSE.in_cpp)
""")


@pytest.mark.parametrize("strict", ["0", "1"])
def test_a_backend_without_them_takes_the_fallback_for_composite_only_ops(strict):
    # native_layer_norm, native_group_norm, addr (a CompositeExplicitAutograd kernel on every
    # device but the CPU and CUDA) and convolution: the fallback's, served from C++ when
    # warm, bit for bit the CPU's, on host-addressable and on device-only memory
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHPORT_FALLBACK_WARN="0",
               TORCHPORT_SIM_STRICT=strict)
    env.pop("TORCHPORT_SIM_ASYNC", None)
    r = run_python(_ROUTED, env=env, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    if native.load() is not None:
        assert "INCPP True" in r.stdout and "HANDED 0" in r.stdout, r.stdout


def test_ops_the_sim_declares_are_not_routed_to_its_fallback():
    # a backend's own kernels win: the sim computes these with its own
    routed = {plan_for(op).overload_name for op in fallback._DENSE.routes}
    assert not routed & {"native_layer_norm", "native_group_norm", "addr", "convolution",
                         "convolution_backward"}, routed
    assert {"all.dims_out", "any.dims_out"} & set(plan.composite_elsewhere()) <= routed | set(
        torchport.ops.native_overloads())


def test_route_kernels_are_declared_for_the_sim():
    names = torchport.ops.native_overloads()
    for n in ("_thnn_fused_lstm_cell", "_thnn_fused_lstm_cell_backward_impl",
              "_thnn_fused_gru_cell", "_thnn_fused_gru_cell_backward", "histc", "histc.out",
              "convolution_overrideable", "convolution_backward_overrideable",
              "_scaled_dot_product_fused_attention_overrideable",
              "_scaled_dot_product_fused_attention_overrideable_backward", "median.dim",
              "median.dim_values", "nanmedian.dim", "nanmedian.dim_values"):
        assert n in names, n


# ---- median over an expanded dimension ---------------------------------------------------
_EXPANDED = [  # (base, expanded shape, dim): the reduced dimension has stride 0
    (torch.tensor(3.0), (2,), 0),
    (torch.arange(3.0).view(3, 1), (3, 2), 1),
    (torch.tensor([[1.5, float("nan"), -2.0]]), (4, 3), 0),
    (torch.tensor([[[2.0], [7.0]]]), (2, 2, 5), -1),
]


@pytest.mark.parametrize("name", ["median", "nanmedian"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int32])
@pytest.mark.parametrize("case", range(len(_EXPANDED)))
def test_median_over_an_expanded_dimension_is_the_contiguous_inputs(name, dtype, case):
    """``median``/``nanmedian`` along a dimension of stride 0 give what they give on the same
    values laid out contiguously (CUDA's result; PyTorch's CPU kernel reads the wrong memory
    there), values and indices, functional and ``out=``."""
    base, shape, dim = _EXPANDED[case]
    if not dtype.is_floating_point and base.isnan().any():
        base = base.nan_to_num()
    base = base.to(dtype)
    x = base.expand(*shape)
    op = getattr(torch, name)
    for keepdim in (False, True):
        want = op(x.contiguous(), dim, keepdim)
        got = op(base.to("sim").expand(*shape), dim, keepdim)
        assert_close(got.values.cpu(), want.values, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(got.indices.cpu(), want.indices)
        values = torch.empty(0, dtype=dtype, device="sim")
        indices = torch.empty(0, dtype=torch.long, device="sim")
        out = op(base.to("sim").expand(*shape), dim, keepdim, out=(values, indices))
        assert out.values is values and out.indices is indices
        assert_close(values.cpu(), want.values, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(indices.cpu(), want.indices)


def test_median_over_a_strided_dimension_keeps_its_path():
    """Any other input (an expanded dimension that is not the reduced one, a transposed
    tensor) takes the usual path, bit for bit the CPU's."""
    base, y = torch.arange(3.0).view(3, 1), torch.randn(4, 5)
    cases = ((base.expand(3, 2), base.to("sim").expand(3, 2), 0),
             (y.t(), y.to("sim").t(), 1), (y.t(), y.to("sim").t(), 0))
    for t, d, dim in cases:
        assert d.stride() == t.stride()
        want, got = torch.median(t, dim), torch.median(d, dim)
        assert torch.equal(got.values.cpu(), want.values)
        assert torch.equal(got.indices.cpu(), want.indices)
