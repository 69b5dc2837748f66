"""Functional ops taking tensor lists: ``cat``, ``stack``, ``index``, ``_foreach_*``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from torchport.memory import tensors
from torchport.memory.tensors import storage_ptr
from torchport.ops import derive, fallback, hostviews, stats
from torchport.ops.hostkernels import outputs, schema
from torchport.ops.hostkernels.into_device import IntoDevice, call_out
from torchport.ops.hostkernels.layouts import argument_key
from torchport.ops.hostkernels.mapping import CPU_KS, Call, device_index, device_views, on_views

if TYPE_CHECKING:
    from torchport.core.contracts import DeviceBackend

Tensor = torch.Tensor
_foreach_copy_boxed = torch.ops.aten._foreach_copy_.default._handle.redispatch_boxed
# Dtypes whose in-place foreach CPU kernels compute the functional ones' bits (the others
# round half and bfloat16 scalars).
TWIN_DTYPES = (torch.float32, torch.float64)
# Average tensor size from which a unary foreach op computes tensor by tensor (one pass
# over the memory, a call per tensor) instead of copy-then-twin (two passes, two calls).
_PER_TENSOR_MIN_BYTES = 16 << 10


def list_kernel(backend: DeviceBackend, op: torch._ops.OpOverload, views: hostviews.HostViews,
                into: IntoDevice | None, general: Call, slow: Call | None,
                trace: bool = False) -> Callable[..., Any]:
    """As the functional kernel does, the ``out=`` overload writing straight into new
    device tensors, with the outputs' layouts cached by the inputs' layouts (the lists'
    included; sub-paths ``out``, ``trial``); where that cannot be used (a data-dependent
    shape: ``x[mask]``), the CPU kernel on the chip's views, its results moved to the
    device (``cpu-result``). A functional foreach op that keeps its first list's layouts
    computes into new device tensors (:func:`foreach_by_twin`: ``foreach-twin``,
    ``foreach-per-tensor``). ``into`` is ``None`` for those."""
    cpu_call = op._op
    twin = schema.foreach_twin(op)
    per_tensor = schema.per_tensor_out(op)
    per_tensor_call = per_tensor._handle.redispatch_boxed if per_tensor is not None else None
    bits = schema.sees_view_bits(op)
    general = stats.noted(general, "general", trace)
    fb = fallback

    def compute(args: tuple, cargs: list, kwargs: dict) -> Any:
        inputs = [v for c in cargs if isinstance(c, (Tensor, list))
                  for v in (c if isinstance(c, list) else (c,))]
        r = cpu_call(*cargs, **kwargs)
        index = device_index(args, kwargs)
        results = [r] if isinstance(r, Tensor) else list(r)
        ptrs = {storage_ptr(v) for v in inputs if isinstance(v, Tensor) and v.numel()}
        if any(x.numel() and storage_ptr(x) in ptrs for x in results):
            return general(args, kwargs)  # a result aliases an input: the general path says how
        moved = outputs.results_to_device(backend, views, results, index)
        if trace:
            stats.note_subpath("cpu-result")
        return moved[0] if isinstance(r, Tensor) else type(r)(moved)

    if into is None or into.out is None:
        def body(args: tuple, cargs: list, kwargs: dict) -> Any:
            if twin is not None:
                outs = foreach_by_twin(backend, views, twin, per_tensor_call, args, cargs,
                                       kwargs, trace)
                if outs is not None:
                    return outs
            return compute(args, cargs, kwargs)
        return on_views(views, bits, general, slow, body)

    layouts = into.layouts
    first_call = stats.noted(into.first_call, "trial", trace)
    many = stats.noted(into.outputs, "out", trace)
    out_name = into.out_names[0] if into.single and into.out_names else None

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if slow is not None and fb.SLOW:
            return slow(args, kwargs)
        key: list = []
        cargs = device_views(args, kwargs, views, bits, key)
        if cargs is None:
            return general(args, kwargs)
        index = device_index(args, kwargs)
        for k, v in kwargs.items():
            key.append((k, argument_key(v)))
        layout_key = tuple(key)
        try:
            plan = layouts.get(layout_key)
        except TypeError:  # an unhashable argument
            return compute(args, cargs, kwargs)
        if plan is None:
            try:  # no meta kernel, a data-dependent shape: compute on the CPU from now on
                derive.output_specs(op, args, kwargs)
            except Exception:
                layouts.put(layout_key, False)
                return compute(args, cargs, kwargs)
            return first_call(layout_key, index, args, cargs, kwargs)
        if plan is False:
            return compute(args, cargs, kwargs)
        call, specs, fast = plan
        if out_name is None:
            return many(index, call, specs, fast, cargs, kwargs)
        r = outputs.new_output(backend, index, specs[0])
        kwargs[out_name] = views.entry(r)[0]
        call_out(call, fast, cargs, kwargs)
        return r

    return stats.traced(kernel, "out", trace)


def foreach_by_twin(backend: DeviceBackend, views: hostviews.HostViews,
                    twin: torch._ops.OpOverload, per_tensor: Callable[..., Any] | None,
                    args: tuple, cargs: list, kwargs: dict,
                    trace: bool = False) -> list[Tensor] | None:
    """A functional foreach op as a copy of its first list into new device tensors and
    its in-place twin on those: no CPU results to allocate, free and move (an optimizer's
    ``_foreach_sqrt`` every step); a unary one with large tensors computes each straight
    into its new tensor with ``per_tensor`` (:func:`~.schema.per_tensor_out`, boxed).
    Only where the CPU's results are the first list's dtypes and layouts, and its
    in-place kernels compute the same bits: one dtype of :data:`TWIN_DTYPES`, dense
    tensors, the other lists laid out alike, no complex numbers, no single tensor
    argument; ``None`` otherwise."""
    first = args[0]
    if not first:
        return None
    dtype = first[0].dtype
    if dtype not in TWIN_DTYPES:
        return None
    for t in first:
        if t.dtype is not dtype or not (t.is_contiguous() or tensors.is_non_overlapping_and_dense(t)):
            return None
    for a in (*args[1:], *kwargs.values()):
        if isinstance(a, (list, tuple)):
            if len(a) != len(first):
                return None
            for x, t in zip(a, first, strict=True):
                if isinstance(x, Tensor):
                    if x.dtype is not dtype or x.shape != t.shape or x.stride() != t.stride():
                        return None
                elif isinstance(x, complex):
                    return None
        elif isinstance(a, (Tensor, complex)):
            return None
    index = first[0].device.index
    outs = [outputs.new_dense_like(backend, index, t) for t in first]
    ovs = [views.entry(o)[0] for o in outs]
    try:
        if per_tensor is not None and \
                sum(t.numel() for t in first) * dtype.itemsize >= _PER_TENSOR_MIN_BYTES * len(first):
            for src, out in zip(cargs[0], ovs, strict=True):
                per_tensor(CPU_KS, src, out=out)
            sub = "foreach-per-tensor"
        else:
            _foreach_copy_boxed(CPU_KS, ovs, cargs[0])
            twin._handle.redispatch_boxed(CPU_KS, ovs, *cargs[1:], **kwargs)
            sub = "foreach-twin"
    except Exception:  # the functional kernel says what is wrong, in its own words
        return None
    if trace:
        stats.note_subpath(sub)
    return outs

