"""The OpenCL backend's kernels: OpenCL C generated per op, dtype and rank, launched on the
tensor's current stream (an in-order queue) with buffer arguments found through the
runtime's segment table.

Every kernel reads its operands where they are, strided (views, broadcast inputs with
stride 0, storage offsets), so no kernel copies an input first (but the GEMM's transposed
right operand, copied once so that its rows load as vectors). Three generators cover the
ops: elementwise (any number of inputs, broadcasting, type promotion as PyTorch's
``elementwise_dtypes`` says, the computation in PyTorch's "opmath" type), row kernels
(one work-item per output element looping over the reduced dimensions: reductions,
softmax) and a register-blocked GEMM. Programs are built once per source and device, on
first use (PoCL and pyopencl keep built binaries on disk); the generated source is kept per
signature (op, dtypes, rank), so a warm call builds no string, and each kernel's scalar
parameter types are declared to pyopencl once, so arguments are packed without numpy's
generic path. What no kernel here handles raises :class:`~torchport.ops.Decline`:
decompositions, then the CPU fallback, take it.

This module makes the kernel set (and declares the matrix products); the generators and the
launcher are in ``codegen``, the kernels in ``elementwise``, ``rows`` (reductions, softmax,
normalisation) and ``indexing``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND as PROMOTE
from torch._prims_common import elementwise_dtypes

from torchport.backends.opencl import elementwise, indexing, rows
from torchport.backends.opencl.codegen import DTYPES, FLOATS, Context, Launcher
from torchport.backends.opencl.runtime import OpenCLRuntime
from torchport.ops import KernelSet


def make_kernels(runtime: OpenCLRuntime) -> KernelSet:
    """The backend's kernel set over ``runtime``."""
    ks = KernelSet("opencl")
    L = Launcher(runtime)
    dtypes = DTYPES if all(runtime.fp64) else DTYPES - {torch.float64}
    floats = [d for d in FLOATS if d in dtypes]

    promoted: dict[tuple, torch.dtype] = {}
    plain = (bool, int, float, complex, type(None))

    def promote(kind: PROMOTE, *args: Any) -> torch.dtype:
        """The computation dtype ``elementwise_dtypes`` gives, cached by what it reads: each
        tensor's dtype and whether it has dimensions, each number's type, the default dtype."""
        key: tuple | None = (kind, torch.get_default_dtype())
        for a in args:
            if isinstance(a, torch.Tensor):
                key += (a.dtype, a.dim() == 0)
            elif type(a) in plain:
                key += (type(a),)
            else:  # SymInt and the like: not cached
                key = None
                break
        hit = promoted.get(key) if key is not None else None
        if hit is None:
            hit = elementwise_dtypes(*args, type_promotion_kind=kind)[0]
            if key is not None:
                promoted[key] = hit
        return hit

    def isfloat(dt: torch.dtype) -> bool:
        return dt.is_floating_point

    # the groups of kernels, one module each
    k = Context(runtime, L, dtypes, floats, promote, isfloat)
    elementwise.register(ks, k)
    rows.register(ks, k)
    indexing.register(ks, k)

    # ---- matrix products ----
    @ks.out_kernel("mm.out", dtypes=dtypes)
    def mm(self, mat2, *, out):
        return L.gemm(out, self, mat2)

    @ks.out_kernel("bmm.out", dtypes=dtypes)
    def bmm(self, mat2, *, out):
        return L.gemm(out, self, mat2)

    @ks.out_kernel("addmm.out", dtypes=dtypes)
    def addmm(self, mat1, mat2, *, beta=1, alpha=1, out):
        return L.gemm(out, mat1, mat2, self, alpha, beta)

    @ks.out_kernel("baddbmm.out", dtypes=dtypes)
    def baddbmm(self, batch1, batch2, *, beta=1, alpha=1, out):
        return L.gemm(out, batch1, batch2, self, alpha, beta)

    return ks
