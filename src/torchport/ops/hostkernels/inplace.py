"""In-place ops on the chip's zero-copy views: the CPU kernel writes device memory (now,
or queued on the stream of an asynchronous runtime)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from torchport.ops import fallback, hostviews, stats, switch
from torchport.ops.hostkernels import schema, trials
from torchport.ops.hostkernels.into_device import launch_call
from torchport.ops.hostkernels.layouts import LayoutCache, argument_key
from torchport.ops.hostkernels.mapping import CPU_KS, Call, device_index, device_views, on_views
from torchport.ops.plan import numbers_as_tensors, plan_for

if TYPE_CHECKING:
    from torchport.core.contracts import DeviceBackend

Tensor = torch.Tensor


def inplace_kernel(backend: DeviceBackend, op: torch._ops.OpOverload,
                   views: hostviews.HostViews, layouts: LayoutCache, general: Call,
                   slow: Call | None, trace: bool = False) -> Callable[..., Any]:
    """:func:`~.schema.in_place` ops: the CPU kernel writes the chip's view directly, so
    the result is the argument itself (sub-path ``in-place``). Asynchronous runtimes queue
    the ops whose errors the layouts decide (:func:`~.launching.launches_in_place`) on the
    current stream; the others take the general path (the host computes, after the
    current stream)."""
    if backend.runtime.asynchronous:
        if launches_in_place(op):
            return launching_inplace_kernel(backend, op, views, layouts, general, slow, trace)
        general = stats.noted(general, "general", trace)
        return lambda *args, **kwargs: general(args, kwargs)
    general = stats.noted(general, "general", trace)
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


# In-place ops without errors that depend on values (beyond what a trial on varied values
# shows): the elementwise ones, fills, and the foreach updates optimizers make.
_FILLS = frozenset({"aten::fill_", "aten::zero_", "aten::masked_fill_"})


def launches_in_place(op: torch._ops.OpOverload) -> bool:
    """Is in-place ``op`` queued on an asynchronous runtime's stream? Elementwise ops,
    fills and foreach updates are: their errors (shapes, dtypes, overlaps) are decided by
    the arguments' layouts, which a trial checks once per layout. Index writes
    (``index_put_``, ``scatter_``) are not: a bad index is the host's error, at the call."""
    name = op._schema.name
    return (torch.Tag.pointwise in op.tags or name in _FILLS
            or name.startswith("aten::_foreach_"))


def launching_inplace_kernel(backend: DeviceBackend, op: torch._ops.OpOverload,
                             views: hostviews.HostViews, layouts: LayoutCache, general: Call,
                             slow: Call | None, trace: bool = False) -> Callable[..., Any]:
    """Queue an in-place op on the current stream and return its argument at once
    (sub-path ``launch``), as a real device's host enqueues an ``add_``.

    Trusted for a layout of its arguments (and the types of its numbers) once the meta
    kernel and the CPU kernel, on copies of varied stand-in values in that layout, accept
    it silently (:func:`.trials.inplace_launchable`); a call whose written tensor shares
    memory with another argument in another layout (a partial overlap, which the CPU
    refuses) is decided by the host. Everything else takes ``general``: the host
    computes after the stream, raising the CPU's errors at the call."""
    fb = fallback
    rt = backend.runtime
    label = str(op)
    plan = plan_for(op)
    returns_self = bool(plan.return_alias)
    bits = schema.sees_view_bits(op)
    slots = plan.number_slots
    number_in_tensor_slot = schema.number_in_tensor_slot
    general = stats.noted(general, "general", trace)
    visible = backend.visible
    stream_of = backend.current_stream_handle
    # may C++ queue it itself (native_queued_ops.cpp returns the written argument, or nothing)?
    teachable = returns_self or not op._schema.returns

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if slow is not None and fb.SLOW:
            return slow(args, kwargs)
        key: list = []
        cargs = device_views(args, kwargs, views, bits, key)
        if cargs is None or _overlaps(args):
            return general(args, kwargs)
        if kwargs:
            key.extend((k, argument_key(v)) for k, v in kwargs.items())
        k = _by_float_types(key)
        ok = layouts.get(k)
        if ok is None:
            ok = trials.inplace_launchable(op, args, kwargs)
            layouts.put(k, ok)
        if not ok:
            return general(args, kwargs)
        if number_in_tensor_slot(args, slots):
            cargs = numbers_as_tensors(plan, cargs)
        first = args[0]
        index = (first if isinstance(first, Tensor) else first[0]).device.index
        launch_call(rt, visible[index], stream_of(index), op, cargs, kwargs, label)
        teach = switch.QUEUED_TEACH
        if teach is not None and teachable:  # C++ queues this layout from now on
            teach(op, None, None)
        return first if returns_self else None

    return stats.traced(kernel, "launch", trace)


def _by_float_types(key: list) -> tuple:
    """``key`` with the values of float lists (a foreach update's per-tensor step sizes,
    new every step) replaced by their length: no float value decides an elementwise op's
    errors."""
    for i, e in enumerate(key):
        if type(e) is tuple and len(e) == 2 and e[0] is list and e[1] \
                and type(e[1][0]) is float:
            key[i] = (list, len(e[1]), float)
    return tuple(key)


def _overlaps(args: tuple) -> bool:
    """Does the written tensor (the first argument) share memory with another tensor
    argument laid out otherwise (not the same view)? Tensor lists are not looked at."""
    out = args[0]
    if not isinstance(out, Tensor) or len(args) < 2:
        return False
    storage = out.untyped_storage().data_ptr()
    for a in args[1:]:
        if isinstance(a, Tensor) and a.untyped_storage().data_ptr() == storage and (
                a.data_ptr(), a.shape, a.stride()) != (out.data_ptr(), out.shape, out.stride()):
            return True
    return False
