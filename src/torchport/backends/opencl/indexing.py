"""The indexing kernels: index_select, embedding and their backward, gather and scatter,
nll_loss and its backward (indices checked on the device, reported at the next
synchronising call)."""

from __future__ import annotations

import numpy as np
import torch

from torchport.backends.opencl.codegen import _CL, Context, _ctype, _load, _store
from torchport.ops import Decline, KernelSet


def register(ks: KernelSet, k: Context) -> None:
    """Declare the indexing kernels on ``ks``."""
    L, dtypes, floats = k.launcher, k.dtypes, k.floats

    # ---- indexing ----
    def check_index(index: torch.Tensor, op: str) -> None:
        if index.dtype not in (torch.int64, torch.int32) or index.device.type == "cpu":
            raise Decline(f"{op} with a {index.dtype} or CPU index")

    @ks.out_kernel("index_select.out", dtypes=dtypes)
    def index_select(self, dim, index, *, out):
        """``out[.., i, ..] = self[.., index[i], ..]``: ``self`` read through a view with
        stride 0 along ``dim``, plus the index times the dimension's stride."""
        check_index(index, "index_select")
        if out.numel() == 0:
            return out
        d = dim % max(self.dim(), 1)
        if self.dim() == 0:  # one element: index 0 only
            view, size, stride = self.expand(out.shape), 1, 0
        else:
            strides = list(self.stride())
            strides[d] = 0
            view, size, stride = self.as_strided(out.shape, strides), self.shape[d], self.stride(d)
        idx = index.reshape(-1)
        idx_view = idx.as_strided(out.shape, [idx.stride(0) if k == d else 0
                                              for k in range(out.dim())])
        return L.elementwise(out, [idx_view, view], "a1", [torch.int64, self.dtype],
                             [(torch.int64, stride)], at=[None, "QSELF + a0 * s0"],
                             index_check=(0, size, "index_select", d))

    @ks.out_kernel("gather.out", dtypes=dtypes)
    def gather(self, dim, index, *, sparse_grad=False, out):
        check_index(index, "gather")
        if out.numel() == 0:
            return out
        if self.dim() == 0 or index.dim() != self.dim():
            raise Decline("gather of a 0-dim tensor")
        d = dim % self.dim()
        strides = list(self.stride())
        strides[d] = 0
        view = self.as_strided(index.shape, strides)
        return L.elementwise(out, [index, view], "a1", [torch.int64, self.dtype],
                             [(torch.int64, self.stride(d))], at=[None, "QSELF + a0 * s0"],
                             index_check=(0, self.shape[d], "gather", d))

    def accumulate_rows(out: torch.Tensor, index: torch.Tensor, src: torch.Tensor,
                        d: int, op: str, skip: int | None = None) -> None:
        """``out[.., index[.., j, ..], ..] += src[.., j, ..]`` along ``d``: one work-item
        per position over the other dims adds in order of ``j``, as the CPU does (so the
        sums round alike); ``skip`` adds nothing, an index out of range adds nothing and
        is reported (the runtime's error word, as ``op``'s)."""
        src_v = src.as_strided(index.shape, src.stride())
        kept = [k for k in range(index.dim()) if k != d]
        at = _ctype(out.dtype)
        body = ("for (long j = 0; j < m; j++) { long t = IN0(j); if (t < 0 || t >= ext) { "
                "report_index(err, eop, edim, t, ext); continue; } "
                + ("if (t == skip) continue; " if skip is not None else "")
                + f"{at} v = ({at}){_load(out.dtype, 'p0 + o0', 'q0 + t * w')} + ({at})IN1(j); "
                + _store(out.dtype, "p0 + o0", "q0 + t * w", "v") + " }")
        err = L.index_error(out, op, d)
        extra = [("long w", np.int64(out.stride(d))), ("long ext", np.int64(out.shape[d])),
                 ("__global long* err", err[0]), ("long eop", err[1]), ("long edim", err[2])]
        if skip is not None:
            extra.append(("long skip", np.int64(skip)))
        L.rows([out], [[out.stride(k) for k in kept]], [index, src_v], kept, [d], body, extra)
        L.after_index_kernel(out)

    @ks.out_kernel("scatter_add.out", dtypes=dtypes - {torch.bool})
    def scatter_add(self, dim, index, src, *, out):
        check_index(index, "scatter_add")
        if self.dim() == 0 or index.dim() != self.dim() or src.dtype != out.dtype:
            raise Decline("scatter_add of a 0-dim tensor or mixed dtypes")
        if out.data_ptr() != self.data_ptr() or out.stride() != self.stride():
            out.copy_(self)
        if index.numel():
            accumulate_rows(out, index, src, dim % self.dim(), "scatter_add")
        return out

    @ks.out_kernel("embedding_dense_backward.out", dtypes=floats + [torch.int64, torch.int32])
    def embedding_dense_backward(grad_output, indices, num_weights, padding_idx,
                                 scale_grad_by_freq, *, out):
        check_index(indices, "embedding_dense_backward")
        if scale_grad_by_freq:
            raise Decline("embedding backward with scale_grad_by_freq")
        L.elementwise(out, [], "0", out.dtype)
        n = indices.numel()
        if n == 0 or out.numel() == 0:
            return out
        width = out.shape[1]
        grad = grad_output.reshape(n, width)
        idx = indices.reshape(n, 1).expand(n, width)
        accumulate_rows(out, idx, grad, 0, "embedding_dense_backward", padding_idx)
        return out

    @ks.out_kernel("native_dropout_backward.out", dtypes=floats + [torch.bool])
    def native_dropout_backward(grad_output, mask, scale, *, out):
        # a bool gradient times the float scale is a float32 result, as on the CPU
        ct = out.dtype if grad_output.dtype == torch.bool else grad_output.dtype
        return L.elementwise(out, [grad_output, mask], "(a0 * (a1 ? 1 : 0)) * s0",
                             [ct, torch.bool], [(ct, scale)])

    # ---- nll_loss: the target indexes the classes ----
    nll_floats = [d for d in (torch.float32, torch.float64) if d in dtypes]

    def nll_check(input: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None,
                  *outs: torch.Tensor) -> None:
        """Decline what the CPU's kernel alone handles or refuses (its errors, its NaN of
        an empty mean: ``0 / 0`` on the device is the other NaN)."""
        if input.dtype not in nll_floats or target.dtype != torch.int64 \
                or input.dim() not in (1, 2) or target.numel() == 0:
            raise Decline("nll_loss of this dtype, rank or an empty target")
        for t in (input, target, weight, *outs):
            if t is not None and (t.device != input.device or t.dtype != input.dtype
                                  and t is not target):
                raise Decline("nll_loss with operands of other devices or dtypes")

    def ceil_log2(n: int) -> int:
        """ATen's ``utils::CeilLog2`` (1 for 0 to 2)."""
        return 1 if n <= 2 else (n - 1).bit_length()

    @ks.out_kernel("nll_loss_forward.output", dtypes=nll_floats + [torch.int64])
    def nll_loss_forward(self, target, weight, reduction, ignore_index, *, output,
                         total_weight):
        """The CPU's kernel: with a reduction (or a 1-d input) one work-item sums in the
        CPU's order (its cascade of 8 partial sums, levels of ``2**power`` targets), then
        divides by the total weight for the mean; without, one work-item per row. A target
        out of range is reported (the CPU raises ``IndexError``)."""
        nll_check(self, target, weight, output, total_weight)
        n = 1 if self.dim() == 1 else self.shape[0]
        c = self.shape[-1]
        rows = reduction == 0 and self.dim() == 2
        ct = _CL[self.dtype]
        w_at = "((__global const T*)(wp + wo))[t * sw]" if weight is not None else "(T)1"
        head = f"""#define T {ct}
__kernel void nll_loss(long N, long C, long sx0, long sx1, long st, long sw, long so,
    long ignore, long power, long mean, __global char* op, ulong oo, __global char* twp,
    ulong two, __global char* xp, ulong xo, __global char* tp, ulong to, __global char* wp,
    ulong wo, __global long* err, long eop, long edim) {{
"""
        if rows:
            body = f"""  long b = get_global_id(0); if (b == 0) *(__global T*)(twp + two) = 0;
  if (b >= N) return;
  long t = ((__global const long*)(tp + to))[b * st];
  __global T* o = (__global T*)(op + oo) + b * so;
  if (t == ignore) {{ *o = 0; return; }}
  if (t < 0 || t >= C) {{ report_index(err, eop, edim, t, C); return; }}
  *o = -((__global const T*)(xp + xo))[b * sx0 + t * sx1] * {w_at};
}}
"""
        else:
            weighted = weight is not None
            add = ("T wv = " + w_at + "; ls[0] -= data * wv; ws[0] += wv;" if weighted
                   else "ls[0] -= data;")
            total = ("T tw = 0; for (int j = 0; j < 8; j++) tw += ws[j];" if weighted
                     else "T tw = (T)(N - ignored);")
            body = f"""  if (get_global_id(0) != 0) return;
  T ws[8] = {{0, 0, 0, 0, 0, 0, 0, 0}}, ls[8] = {{0, 0, 0, 0, 0, 0, 0, 0}};
  long ignored = 0, mask = (1L << power) - 1;
  for (long b = 0; b < N; b++) {{
    long t = ((__global const long*)(tp + to))[b * st];
    if (t == ignore) {{ ignored++; continue; }}
    if (t < 0 || t >= C) {{ report_index(err, eop, edim, t, C); return; }}
    T data = ((__global const T*)(xp + xo))[b * sx0 + t * sx1];
    {add}
    for (int j = 0; j + 1 < 8; j++) {{
      if ((b & (mask << (j * power))) != 0) break;
      ws[j + 1] += ws[j]; ls[j + 1] += ls[j]; ws[j] = 0; ls[j] = 0;
    }}
  }}
  {total}
  T out = 0; for (int j = 0; j < 8; j++) out += ls[j];
  if (mean) out /= tw;
  *(__global T*)(op + oo) = out; *(__global T*)(twp + two) = tw;
}}
"""
        sx = (0, self.stride(0)) if self.dim() == 1 else self.stride()
        st = target.stride(0) if target.dim() else 0
        sw = weight.stride(0) if weight is not None else 0
        so = output.stride(0) if rows else 0
        power = max(4, ceil_log2(n) // 8)
        L.raw(self, head + body, [n if rows else 1],
              [np.int64(n), np.int64(c), np.int64(sx[0]), np.int64(sx[1]), np.int64(st),
               np.int64(sw), np.int64(so), np.int64(ignore_index), np.int64(power),
               np.int64(reduction == 1), output, total_weight, self, target,
               weight if weight is not None else self]
              + L.index_error(self, "nll_loss_forward", self.dim() - 1))
        L.after_index_kernel(self)
        return output, total_weight

    @ks.out_kernel("nll_loss_backward.grad_input",
                   dtypes=nll_floats + [torch.int64])
    def nll_loss_backward(grad_output, self, target, weight, reduction, ignore_index,
                          total_weight, *, grad_input):
        """The CPU's kernel: zeros, then per row the target's gradient, ``-w * grad`` per
        row without a reduction, else ``w * -(grad / total_weight)`` (mean) or
        ``w * -grad`` (sum)."""
        nll_check(self, target, weight, grad_output, total_weight, grad_input)
        L.elementwise(grad_input, [], "0", grad_input.dtype)
        n = 1 if self.dim() == 1 else self.shape[0]
        rows = reduction == 0 and self.dim() == 2
        ct = _CL[self.dtype]
        weighted = weight is not None
        w_at = "((__global const T*)(wp + wo))[t * sw]"
        if rows:
            value = f"-{w_at if weighted else '(T)1'} * g[i * sgo]"
        else:
            grad = "-(g[0] / *(__global const T*)(twp + two))" if reduction == 1 else "-g[0]"
            value = f"{w_at} * ({grad})" if weighted else f"({grad})"
        source = f"""#define T {ct}
__kernel void nll_loss_backward(long N, long C, long sg0, long sg1, long st, long sw,
    long sgo, long ignore, __global char* gip, ulong gio, __global char* gp, ulong go,
    __global char* tp, ulong to, __global char* wp, ulong wo, __global char* twp, ulong two,
    __global long* err, long eop, long edim) {{
  long i = get_global_id(0); if (i >= N) return;
  long t = ((__global const long*)(tp + to))[i * st];
  if (t == ignore) return;
  if (t < 0 || t >= C) {{ report_index(err, eop, edim, t, C); return; }}
  __global const T* g = (__global const T*)(gp + go);
  ((__global T*)(gip + gio))[i * sg0 + t * sg1] = {value};
}}
"""
        sg = (0, grad_input.stride(0)) if grad_input.dim() == 1 else grad_input.stride()
        st = target.stride(0) if target.dim() else 0
        L.raw(self, source, [n],
              [np.int64(n), np.int64(self.shape[-1]), np.int64(sg[0]), np.int64(sg[1]),
               np.int64(st), np.int64(weight.stride(0) if weighted else 0),
               np.int64(grad_output.stride(0) if rows and grad_output.dim() else 0),
               np.int64(ignore_index), grad_input, grad_output, target,
               weight if weighted else self, total_weight]
              + L.index_error(self, "nll_loss_backward", self.dim() - 1))
        L.after_index_kernel(self)
        return grad_input
