"""The indexing kernels: index_select, embedding and their backward, gather and scatter
(indices checked on the device, reported at the next synchronising call)."""

from __future__ import annotations

import numpy as np
import torch

from torchport.backends.opencl.codegen import Context, _ctype, _load, _store
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
        return L.elementwise(out, [grad_output, mask], "(a0 * (a1 ? 1 : 0)) * s0",
                             [grad_output.dtype, torch.bool], [(grad_output.dtype, scale)])
