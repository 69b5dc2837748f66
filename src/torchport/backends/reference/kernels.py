"""The reference backend's kernels: a handful, computed by numpy on the device's memory.

Each kernel reads its tensors' addresses, shapes, strides and host values when called and
launches device work on the current stream (``torchport.launch``); the work reads and
writes device memory directly (:meth:`RefRuntime.view`), never through the host copies.
The arithmetic is numpy's, not ATen's: float16 computes in float32 (CUDA's ``opmath``),
float sums accumulate in float64, matmuls are numpy's, so results round differently
from the CPU's. Everything not declared here takes torchport's decompositions and the
CPU fallback.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

from torchport.backends.reference.runtime import RefRuntime
from torchport.kernel_api import device_address, device_index, launch
from torchport.ops.declarations import Decline, KernelSet

NUMPY = {torch.bool: np.bool_, torch.uint8: np.uint8, torch.int8: np.int8,
         torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64,
         torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}
ARITHMETIC = [torch.float16, torch.float32, torch.float64, torch.int32, torch.int64]
MATMUL = [torch.float32, torch.float64, torch.int64]
ANY = list(NUMPY)
_DEFAULT = ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT
_INT_TO_FLOAT = ELEMENTWISE_TYPE_PROMOTION_KIND.INT_TO_FLOAT


def make_kernels(rt: RefRuntime) -> KernelSet:
    """The ``ref`` kernel set over runtime ``rt``."""
    ks = KernelSet("ref")

    def reader(x: Any, dtype: torch.dtype) -> Callable[[], np.ndarray]:
        """At the call: what the device work reads for ``x`` as ``dtype`` (a device tensor
        where it lies; a Python number or 0-dim CPU tensor by value)."""
        np_dtype = NUMPY[dtype]
        if not isinstance(x, torch.Tensor) or x.device.type == "cpu":
            value = np.asarray(x.item() if isinstance(x, torch.Tensor) else x).astype(np_dtype)
            return lambda: value
        index, ptr, shape, strides = device_index(x), device_address(x), x.shape, x.stride()
        stored = NUMPY[x.dtype]
        return lambda: rt.view(index, ptr, tuple(shape), tuple(strides), stored).astype(
            np_dtype, copy=False)

    def writer(out: torch.Tensor) -> Callable[[np.ndarray], None]:
        """At the call: how the device work stores its result into ``out`` (only the bytes
        of ``out``'s elements: a strided ``out`` keeps what lies between them)."""
        index, ptr, shape, strides = device_index(out), device_address(out), out.shape, \
            out.stride()
        stored, numel = NUMPY[out.dtype], out.numel()

        def write(values: np.ndarray) -> None:
            if numel:
                np.copyto(rt.view(index, ptr, tuple(shape), tuple(strides), stored), values,
                          casting="unsafe")
        return write

    def run(out: torch.Tensor, name: str, compute: Callable[..., Any],
            inputs: list[Callable[[], np.ndarray]]) -> torch.Tensor:
        write = writer(out)

        def work() -> None:
            with np.errstate(all="ignore"):
                write(compute(*[r() for r in inputs]))
        launch(out, work, name)
        return out

    # the rule's result by what it reads of each argument (a tensor's dtype, whether it is
    # 0-dim and on the host; a number's type): a Decline's message, or the dtype
    rules: dict[tuple, torch.dtype | str] = {}

    def computation(args: list[Any], kind: ELEMENTWISE_TYPE_PROMOTION_KIND) -> torch.dtype:
        """PyTorch's computation dtype for ``args``, widened as CUDA's ``opmath``."""
        key = (kind, *[(a.dtype, a.dim() == 0, a.device.type == "cpu")
                       if isinstance(a, torch.Tensor) else type(a) for a in args])
        got = rules.get(key)
        if got is None:
            got = rules[key] = rule(args, kind)
        if isinstance(got, str):
            raise Decline(got)
        return got

    def rule(args: list[Any], kind: ELEMENTWISE_TYPE_PROMOTION_KIND) -> torch.dtype | str:
        device = [a for a in args if isinstance(a, torch.Tensor) and a.device.type != "cpu"]
        for a in args:  # a CPU scalar tensor of a higher kind than the device tensors'
            if isinstance(a, torch.Tensor) and a.device.type == "cpu" and \
                    a.is_floating_point() and not any(d.is_floating_point() for d in device):
                return "a float CPU scalar with integer device tensors"
        dtype, _ = elementwise_dtypes(*args, type_promotion_kind=kind)
        if dtype not in NUMPY:
            return f"no numpy type for {dtype}"
        return torch.float32 if dtype == torch.float16 else dtype

    def binary(name: str, op: Callable[[Any, Any], Any], self: Any, other: Any,
               out: torch.Tensor, alpha: Any = 1,
               kind: ELEMENTWISE_TYPE_PROMOTION_KIND = _DEFAULT) -> torch.Tensor:
        dtype = computation([self, other], kind)
        if alpha != 1:
            if not dtype.is_floating_point and isinstance(alpha, float):
                raise Decline("a float alpha with integer tensors (the CPU's error)")
            scale = NUMPY[dtype](alpha)
            return run(out, name, lambda a, b: op(a, b * scale),
                       [reader(self, dtype), reader(other, dtype)])
        return run(out, name, op, [reader(self, dtype), reader(other, dtype)])

    @ks.out_kernel("add.out", dtypes=ARITHMETIC)
    def add_out(self, other, *, alpha=1, out):
        return binary("add.out", np.add, self, other, out, alpha)

    @ks.out_kernel("sub.out", dtypes=ARITHMETIC)
    def sub_out(self, other, *, alpha=1, out):
        return binary("sub.out", np.subtract, self, other, out, alpha)

    @ks.out_kernel("mul.out", dtypes=ARITHMETIC)
    def mul_out(self, other, *, out):
        return binary("mul.out", np.multiply, self, other, out)

    @ks.out_kernel("div.out", dtypes=ARITHMETIC)
    def div_out(self, other, *, out):
        return binary("div.out", np.true_divide, self, other, out, kind=_INT_TO_FLOAT)

    @ks.out_kernel("neg.out", dtypes=ARITHMETIC)
    def neg_out(self, *, out):
        dtype = computation([self], _DEFAULT)
        return run(out, "neg.out", np.negative, [reader(self, dtype)])

    def relu(out: torch.Tensor, self: torch.Tensor) -> torch.Tensor:
        # max(x, 0) keeping NaN, as the CPU's clamp_min
        return run(out, "relu", lambda a: np.where(a > 0, a, np.where(a != a, a, 0)),
                   [reader(self, self.dtype)])

    @ks.kernel("relu", dtypes=ARITHMETIC)
    def relu_(self):
        return relu(torch.empty_like(self), self)

    @ks.kernel("relu_", dtypes=ARITHMETIC)
    def relu_inplace(self):
        return relu(self, self)

    # ---- matmul --------------------------------------------------------------------------
    @ks.out_kernel("mm.out", dtypes=MATMUL)
    def mm_out(self, mat2, *, out):
        return run(out, "mm.out", np.matmul, [reader(self, self.dtype), reader(mat2, mat2.dtype)])

    @ks.out_kernel("bmm.out", dtypes=MATMUL)
    def bmm_out(self, mat2, *, out):
        return run(out, "bmm.out", np.matmul,
                   [reader(self, self.dtype), reader(mat2, mat2.dtype)])

    # ---- a reduction -----------------------------------------------------------------------
    @ks.out_kernel("sum.IntList_out", dtypes=[torch.bool] + ARITHMETIC)
    def sum_out(self, dim, keepdim=False, *, dtype=None, out):
        ndim = self.dim()
        dims = range(ndim) if not dim else dim
        axes = () if ndim == 0 else tuple(sorted({d % ndim for d in dims}))
        # the device's accumulator: float64 for floating point, int64 for integers
        acc = torch.float64 if out.dtype.is_floating_point else torch.int64
        if out.dtype not in NUMPY or out.is_complex():
            raise Decline(f"a sum into {out.dtype}")
        return run(out, "sum.IntList_out",
                   lambda a: np.sum(a, axis=axes, keepdims=keepdim, dtype=NUMPY[acc]),
                   [reader(self, self.dtype if dtype is None else dtype)])

    # ---- fill and copies ---------------------------------------------------------------------
    def host_scalar(value: Any, dtype: torch.dtype) -> np.ndarray:
        # the host's conversion of the Scalar, with the CPU's overflow check
        converted = torch.empty((), dtype=dtype).fill_(value)
        return np.asarray(converted.item(), dtype=NUMPY[dtype])

    @ks.kernel("fill_.Scalar", dtypes=ANY)
    def fill_scalar(self, value):
        v = host_scalar(value, self.dtype)
        return run(self, "fill_", lambda: v, [])

    @ks.kernel("fill_.Tensor", dtypes=ANY)
    def fill_tensor(self, value):
        if value.dim() != 0:
            raise Decline("fill_ with a tensor of several elements (the CPU's error)")
        if value.device.type == "cpu":
            return fill_scalar(self, value.item())
        return run(self, "fill_", lambda v: v, [reader(value, value.dtype)])

    @ks.kernel("zero_", dtypes=ANY)
    def zero_(self):
        zero = np.zeros((), NUMPY[self.dtype])
        return run(self, "zero_", lambda: zero, [])

    @ks.kernel("copy_", dtypes=ANY)
    def copy_(self, src, non_blocking=False):
        """Same-device copies of any layout and dtype (torchport's core copy asks it)."""
        if src.device != self.device:
            raise Decline("a copy between devices or with the host")
        if src.is_conj() or src.is_neg() or self.is_conj() or self.is_neg():
            raise Decline("lazy conjugate or negative views")
        # the source is read whole before the destination is written: overlap is safe
        return run(self, "copy_", lambda a: a.copy(), [reader(src, src.dtype)])

    return ks
