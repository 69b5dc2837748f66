"""In-place ops on the chip's zero-copy views: the CPU kernel writes device memory."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from torchport.ops import fallback, hostviews, stats
from torchport.ops.hostkernels import schema
from torchport.ops.hostkernels.mapping import CPU_KS, Call, device_index, device_views, on_views
from torchport.ops.plan import numbers_as_tensors, plan_for

if TYPE_CHECKING:
    from torchport.contracts import DeviceBackend

Tensor = torch.Tensor


def inplace_kernel(backend: DeviceBackend, op: torch._ops.OpOverload,
                   views: hostviews.HostViews, general: Call, slow: Call | None,
                   trace: bool = False) -> Callable[..., Any]:
    """:func:`~.schema.in_place` ops: the CPU kernel writes the chip's view directly, so
    the result is the argument itself (sub-path ``in-place``). Asynchronous runtimes take
    the general path (the host computes, after the current stream)."""
    general = stats.noted(general, "general", trace)
    if backend.runtime.asynchronous:
        return lambda *args, **kwargs: general(args, kwargs)
    plan = plan_for(op)
    returns_self = bool(plan.return_alias)
    boxed = op._handle.redispatch_boxed
    slots = plan.number_slots
    number_in_tensor_slot = schema.number_in_tensor_slot

    def body(args: tuple, cargs: list, kwargs: dict) -> Any:
        if number_in_tensor_slot(args, slots):
            boxed(CPU_KS, *numbers_as_tensors(plan, cargs), **kwargs)
        else:
            boxed(CPU_KS, *cargs, **kwargs)
        return args[0] if returns_self else None

    kernel = on_views(views, schema.sees_view_bits(op), general, slow, body)
    return stats.traced(kernel, "in-place", trace)


def lists_inplace_kernel(backend: DeviceBackend, op: torch._ops.OpOverload,
                         views: hostviews.HostViews, general: Call, slow: Call | None,
                         trace: bool = False) -> Callable[..., Any]:
    """:func:`~.schema.writes_lists_in_place` ops (fused optimizers) on the chip's views,
    the keyword tensors (a fused optimizer's ``lr``, ``grad_scale``, ``found_inf``)
    mapped too: the CPU kernel updates device memory directly, with no per-tensor schema
    walk (sub-path ``in-place``). With an asynchronous runtime the host computes after
    the work queued on the device's current stream, as the general path does for every
    in-place op."""
    asynchronous = backend.runtime.asynchronous
    boxed = op._handle.redispatch_boxed
    bits = schema.sees_view_bits(op)
    general = stats.noted(general, "general", trace)
    fb = fallback

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if slow is not None and fb.SLOW:
            return slow(args, kwargs)
        named = [k for k, v in kwargs.items() if isinstance(v, Tensor)]
        if named:
            rest = {k: v for k, v in kwargs.items() if k not in named}
            mapped = device_views((*args, *(kwargs[k] for k in named)), rest, views, bits)
            if mapped is None:
                return general(args, kwargs)
            cargs = mapped[:len(args)]
            ckwargs = {**rest, **dict(zip(named, mapped[len(args):], strict=True))}
        else:
            cargs = device_views(args, kwargs, views, bits)
            if cargs is None:
                return general(args, kwargs)
            ckwargs = kwargs
        if asynchronous:
            backend.host_sync(device_index(args, kwargs))
        boxed(CPU_KS, *cargs, **ckwargs)
        return None

    return stats.traced(kernel, "in-place", trace)
