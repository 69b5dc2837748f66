"""View ops: PyTorch's own CPU kernel on the device tensor (metadata only)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn.parameter import UninitializedTensorMixin

from torchport.memory.tensors import storage_ptr
from torchport.ops import fallback, stats
from torchport.ops.hostkernels import schema
from torchport.ops.hostkernels.layouts import LayoutCache
from torchport.ops.hostkernels.mapping import CPU_KS, Call

Tensor = torch.Tensor
_as_strided = torch.ops.aten.as_strided.default


def view_kernel(op: torch._ops.OpOverload, layouts: LayoutCache, slow: Call | None,
                trace: bool = False) -> Callable[..., Any]:
    """The CPU kernel on the device tensor (sub-path ``view``).

    Where that kernel is a composite one calling ``as_strided`` (:func:`~.schema.
    composite_view`: ``select``, ``permute``, ``expand``...), the inner call would enter
    Python a second time; the view's sizes, strides and offset (relative to its
    input's) are therefore cached by the input's layout and the arguments, and a hit is
    one ``as_strided`` of the CPU kernel (``view-cached``). A miss, or anything unusual,
    runs the composite kernel (its errors included)."""
    fb = fallback
    redispatch = op._handle.redispatch_boxed

    def view(*args: Any, **kwargs: Any) -> Any:
        if slow is not None and fb.SLOW:
            return slow(args, kwargs)
        return redispatch(CPU_KS, *args, **kwargs)

    if not schema.composite_view(op):
        return stats.traced(view, "view", trace)
    as_strided = _as_strided._handle.redispatch_boxed
    note = stats.note_subpath if trace else None

    def composite_view(*args: Any, **kwargs: Any) -> Any:
        if slow is not None and fb.SLOW:
            return slow(args, kwargs)
        x = args[0]
        if isinstance(x, UninitializedTensorMixin):  # (a lazy module's: no shape to read)
            return redispatch(CPU_KS, *args, **kwargs)
        key = (x.shape, x.stride(), *[tuple(a) if type(a) is list else a for a in args[1:]],
               *kwargs.items())
        try:
            hit = layouts.get(key)
        except TypeError:  # an unhashable argument
            return redispatch(CPU_KS, *args, **kwargs)
        if hit is not None:
            if note is not None:
                note("view-cached")
            return as_strided(CPU_KS, x, hit[0], hit[1], x.storage_offset() + hit[2])
        r = redispatch(CPU_KS, *args, **kwargs)
        if isinstance(r, Tensor) and r.numel() and storage_ptr(r) == storage_ptr(x):
            layouts.put(key, (r.shape, r.stride(), r.storage_offset() - x.storage_offset()))
        return r

    return stats.traced(composite_view, "view", trace)
