"""Factory ops (``full``, ``zeros_like``, ``new_ones``, ``arange``) made on the device."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from torchport.ops import fallback, hostviews, stats
from torchport.ops.hostkernels import outputs
from torchport.ops.hostkernels.layouts import LayoutCache
from torchport.ops.hostkernels.mapping import CPU_KS, Call

if TYPE_CHECKING:
    from torchport.core.contracts import DeviceBackend

Tensor = torch.Tensor
# Factory composites that are one allocation and one fill (PyTorch's kernels call
# ``empty_like``/``empty`` on the device, then ``fill_``/``zero_``: three Python entries):
# the value each fills with, ``None`` for their ``fill_value`` argument.
FILLS: dict[str, float | None] = {"ones_like": 1.0, "zeros_like": 0.0, "full_like": None,
                                  "new_ones": 1.0, "new_zeros": 0.0, "new_full": None}
_fill_boxed = torch.ops.aten.fill_.Scalar._handle.redispatch_boxed


def factory_kernel(backend: DeviceBackend, op: torch._ops.OpOverload,
                   views: hostviews.HostViews, layouts: LayoutCache, general: Call,
                   slow: Call | None, trace: bool = False) -> Callable[..., Any]:
    """Factory ops run PyTorch's composite kernel: the backend's own ``empty`` on the
    device the call names (or its tensor argument is on), then ``fill_``/``zero_``/
    ``arange.out`` there -- as CUDA does: no host result, no copy, a cached block
    (sub-path ``composite``). Pinned memory takes the general path. The fill composites
    (:data:`FILLS`) learn their results' layouts from it, then make them in one Python
    entry instead of three (``fill``)."""
    redispatch = op._handle.redispatch_boxed
    general = stats.noted(general, "general", trace)
    fb = fallback

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if slow is not None and fb.SLOW:
            return slow(args, kwargs)
        if kwargs.get("pin_memory"):
            return general(args, kwargs)
        return redispatch(CPU_KS, *args, **kwargs)

    name = op._schema.name.split("::")[1]
    if name not in FILLS or backend.runtime.asynchronous:
        return stats.traced(kernel, "composite", trace)
    fill = FILLS[name]
    value_at = [a.name for a in op._schema.arguments].index("fill_value") if fill is None \
        else None
    entries, add_view = views.entries, views.add
    composite = stats.noted(kernel, "composite", trace)
    # layouts: (input's layout id, arguments) -> OutputSpec, or False where the composite's
    # result is not a plain new tensor of the input's device

    def fill_kernel(*args: Any, **kwargs: Any) -> Any:
        if slow is not None and fb.SLOW:
            return slow(args, kwargs)
        if kwargs.get("device") is not None or kwargs.get("pin_memory"):
            # "sim" names the current device: no cache; nor is the input's memory read
            # (FakeTensor's fallback makes ``zeros_like(fake, device=...)``: no data pointer)
            return composite(*args, **kwargs)
        x = args[0]
        e = entries.get((x.data_ptr(), x.dtype, x.shape, x.stride()))
        if e is None:
            e = add_view(x, (x.data_ptr(), x.dtype, x.shape, x.stride()))
        if e is None:
            return composite(*args, **kwargs)
        key = (e[1], *[(type(a), tuple(a) if type(a) is list else a) for a in args[1:]],
               *kwargs.items())
        try:
            hit = layouts.get(key)
        except TypeError:  # an unhashable argument
            return composite(*args, **kwargs)
        index = e[2].index
        if hit is None:
            r = composite(*args, **kwargs)
            ok = isinstance(r, Tensor) and r.device == e[2] and r.layout == torch.strided \
                and r.storage_offset() == 0 and not (r.is_conj() or r.is_neg())
            layouts.put(key, outputs.spec_for(backend, r.shape, r.stride(), r.dtype)
                        if ok else False)
            return r
        if hit is False:
            return composite(*args, **kwargs)
        r = outputs.new_output(backend, index, hit)
        if hit.nbytes:
            v = views.entry(r)[0]
            _fill_boxed(CPU_KS, v, fill if fill is not None else
                        args[value_at] if len(args) > value_at else kwargs["fill_value"])
        return r

    return stats.traced(fill_kernel, "fill", trace)

