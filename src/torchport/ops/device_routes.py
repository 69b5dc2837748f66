"""Ops PyTorch calls only for non-CPU devices, for which the CPU has no kernel.

PyTorch's C++ takes another route on an accelerator than on the CPU in a few places,
and the route ends in an op the CPU does not implement, so the CPU fallback cannot
serve it:

* ``LSTM``/``GRU`` and their cells: ``RNN.cpp`` computes the gates of a cell with the
  fused ``_thnn_fused_lstm_cell``/``_thnn_fused_gru_cell`` when the input is on CUDA,
  XPU or PrivateUse1 (``input.is_cuda() || input.is_xpu() || input.is_privateuseone()``);
  backward runs ``_thnn_fused_lstm_cell_backward_impl``/``_thnn_fused_gru_cell_backward``
  (or the differentiable ATen formulas when ``create_graph``). The kernels here follow
  CUDA's ``RNN.cu``: argument order, optional biases, the workspace the backward reads
  (LSTM: the four activated gates, ``(B, 4H)``; GRU: ``r, z, n, hx, hn + b_hn``,
  ``(B, 5H)``), float16/bfloat16 computed in float32, results in the input dtype.
  The fused path adds the biases after the matmuls (``((x W_ih^T + h W_hh^T) + b_ih) +
  b_hh``) where the CPU's ``linear`` adds each bias inside its matmul, so results match
  the CPU's ``nn.LSTM``/``nn.GRU`` within a few ULPs, not bit for bit -- as on CUDA.
* integer ``histc``: the CPU kernel is floating-only; CUDA's (``SummaryOps.cu``)
  counts integers too, and Hugging Face MoE models call it on every non-CPU device.
* ``convolution_overrideable``/``convolution_backward_overrideable``: ``_convolution``
  picks ``ConvBackend::Overrideable`` on PrivateUse1 when the backend has no
  convolution kernel; PyTorch's own implementation raises. Here they run the CPU's
  ``convolution``/``convolution_backward`` through the CPU fallback (same kernel as
  ``nn.Conv*`` on the CPU, so bit for bit).
* ``_scaled_dot_product_fused_attention_overrideable`` and its backward: the fused
  attention a PrivateUse1 backend may route SDPA to; here computed by PyTorch's math
  path on the device, returning what the op's meta kernel promises.

Installed for every backend after its own kernel sets: a vendor's declaration of
one of these ops wins. The kernels compute with ATen ops on device tensors, so they
take the device's own kernels where it has them.
"""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Any

import torch

from torchport.ops import fallback
from torchport.ops.declarations import Decline, KernelSet

if TYPE_CHECKING:
    from torchport.contracts import DeviceBackend

Tensor = torch.Tensor
_CONV = torch.ops.aten.convolution.default
_CONV_BACKWARD = torch.ops.aten.convolution_backward.default
_SDPA_MATH = torch.ops.aten._scaled_dot_product_attention_math.default
_LOW_PRECISION = (torch.float16, torch.bfloat16)
_INT_DTYPES = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})
_I64 = torch.iinfo(torch.int64)


def _acc(t: Tensor) -> Tensor:
    """CUDA's accumulate type for the RNN kernels: float32 for float16/bfloat16."""
    return t.float() if t.dtype in _LOW_PRECISION else t


# ---- fused RNN cells ----------------------------------------------------------------
def _check_cell(name: str, input_gates: Tensor, hidden_gates: Tensor, input_bias: Tensor | None,
                hidden_bias: Tensor | None, prev: Tensor, factor: int) -> None:
    """The shape checks of CUDA's fused cells (``checkSizes`` in ``RNN.cu``)."""
    if input_gates.dim() != 2:
        raise RuntimeError(f"{name}: input_gates must be 2-D (batch, {factor} * hidden), got "
                           f"shape {tuple(input_gates.shape)}")
    if hidden_gates.shape != input_gates.shape:
        raise RuntimeError(f"{name}: hidden_gates shape {tuple(hidden_gates.shape)} must equal "
                           f"input_gates shape {tuple(input_gates.shape)}")
    gates = input_gates.size(1)
    if input_bias is not None:
        if input_bias.dim() != 1 or input_bias.numel() != gates:
            raise RuntimeError(f"{name}: input_bias must be 1-D with {gates} elements, got "
                               f"shape {tuple(input_bias.shape)}")
        if hidden_bias is None or hidden_bias.shape != input_bias.shape:
            got = None if hidden_bias is None else tuple(hidden_bias.shape)
            raise RuntimeError(f"{name}: hidden_bias shape {got} must equal input_bias shape "
                               f"{tuple(input_bias.shape)}")
    if prev.dim() != 2 or prev.numel() != input_gates.size(0) * gates // factor:
        raise RuntimeError(f"{name}: the previous state must be 2-D (batch, hidden) with "
                           f"{input_gates.size(0) * gates // factor} elements, got shape "
                           f"{tuple(prev.shape)}")


def _gate_sums(input_gates: Tensor, hidden_gates: Tensor, input_bias: Tensor | None,
               hidden_bias: Tensor | None) -> Tensor:
    """``((input + hidden) + b_ih) + b_hh`` in the accumulate type, CUDA's order (which
    reads the biases only when ``input_bias`` is given)."""
    g = _acc(input_gates) + _acc(hidden_gates)
    if input_bias is not None:
        g = g + _acc(input_bias) + _acc(hidden_bias)
    return g


def fused_lstm_cell(input_gates: Tensor, hidden_gates: Tensor, cx: Tensor,
                    input_bias: Tensor | None = None,
                    hidden_bias: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``_thnn_fused_lstm_cell``: ``(hy, cy, workspace)``, workspace = activated gates
    ``i, f, g, o`` side by side, ``(batch, 4 * hidden)``."""
    _check_cell("_thnn_fused_lstm_cell", input_gates, hidden_gates, input_bias, hidden_bias,
                cx, 4)
    dtype = input_gates.dtype
    i, f, c, o = _gate_sums(input_gates, hidden_gates, input_bias, hidden_bias).chunk(4, 1)
    i, f, c, o = i.sigmoid(), f.sigmoid(), c.tanh(), o.sigmoid()
    cy = f * _acc(cx) + i * c
    hy = o * cy.tanh()
    workspace = torch.cat([i, f, c, o], 1).to(dtype)
    return (hy.to(dtype).reshape(cx.shape).contiguous(),
            cy.to(dtype).reshape(cx.shape).contiguous(), workspace)


def fused_lstm_cell_backward_impl(grad_hy: Tensor | None, grad_cy: Tensor | None, cx: Tensor,
                                  cy: Tensor, workspace: Tensor,
                                  has_bias: bool) -> tuple[Tensor | None, ...]:
    """``_thnn_fused_lstm_cell_backward_impl``: ``(grad_gates, grad_cx, grad_bias)``; all
    undefined when neither output has a gradient, ``grad_bias`` only with biases."""
    if grad_hy is None and grad_cy is None:
        return None, None, None
    ref = grad_hy if grad_hy is not None else grad_cy
    name = "_thnn_fused_lstm_cell_backward_impl"
    if ref.dim() != 2:
        raise RuntimeError(f"{name}: gradients must be 2-D (batch, hidden), got shape "
                           f"{tuple(ref.shape)}")
    for what, t in (("grad_hy", grad_hy), ("grad_cy", grad_cy), ("cx", cx), ("cy", cy)):
        if t is not None and t.shape != ref.shape:
            raise RuntimeError(f"{name}: {what} shape {tuple(t.shape)} must be "
                               f"{tuple(ref.shape)}")
    if workspace.dim() != 2 or workspace.numel() != ref.numel() * 4:
        raise RuntimeError(f"{name}: workspace must be 2-D with {ref.numel() * 4} elements, "
                           f"got shape {tuple(workspace.shape)}")
    dtype = workspace.dtype
    i, f, c, o = _acc(workspace).chunk(4, 1)
    cx_, t = _acc(cx), _acc(cy).tanh()
    if grad_hy is not None:
        go = _acc(grad_hy)
        gog = go * t
        gcx = go * o * (1 - t * t)
        if grad_cy is not None:
            gcx = gcx + _acc(grad_cy)
    else:
        gog = torch.zeros_like(t)
        gcx = _acc(grad_cy)
    gig = gcx * c
    gfg = gcx * cx_
    gcg = gcx * i
    gcx = gcx * f
    gig = gig * (1 - i) * i
    gfg = gfg * (1 - f) * f
    gcg = gcg * (1 - c * c)
    gog = gog * (1 - o) * o
    grad_gates = torch.cat([gig, gfg, gcg, gog], 1).to(dtype)
    grad_bias = grad_gates.sum(0) if has_bias else None
    return grad_gates, gcx.to(dtype).contiguous(), grad_bias


def fused_gru_cell(input_gates: Tensor, hidden_gates: Tensor, hx: Tensor,
                   input_bias: Tensor | None = None,
                   hidden_bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``_thnn_fused_gru_cell``: ``(hy, workspace)``, workspace = ``r, z, n, hx, hn + b_hn``
    side by side, ``(batch, 5 * hidden)``."""
    _check_cell("_thnn_fused_gru_cell", input_gates, hidden_gates, input_bias, hidden_bias,
                hx, 3)
    dtype = input_gates.dtype
    ir, ii, in_ = _acc(input_gates).chunk(3, 1)
    hr, hi, hn = _acc(hidden_gates).chunk(3, 1)
    if input_bias is not None:
        b1r, b1i, b1n = _acc(input_bias).chunk(3)
        b2r, b2i, b2n = _acc(hidden_bias).chunk(3)
        r = (ir + hr + b1r + b2r).sigmoid()
        z = (ii + hi + b1i + b2i).sigmoid()
        hn = hn + b2n
        n = (in_ + b1n + r * hn).tanh()
    else:
        r = (ir + hr).sigmoid()
        z = (ii + hi).sigmoid()
        n = (in_ + r * hn).tanh()
    hx2 = hx.reshape(n.shape)
    hy = n + z * (_acc(hx2) - n)
    workspace = torch.cat([r.to(dtype), z.to(dtype), n.to(dtype), hx2.to(dtype),
                           hn.to(dtype)], 1)
    return hy.to(dtype).reshape(hx.shape).contiguous(), workspace


def fused_gru_cell_backward(grad_hy: Tensor, workspace: Tensor,
                            has_bias: bool) -> tuple[Tensor | None, ...]:
    """``_thnn_fused_gru_cell_backward``: ``(grad_input_gates, grad_hidden_gates, grad_hx,
    grad_input_bias, grad_hidden_bias)``, the biases' only with biases."""
    name = "_thnn_fused_gru_cell_backward"
    if grad_hy.dim() != 2:
        raise RuntimeError(f"{name}: grad_hy must be 2-D (batch, hidden), got shape "
                           f"{tuple(grad_hy.shape)}")
    expected = (grad_hy.size(0), grad_hy.size(1) * 5)
    if tuple(workspace.shape) != expected:
        raise RuntimeError(f"{name}: workspace shape {tuple(workspace.shape)} must be "
                           f"{expected}")
    dtype = workspace.dtype
    r, z, n, hx, hn = _acc(workspace).chunk(5, 1)
    go = _acc(grad_hy)
    gz = go * (hx - n) * (1 - z) * z
    ghx = go * z
    gn = go * (1 - z) * (1 - n * n)
    ghn = gn * r
    gr = gn * hn * (1 - r) * r
    grad_input = torch.cat([gr, gz, gn], 1).to(dtype)
    grad_hidden = torch.cat([gr, gz, ghn], 1).to(dtype)
    gib = grad_input.sum(0) if has_bias else None
    ghb = grad_hidden.sum(0) if has_bias else None
    return grad_input, grad_hidden, ghx.to(dtype).contiguous(), gib, ghb


# ---- integer histc --------------------------------------------------------------------
class HistcError(RuntimeError):
    """``histc`` arguments CUDA's kernel rejects."""


def _bound(v: Any, which: str, dtype: torch.dtype) -> int:
    """A ``min``/``max`` Scalar as CUDA converts it for integer input: to int64,
    truncating toward zero, overflow an error."""
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, int):
        if not _I64.min <= v <= _I64.max:
            raise HistcError(f"histc ({dtype}): {which}={v} does not fit in int64; pass a "
                             f"bound within the int64 range")
        return v
    f = float(v)
    if not math.isfinite(f) or not _I64.min <= f <= _I64.max:
        raise HistcError(f"histc ({dtype}): {which}={v} cannot be converted to int64 without "
                         f"overflow; pass a finite bound within the int64 range")
    return int(f)  # truncation toward zero, as a C++ cast


def histc_int(self: Tensor, bins: int = 100, min: Any = 0, max: Any = 0) -> Tensor:  # noqa: A002
    """``histc`` of an integer tensor with CUDA's semantics (``SummaryOps.cu``).

    Bounds become int64 (truncated); ``min == max`` takes the data's min and max
    (when there is data); equal bounds widen to ``[min - 1, max + 1]``; an element
    ``v`` in ``[min, max]`` lands in bin ``int32((v - min) * bins / (max - min))``
    (int64 arithmetic, quotient truncated), ``max`` itself in the last bin; elements
    outside are ignored. The counts have the input's dtype."""
    dtype = self.dtype
    if bins <= 0:
        raise HistcError(f"histc ({dtype}): bins must be > 0, got {bins}")
    lo, hi = _bound(min, "min", dtype), _bound(max, "max", dtype)
    x = self.reshape(-1).to(torch.int64)
    if lo == hi and x.numel() > 0:
        mn, mx = torch.aminmax(x)
        lo, hi = int(mn.item()), int(mx.item())
    if lo == hi:
        lo, hi = lo - 1, hi + 1
    if not lo < hi:
        raise HistcError(f"histc ({dtype}): max must be larger than min (min={lo}, max={hi})")
    inside = (x >= lo) & (x <= hi)
    b = torch.div((x - lo) * bins, hi - lo, rounding_mode="trunc")
    b = b.to(torch.int32).to(torch.int64)  # CUDA's ``(int)`` cast of the bin
    b = torch.where(b == bins, bins - 1, b)
    # out-of-range elements (and bins an int64 overflow pushed outside) count in a spare bin
    b = torch.where(inside & (b >= 0) & (b < bins), b, bins)
    counts = torch.zeros(bins + 1, dtype=torch.int64, device=self.device)
    counts.scatter_add_(0, b, torch.ones_like(b))
    return counts[:bins].to(dtype)


# ---- *_overrideable -------------------------------------------------------------------
def _matching_layout(query: Tensor, shape: list[int]) -> Tensor:
    """An empty tensor of ``shape`` whose dimensions are ordered in memory as ``query``'s
    (what the overrideable attention's meta kernel allocates)."""
    order = sorted(range(query.dim()), key=lambda d: query.stride(d), reverse=True)
    strides = [0] * query.dim()
    s = 1
    for d in reversed(order):
        strides[d] = s
        s *= shape[d]
    return torch.empty_strided(shape, strides, dtype=query.dtype, device=query.device)


def _gqa(query: Tensor, key: Tensor) -> bool:
    return query.dim() >= 3 and key.dim() >= 3 and query.size(-3) != key.size(-3)


def _check_dropout(dropout_p: float, backend: DeviceBackend) -> None:
    if dropout_p > 0.0:
        raise NotImplementedError(
            f"_scaled_dot_product_fused_attention_overrideable on {backend.name}: dropout_p="
            f"{dropout_p} is not supported by torchport's math-path kernel (backward could not "
            f"replay the mask); declare a {backend.name} kernel for it or use dropout_p=0")


def _logsumexp(query: Tensor, key: Tensor, attn_bias: Tensor | None, is_causal: bool,
               scale: float | None) -> Tensor:
    """The rows' log-sum-exp of the scaled scores, float32, ``(B, H, L)``."""
    q = query if query.dim() == 4 else query.unsqueeze(0)
    k = key if key.dim() == 4 else key.unsqueeze(0)
    if k.size(1) != q.size(1):
        k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
    s = scale if scale is not None else 1.0 / math.sqrt(query.size(-1))
    scores = (q.float() @ k.float().transpose(-2, -1)) * s
    L, S = scores.size(-2), scores.size(-1)
    if is_causal:
        keep = torch.ones(L, S, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(keep.logical_not(), float("-inf"))
    if attn_bias is not None:
        if attn_bias.dtype == torch.bool:
            scores = scores.masked_fill(attn_bias.logical_not(), float("-inf"))
        else:
            scores = scores + attn_bias.float()
    return torch.logsumexp(scores, -1)


_DK = torch._C.DispatchKey
_AUTOGRAD_KEYS = (_DK.AutogradFunctionality, _DK.AutogradOther, _DK.AutogradNestedTensor,
                  _DK.ADInplaceOrView)


def _autograd_on() -> Any:
    """Autograd back on inside a backend kernel (the dispatcher excludes its keys below
    autograd), as PyTorch's higher-order ops do: a backward that differentiates a
    forward formula records it."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for k in _AUTOGRAD_KEYS:
        exclude = exclude.remove(k)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


def make_kernel_set(backend: DeviceBackend) -> KernelSet:
    """The route kernels for ``backend`` (installed after its own kernel sets)."""
    ks = KernelSet("device-routes")
    ks.kernel("_thnn_fused_lstm_cell.default")(fused_lstm_cell)
    ks.kernel("_thnn_fused_lstm_cell_backward_impl.default")(fused_lstm_cell_backward_impl)
    ks.kernel("_thnn_fused_gru_cell.default")(fused_gru_cell)
    ks.kernel("_thnn_fused_gru_cell_backward.default")(fused_gru_cell_backward)

    @ks.kernel("histc.default")
    def histc(self: Tensor, bins: int = 100, min: Any = 0, max: Any = 0) -> Tensor:  # noqa: A002
        if self.dtype not in _INT_DTYPES:
            raise Decline("floating histc: the CPU kernel serves")
        return histc_int(self, bins, min, max)

    @ks.kernel("histc.out")
    def histc_out(self: Tensor, bins: int = 100, min: Any = 0, max: Any = 0, *,  # noqa: A002
                  out: Tensor) -> Tensor:
        if self.dtype not in _INT_DTYPES:
            raise Decline("floating histc: the CPU kernel serves")
        r = histc_int(self, bins, min, max)
        if out.shape != r.shape:  # as CUDA's resize_output: warns when out had elements
            if out.numel() != 0:
                warnings.warn(
                    f"histc.out: an output with one or more elements was resized from "
                    f"{tuple(out.shape)} to {tuple(r.shape)}; pass an empty or correctly "
                    f"shaped out", UserWarning, stacklevel=2)
            out.resize_(r.shape)
        return out.copy_(r)

    @ks.kernel("convolution_overrideable.default")
    def convolution_overrideable(input: Tensor, weight: Tensor, bias: Tensor | None,  # noqa: A002
                                 stride: list[int], padding: list[int], dilation: list[int],
                                 transposed: bool, output_padding: list[int],
                                 groups: int) -> Tensor:
        # The backend has no ``convolution``: the CPU's, through the CPU fallback.
        return fallback.run_cpu(backend, _CONV, "convolution",
                                (input, weight, bias, stride, padding, dilation, transposed,
                                 output_padding, groups), {})

    @ks.kernel("convolution_backward_overrideable.default")
    def convolution_backward_overrideable(
            grad_output: Tensor, input: Tensor, weight: Tensor,  # noqa: A002
            stride: list[int], padding: list[int], dilation: list[int], transposed: bool,
            output_padding: list[int], groups: int,
            output_mask: list[bool]) -> tuple[Tensor | None, ...]:
        bias_sizes = [grad_output.size(1)]  # the bias has one element per output channel
        return fallback.run_cpu(backend, _CONV_BACKWARD, "convolution_backward",
                                (grad_output, input, weight, bias_sizes, stride, padding,
                                 dilation, transposed, output_padding, groups, output_mask),
                                {})

    @ks.kernel("_scaled_dot_product_fused_attention_overrideable.default")
    def sdpa_overrideable(query: Tensor, key: Tensor, value: Tensor,
                          attn_bias: Tensor | None = None, dropout_p: float = 0.0,
                          is_causal: bool = False, return_debug_mask: bool = False, *,
                          scale: float | None = None) -> tuple[Any, ...]:
        _check_dropout(dropout_p, backend)
        out, _ = _SDPA_MATH(query, key, value, attn_bias, 0.0, is_causal, None, scale=scale,
                            enable_gqa=_gqa(query, key))
        shape = list(query.shape)
        shape[-1] = value.size(-1)
        res = _matching_layout(query, shape).copy_(out)
        lse = _logsumexp(query, key, attn_bias, is_causal, scale)
        seed = torch.zeros((), dtype=torch.int64, device=query.device)
        offset = torch.zeros((), dtype=torch.int64, device=query.device)
        return (res, lse, None, None, query.size(-2), key.size(-2), seed, offset, None)

    @ks.kernel("_scaled_dot_product_fused_attention_overrideable_backward.default")
    def sdpa_overrideable_backward(
            grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor,
            attn_bias: Tensor | None, grad_input_mask: list[bool], out: Tensor,
            logsumexp: Tensor, cum_seq_q: Tensor | None, cum_seq_k: Tensor | None, max_q: int,
            max_k: int, dropout_p: float, is_causal: bool, philox_seed: Tensor,
            philox_offset: Tensor, *, scale: float | None = None) -> tuple[Any, ...]:
        # The math path's own gradients: its forward again, under autograd, on the device.
        _check_dropout(dropout_p, backend)
        inputs = [query, key, value, attn_bias]
        leaves = []
        for t, want in zip(inputs, grad_input_mask, strict=True):
            want = want and t is not None and t.is_floating_point()
            leaves.append(t.detach().requires_grad_() if want else
                          (None if t is None else t.detach()))
        wanted = [i for i, t in enumerate(leaves) if t is not None and t.requires_grad]
        grads: list[Tensor | None] = [None, None, None, None]
        if wanted:
            with _autograd_on(), torch.enable_grad():
                o, _ = _SDPA_MATH(leaves[0], leaves[1], leaves[2], leaves[3], 0.0, is_causal,
                                  None, scale=scale, enable_gqa=_gqa(query, key))
                got = torch.autograd.grad(o, [leaves[i] for i in wanted], grad_out)
            for i, g in zip(wanted, got, strict=True):
                grads[i] = torch.empty_like(inputs[i]).copy_(g)
        return tuple(grads)

    return ks
