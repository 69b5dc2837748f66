"""The row kernels: one work-item per output element looping over the reduced dimensions
(sums, means, extremes, softmax and their backward, layer norm and variance)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from torchport.backends.opencl.codegen import _CL, Context, _ctype, _store
from torchport.ops import Decline, KernelSet


def register(ks: KernelSet, k: Context) -> None:
    """Declare the reduction, softmax and normalisation kernels on ``ks``."""
    runtime, L, dtypes, floats, isfloat = k.runtime, k.launcher, k.dtypes, k.floats, k.isfloat

    # ---- reductions ----
    def dims_of(x: torch.Tensor, dim: Any) -> list[int]:
        if dim is None or (isinstance(dim, list | tuple) and len(dim) == 0):
            return list(range(x.dim()))
        dims = [dim] if isinstance(dim, int) else list(dim)
        return sorted({d % max(x.dim(), 1) for d in dims}) if x.dim() else []

    def reduce(x: torch.Tensor, dim: Any, keepdim: bool, outs: Sequence[torch.Tensor],
               body: str) -> None:
        red = dims_of(x, dim)
        kept = [d for d in range(x.dim()) if d not in red]
        out_kept = []
        for o in outs:
            if keepdim and o.dim() == x.dim():
                out_kept.append([o.stride(d) for d in kept])
            else:
                out_kept.append(list(o.stride())[: len(kept)] if o.dim() else [])
        L.rows(outs, out_kept, [x], kept, red, body)

    def acc_type(dt: torch.dtype) -> str:
        if dt.is_floating_point:
            return "double" if all(runtime.fp64) else "float"
        return "long"

    @ks.out_kernel("sum.IntList_out", dtypes=dtypes)
    def sum_out(self, dim, keepdim=False, *, dtype=None, out):
        if out.dtype.is_complex:
            raise Decline("a sum into a complex dtype: the CPU's")
        at = acc_type(out.dtype)
        reduce(self, dim, keepdim, [out],
               f"{at} acc = 0; for (long j = 0; j < m; j++) acc += ({at})IN0(j);\n  "
               + _store(out.dtype, "p0 + o0", "q0", "acc"))
        return out

    @ks.out_kernel("mean.out", dtypes=floats)
    def mean_out(self, dim, keepdim=False, *, dtype=None, out):
        at = acc_type(out.dtype)
        reduce(self, dim, keepdim, [out],
               f"{at} acc = 0; for (long j = 0; j < m; j++) acc += ({at})IN0(j);\n  "
               + _store(out.dtype, "p0 + o0", "q0", f"acc / ({at})m"))
        return out

    def extreme(name: str, cmp: str) -> None:
        @ks.out_kernel(name, dtypes=dtypes)
        def kernel(self, dim=(), keepdim=False, *, out):
            ct = _ctype(self.dtype)
            better = f"isnan(v) || v {cmp} acc" if isfloat(self.dtype) else f"v {cmp} acc"
            reduce(self, dim, keepdim, [out],
                   f"{ct} acc = IN0(0); for (long j = 1; j < m; j++) {{ {ct} v = IN0(j); "
                   f"if ({better}) acc = v; }}\n  " + _store(out.dtype, "p0 + o0", "q0", "acc"))
            return out

    extreme("amax.out", ">")
    extreme("amin.out", "<")

    def arg_extreme(name: str, cmp: str) -> None:
        @ks.out_kernel(name, dtypes=dtypes - {torch.bool})
        def kernel(self, dim=None, keepdim=False, *, out):
            x = self if dim is not None else self.reshape(-1)
            if dim is None and keepdim:
                raise Decline("argmax over all dims with keepdim")
            ct = _ctype(self.dtype)
            better = (f"!isnan(b) && (isnan(v) || v {cmp} b)" if isfloat(self.dtype)
                      else f"v {cmp} b")
            reduce(x, dim if dim is not None else 0, keepdim, [out],
                   f"{ct} b = IN0(0); long at = 0; for (long j = 1; j < m; j++) "
                   f"{{ {ct} v = IN0(j); if ({better}) {{ b = v; at = j; }} }}\n  "
                   + _store(torch.int64, "p0 + o0", "q0", "at"))
            return out

    arg_extreme("argmax.out", ">")
    arg_extreme("argmin.out", "<")

    # ---- softmax ----
    def softmax_like(name: str, log: bool) -> None:
        @ks.out_kernel(name, dtypes=floats)
        def kernel(self, dim, half_to_float, *, out):
            if half_to_float or self.dim() == 0:
                raise Decline("softmax with half_to_float or of a 0-dim tensor")
            half = self.dtype == torch.float16
            ct, at = _ctype(self.dtype), "float" if half else acc_type(self.dtype)
            d = dim % self.dim()
            kept = [k for k in range(self.dim()) if k != d]
            # float16 over the last dim: the CPU's kernel rounds the sum and its log to
            # float16 in between
            last = half and d == self.dim() - 1
            logs = "round_half(log(round_half(s)))" if last else "log(s)"
            value = f"v - mx - {logs}" if log else "exp(v - mx) / s"
            body = (f"{ct} mx = -INFINITY; for (long j = 0; j < m; j++) {{ {ct} v = IN0(j); "
                    f"if (isnan(v) || v > mx) mx = v; if (isnan(mx)) break; }}\n  "
                    f"{at} s = 0; for (long j = 0; j < m; j++) s += exp(IN0(j) - mx);\n  "
                    f"for (long j = 0; j < m; j++) {{ {ct} v = IN0(j); "
                    + _store(out.dtype, "p0 + o0", "q0 + j * w", f"({ct})({value})")
                    + " }")
            L.rows([out], [[out.stride(k) for k in kept]], [self], kept, [d], body,
                   [("long w", np.int64(out.stride(d)))])
            return out

    softmax_like("_softmax.out", False)
    softmax_like("_log_softmax.out", True)

    def softmax_backward(name: str, log: bool) -> None:
        @ks.out_kernel(name, dtypes=floats)
        def kernel(grad_output, output, dim, input_dtype, *, out=None,
                   grad_input=None):  # the two overloads name their output differently
            out = grad_input if out is None else out
            if output.dtype != grad_output.dtype or output.dim() == 0:
                raise Decline("softmax backward of mixed dtypes or a 0-dim tensor")
            ct, at = _ctype(output.dtype), acc_type(output.dtype)
            d = dim % output.dim()
            kept = [k for k in range(output.dim()) if k != d]
            total = "IN0(j)" if log else "IN0(j) * IN1(j)"
            value = "IN0(j) - exp(IN1(j)) * s" if log else "IN1(j) * (IN0(j) - s)"
            body = (f"{at} acc = 0; for (long j = 0; j < m; j++) acc += {total};\n  "
                    f"{ct} s = ({ct})acc;\n  for (long j = 0; j < m; j++) {{ "
                    + _store(out.dtype, "p0 + o0", "q0 + j * w", value) + " }")
            L.rows([out], [[out.stride(k) for k in kept]], [grad_output, output], kept, [d],
                   body, [("long w", np.int64(out.stride(d)))])
            return out

    softmax_backward("_softmax_backward_data.out", False)
    softmax_backward("_log_softmax_backward_data.out", True)

    # ---- normalisation and variance ----
    @ks.out_kernel("var.correction_out", dtypes=floats)
    def var_out(self, dim=None, *, correction=None, keepdim=False, out):
        variance(self, dim, correction, keepdim, [out], with_mean=False)
        return out

    @ks.out_kernel("var_mean.correction_out", dtypes=floats)
    def var_mean_out(self, dim=None, *, correction=None, keepdim=False, out0, out1):
        variance(self, dim, correction, keepdim, [out0, out1], with_mean=True)
        return out0, out1

    def variance(x: torch.Tensor, dim: Any, correction: Any, keepdim: bool,
                 outs: Sequence[torch.Tensor], with_mean: bool) -> None:
        """Two passes in the accumulation type: the mean, then the squared deviations
        over ``max(0, m - correction)`` (0 gives inf or NaN, as the CPU)."""
        at = acc_type(x.dtype)
        corr = 1 if correction is None else correction
        body = (f"{at} mu = 0; for (long j = 0; j < m; j++) mu += ({at})IN0(j); mu /= ({at})m;\n  "
                f"{at} ss = 0; for (long j = 0; j < m; j++) {{ {at} e = ({at})IN0(j) - mu; "
                f"ss += e * e; }}\n  {at} den = ({at})m - ({at})corr; if (den < 0) den = 0;\n  "
                + _store(outs[0].dtype, "p0 + o0", "q0", "ss / den")
                + ("\n  " + _store(outs[1].dtype, "p1 + o1", "q1", "mu") if with_mean else ""))
        red = dims_of(x, dim)
        kept = [d for d in range(x.dim()) if d not in red]
        out_kept = [[o.stride(d) for d in kept] if keepdim and o.dim() == x.dim()
                    else (list(o.stride())[: len(kept)] if o.dim() else []) for o in outs]
        L.rows(outs, out_kept, [x], kept, red, body,
               [(f"{at} corr", (np.float64 if at == "double" else np.float32)(corr))])

    norm_dtypes = [d for d in (torch.float32, torch.float64) if d in dtypes]

    @ks.out_kernel("native_layer_norm.out", dtypes=norm_dtypes)
    def layer_norm(input, normalized_shape, weight, bias, eps, *, out0, out1, out2):
        """Per row the mean and the variance (two passes, in the accumulation type), then
        ``(x * rstd - rstd * mean) * w + b`` as the CPU's kernel computes it."""
        n = math.prod(normalized_shape)
        rows = input.numel() // n if n else 0
        if not (out0.is_contiguous() and out1.is_contiguous() and out2.is_contiguous()):
            raise Decline("layer norm into non-contiguous outputs")
        if rows == 0:
            return out0, out1, out2
        x = input.contiguous()
        ct, at = _CL[x.dtype], acc_type(x.dtype)
        w_at = "((__global const T*)(wp + wo))[j]" if weight is not None else "(T)1"
        b_at = "((__global const T*)(bp + bo))[j]" if bias is not None else "(T)0"
        source = f"""#define T {ct}
__kernel void layer_norm(long M, long N, {at} eps, __global char* yp, ulong yo,
    __global char* mp, ulong mo, __global char* rp, ulong ro, __global char* xp, ulong xo,
    __global char* wp, ulong wo, __global char* bp, ulong bo) {{
  long i = get_global_id(0); if (i >= M) return;
  __global const T* x = (__global const T*)(xp + xo) + i * N;
  __global T* y = (__global T*)(yp + yo) + i * N;
  {at} mu = 0; for (long j = 0; j < N; j++) mu += x[j]; mu /= ({at})N;
  {at} ss = 0; for (long j = 0; j < N; j++) {{ {at} e = x[j] - mu; ss += e * e; }}
  {at} var = ss / ({at})N;
  T mean = (T)mu, rstd = (T)(1 / sqrt(var + eps));
  ((__global T*)(mp + mo))[i] = mean; ((__global T*)(rp + ro))[i] = rstd;
  T scale = rstd, shift = -rstd * mean;
  for (long j = 0; j < N; j++) y[j] = (x[j] * scale + shift) * {w_at} + {b_at};
}}
"""
        anyt = x
        w = weight.contiguous() if weight is not None else anyt
        b = bias.contiguous() if bias is not None else anyt
        eps_v = np.float64(eps) if at == "double" else np.float32(eps)
        L.raw(x, source, [rows], [np.int64(rows), np.int64(n), eps_v, out0, out1, out2, x, w, b])
        return out0, out1, out2

    @ks.kernel("native_layer_norm_backward.default", dtypes=norm_dtypes)
    def layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight, bias,
                            output_mask):
        """The CPU's formulas: per row ``dx = rstd * dy * w + b * x + c`` with
        ``b = (db * mean - ds) * rstd^3 / N``, ``c = -b * mean - db * rstd / N``
        (``ds = sum(dy * w * x)``, ``db = sum(dy * w)``); per column the sums over rows
        of ``dy * (x - mean) * rstd`` and of ``dy``."""
        n = math.prod(normalized_shape)
        m = input.numel() // n if n else 0
        x, dy = input.contiguous(), grad_out.contiguous()
        mu, rs = mean.contiguous(), rstd.contiguous()
        ct, at = _CL[x.dtype], acc_type(x.dtype)
        dx = torch.empty_like(x) if output_mask[0] else None
        dw = torch.empty_like(weight) if output_mask[1] and weight is not None else None
        db = torch.empty_like(bias) if output_mask[2] and bias is not None else None
        w = weight.contiguous() if weight is not None else x
        if dx is not None and m and n:
            w_at = "w[j]" if weight is not None else "(T)1"
            source = f"""#define T {ct}
__kernel void layer_norm_dx(long M, long N, __global char* dxp, ulong dxo,
    __global char* gp, ulong go, __global char* xp, ulong xo, __global char* mp, ulong mo,
    __global char* rp, ulong ro, __global char* wp, ulong wo) {{
  long i = get_global_id(0); if (i >= M) return;
  __global const T* x = (__global const T*)(xp + xo) + i * N;
  __global const T* g = (__global const T*)(gp + go) + i * N;
  __global const T* w = (__global const T*)(wp + wo);
  __global T* d = (__global T*)(dxp + dxo) + i * N;
  {at} ds = 0, db = 0;
  for (long j = 0; j < N; j++) {{ {at} gw = ({at})g[j] * {w_at}; ds += gw * x[j]; db += gw; }}
  {at} mean = ((__global const T*)(mp + mo))[i], a = ((__global const T*)(rp + ro))[i];
  {at} s = 1 / ({at})N;
  {at} b = (db * mean - ds) * a * a * a * s;
  {at} c = -b * mean - db * a * s;
  for (long j = 0; j < N; j++) d[j] = (T)(a * g[j] * {w_at} + b * x[j] + c);
}}
"""
            L.raw(x, source, [m], [np.int64(m), np.int64(n), dx, dy, x, mu, rs, w])
        for t, with_x in ((dw, True), (db, False)):
            if t is None:
                continue
            if m == 0:
                L.elementwise(t, [], "0", t.dtype)
                continue
            term = "g[k] * (x[k] - (T)mean[r]) * (T)rstd[r]" if with_x else "g[k]"
            source = f"""#define T {ct}
__kernel void layer_norm_dw(long M, long N, __global char* op, ulong oo,
    __global char* gp, ulong go, __global char* xp, ulong xo, __global char* mp, ulong mo,
    __global char* rp, ulong ro) {{
  long j = get_global_id(0); if (j >= N) return;
  __global const T* g = (__global const T*)(gp + go);
  __global const T* x = (__global const T*)(xp + xo);
  __global const T* mean = (__global const T*)(mp + mo);
  __global const T* rstd = (__global const T*)(rp + ro);
  {at} acc = 0;
  for (long r = 0; r < M; r++) {{ long k = r * N + j; acc += {term}; }}
  ((__global T*)(op + oo))[j] = (T)acc;
}}
"""
            L.raw(x, source, [n], [np.int64(m), np.int64(n), t, dy, x, mu, rs])
        return dx, dw, db
