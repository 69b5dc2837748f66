"""Ops PyTorch calls only for non-CPU devices, for which the CPU has no kernel.

PyTorch's C++ takes another route on an accelerator than on the CPU in a few places,
and the route ends in an op the CPU does not implement, so the CPU fallback cannot
serve it:

* ``LSTM``/``GRU`` and their cells: ``RNN.cpp`` computes the gates of a cell with the
  fused ``_thnn_fused_lstm_cell``/``_thnn_fused_gru_cell`` (and their backwards) when the
  input is on CUDA, XPU or PrivateUse1: :mod:`torchport.ops.fused_rnn`.
* integer ``histc``: the CPU kernel is floating-only; CUDA's (``SummaryOps.cu``)
  counts integers too, and Hugging Face MoE models call it on every non-CPU device.
* ``convolution_overrideable``/``convolution_backward_overrideable``: ``_convolution``
  picks ``ConvBackend::Overrideable`` on PrivateUse1 when the backend has no
  convolution kernel; PyTorch's own implementation raises. Here they run the CPU's
  ``convolution``/``convolution_backward`` through the CPU fallback (same kernel as
  ``nn.Conv*`` on the CPU, so bit for bit). Where the backend declares no convolution at
  any level, ``convolution`` and ``convolution_backward`` themselves are the fallback's
  (:func:`fallback_routes`), so that only a direct ``_convolution`` call comes here.
* ``conj_physical_``: its only kernel is a composite calling the CPU/CUDA kernels'
  ``DispatchStub`` on the device tensor ("missing kernel for sim"); here the ``out=``
  overload with the tensor as its own output, which reaches the device's kernel (or the
  CPU fallback).
* ``mode.values``: its only kernel is a composite that refuses any device but the CPU,
  CUDA and XPU ("mode only supports CPU, CUDA and XPU device type"); here the CPU's
  composite through the CPU fallback (``at::mode`` then copies into the outputs, as on
  CUDA), so ``torch.mode(x, out=(v, i))`` gives the functional call's bits.
* ``median``/``nanmedian`` over a dimension of stride 0 (an expanded tensor): PyTorch's CPU
  kernel (2.13) returns values read from the wrong memory there
  (``torch.median(torch.tensor(3.).expand(2), 0)`` is not 3); CUDA's kernel is right. Here
  the CPU kernel gets a contiguous copy of such an input; any other input takes the usual
  path.
* ``_scaled_dot_product_fused_attention_overrideable`` and its backward: the fused
  attention a PrivateUse1 backend may route SDPA to; here computed by PyTorch's math
  path on the device, returning what the op's meta kernel promises.

And the other way round: ops with CPU and CUDA kernels of their own that every other
device computes with a ``CompositeExplicitAutograd`` kernel (``native_layer_norm``,
``native_group_norm``, ``addr``: :func:`torchport.ops.plan.composite_elsewhere`). Those
composites compute in the input's dtype, where the CPU's and CUDA's kernels accumulate in
float32 (a float16 group norm off by 0.006, a float32 layer norm of one element by 1e-4):
here the device's kernel of them is its fallback (:func:`fallback_routes`), which takes
PyTorch's decomposition (which computes in float32) when its pieces have device kernels,
else the CPU kernel, and serves its warm calls from C++ as for any op without a kernel.

Installed for every backend after its own kernel sets: a vendor's declaration of
one of these ops wins (the routes are decided when the backend registers). The kernels
compute with ATen ops on device tensors, so they take the device's own kernels where it
has them.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from torchport.ops import fallback, plan
from torchport.ops.declarations import Decline, KernelSet
from torchport.ops.fused_rnn import (
    fused_gru_cell,
    fused_gru_cell_backward,
    fused_lstm_cell,
    fused_lstm_cell_backward_impl,
)
from torchport.ops.quiet import warn_resized

if TYPE_CHECKING:
    from torchport.core.contracts import DeviceBackend

Tensor = torch.Tensor
_CONV = torch.ops.aten.convolution.default
_CONV_BACKWARD = torch.ops.aten.convolution_backward.default
_SDPA_MATH = torch.ops.aten._scaled_dot_product_attention_math.default
_MODE_VALUES = torch.ops.aten.mode.values
_INT_DTYPES = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})
_I64 = torch.iinfo(torch.int64)


# ---- median over an expanded dimension --------------------------------------------------
def _expanded_along(self: Tensor, dim: int) -> bool:
    """Is ``dim`` of ``self`` expanded (stride 0, 2+ elements), where PyTorch's CPU median
    kernel reads the wrong memory?"""
    if self.dim() == 0:
        return False
    d = dim % self.dim()
    return self.stride(d) == 0 and self.size(d) > 1


def _median_route(ks: KernelSet, name: str) -> None:
    """``name``'s ``dim`` and ``dim_values`` overloads on a contiguous copy of an input
    expanded along ``dim``."""
    packet = getattr(torch.ops.aten, name)

    @ks.kernel(f"{name}.dim")
    def median_dim(self: Tensor, dim: int, keepdim: bool = False) -> tuple[Tensor, Tensor]:
        if not _expanded_along(self, dim):
            raise Decline(f"{name} over a dimension with a stride: the usual path serves")
        return packet.dim(self.contiguous(), dim, keepdim)

    @ks.kernel(f"{name}.dim_values")
    def median_dim_values(self: Tensor, dim: int, keepdim: bool = False, *, values: Tensor,
                          indices: Tensor) -> tuple[Tensor, Tensor]:
        if not _expanded_along(self, dim):
            raise Decline(f"{name} over a dimension with a stride: the usual path serves")
        return packet.dim_values(self.contiguous(), dim, keepdim, values=values,
                                 indices=indices)


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


#: The convolution a backend's kernels may take at any of its levels, forward and backward:
#: where it declares none, the fallback serves ``convolution`` itself (the CPU's checks and
#: kernel choice, bit for bit), rather than ``_convolution`` reaching the overrideable route.
_CONVOLUTION_LEVELS = {"convolution": ("convolution", "_convolution", "convolution_overrideable"),
                       "convolution_backward": ("convolution_backward",
                                                "convolution_backward_overrideable")}


def fallback_routes(declared: set[str]) -> list[torch._ops.OpOverload]:
    """Overloads the device's fallback serves although PyTorch gives every device a
    ``CompositeExplicitAutograd`` kernel of them, where the backend's kernel sets (the
    overloads ``declared``) have none: the fallback takes PyTorch's decomposition where its
    pieces have device kernels, else the CPU kernel, as for any op without a kernel (and
    its warm calls are C++'s, as theirs)."""
    names = [n for n in plan.composite_elsewhere() if n not in declared]
    names += [n for n, levels in _CONVOLUTION_LEVELS.items()
              if not declared.intersection(levels)]
    ops = []
    for name in names:
        base, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, base, None), overload or "default", None)
        if op is not None:  # an op of this torch
            ops.append(op)
    return ops


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
        if out.shape != r.shape:  # CUDA's resize_output: its warning when out had elements
            warn_resized(out.shape, r.shape)
            out.resize_(r.shape)
        return out.copy_(r)

    _median_route(ks, "median")
    _median_route(ks, "nanmedian")

    @ks.kernel("conj_physical_.default")
    def conj_physical_(self: Tensor) -> Tensor:
        if not self.is_complex():
            return self  # the composite's own shortcut
        return torch.ops.aten.conj_physical.out(self, out=self)

    @ks.kernel("mode.values")
    def mode_values(self: Tensor, dim: int = -1, keepdim: bool = False, *, values: Tensor,
                    indices: Tensor) -> tuple[Tensor, Tensor]:
        return fallback.run_cpu(backend, _MODE_VALUES, "mode", (self, dim, keepdim),
                                {"values": values, "indices": indices})

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
