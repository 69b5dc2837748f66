"""Explicit ``out=`` calls on an asynchronous runtime (``torch.add(a, b, out=c)``): queued."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from torchport.memory.tensors import storage_ptr
from torchport.ops import derive, fallback, hostviews, stats
from torchport.ops.hostkernels import trials
from torchport.ops.hostkernels.into_device import launch_call
from torchport.ops.hostkernels.layouts import LayoutCache, layout_of
from torchport.ops.hostkernels.mapping import Call, host_arguments, plain_device
from torchport.ops.plan import plan_for

if TYPE_CHECKING:
    from torchport.core.contracts import DeviceBackend

Tensor = torch.Tensor


def out_call_kernel(backend: DeviceBackend, op: torch._ops.OpOverload,
                    views: hostviews.HostViews, layouts: LayoutCache, general: Call,
                    slow: Call | None, trace: bool = False) -> Callable[..., Any]:
    """An ``out=`` overload called with outputs already of the result's shape: the meta
    kernel checks the call now (dtypes, shapes: the CPU's errors at the call), and the CPU
    ``out=`` kernel -- the very kernel a CPU call runs, into the outputs' own layouts -- is
    queued on the current stream (sub-path ``launch``). Per layout of the arguments, it is
    first run on stand-ins, silently (:func:`.trials.inplace_launchable`); a layout it
    refuses, an output to resize (which waits for the stream, as growing memory does), an
    output sharing memory with an input (the CPU's overlap rules), a strided output of a
    kernel that writes as if contiguous (``STRIDE_BLIND_OUT``), or tensors of several
    devices are the general path's."""
    fb = fallback
    name = backend.name
    rt = backend.runtime
    names = derive.out_names(op)
    # a CPU kernel writing its output as if contiguous: a strided one is the general path's
    # (a contiguous result copied in, as CUDA's kernels address the output's strides)
    stride_blind = plan_for(op).stride_blind_out
    label = str(op)
    general = stats.noted(general, "general", trace)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if slow is not None and fb.SLOW:
            return slow(args, kwargs)
        outs = [kwargs.get(n) for n in names]
        if not all(isinstance(o, Tensor) for o in outs) or \
                (stride_blind and not all(o.is_contiguous() for o in outs)):
            return general(args, kwargs)
        device = plain_device(name, args, kwargs)
        written = {storage_ptr(o) for o in outs}
        if device is None or len(written) != len(outs) or any(
                storage_ptr(t) in written for t in trials.flat_tensors(
                    [*args, *(v for k, v in kwargs.items() if k not in names)])):
            return general(args, kwargs)
        key = (tuple(map(layout_of, args)), tuple((k, layout_of(v)) for k, v in kwargs.items()))
        try:
            ok = layouts.get(key)
        except TypeError:  # an unhashable argument
            return general(args, kwargs)
        if ok is None:
            ok = trials.inplace_launchable(op, args, kwargs)
            layouts.put(key, ok)
        if not ok:
            return general(args, kwargs)
        specs = derive.output_specs(op, args, kwargs)  # the call's errors, now
        if any(tuple(o.shape) != s[0] for o, s in zip(outs, specs, strict=True)):
            return general(args, kwargs)  # resized: the general path warns and grows it
        cargs, ckw = host_arguments(views, args, kwargs)
        index = device.index
        launch_call(rt, backend.visible[index], backend.current_stream_handle(index), op,
                    cargs, ckw, label)
        return outs[0] if len(outs) == 1 else tuple(outs)

    return stats.traced(kernel, "launch", trace)
