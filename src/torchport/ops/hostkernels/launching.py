"""Asynchronous runtimes: results allocated now, the computation queued on the stream."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from torchport.ops import fallback, stats, switch
from torchport.ops.hostkernels.into_device import IntoDevice
from torchport.ops.hostkernels.layouts import layout_of
from torchport.ops.hostkernels.mapping import Call

if TYPE_CHECKING:
    from torchport.core.contracts import DeviceBackend

Tensor = torch.Tensor


def launching_kernel(backend: DeviceBackend, into: IntoDevice, general: Call,
                     slow: Call | None, trace: bool = False) -> Callable[..., Any]:
    """Allocate the results now, queue the computation on the current stream, return
    before it ran (sub-path ``launch``).

    The results' layouts are the CPU kernel's, and the ``out=`` overload is trusted only
    where it computes into them as they are: the first call with each layout of the
    inputs tries both on stand-ins (:meth:`IntoDevice.launch_specs`; a meta kernel's
    strides for dimensions of size 1, or its dtypes, can differ from the CPU's). Where
    that fails, the host computes the op now (``general``)."""
    fb = fallback
    name = backend.name
    rt = backend.runtime
    label = str(into.op)
    layouts = into.layouts  # inputs' layout key -> results' OutputSpecs, or None
    general = stats.noted(general, "general", trace)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if slow is not None and fb.SLOW:
            return slow(args, kwargs)
        device = None
        for a in (*args, *kwargs.values()):
            if isinstance(a, Tensor):
                if a.device.type != name or (device is not None and a.device != device) \
                        or a.is_conj() or a.is_neg():
                    return general(args, kwargs)
                device = a.device
        if device is None or into.out is None:
            return general(args, kwargs)
        key = (tuple(map(layout_of, args)), tuple((k, layout_of(v)) for k, v in kwargs.items()))
        try:
            specs = layouts[key]
        except KeyError:
            specs = into.launch_specs(args, kwargs)
            layouts.put(key, specs)
        except TypeError:  # an unhashable argument
            specs = into.launch_specs(args, kwargs)
        if specs is None:
            return general(args, kwargs)
        index = device.index
        r = into.launch(index, specs, args, kwargs, rt, backend.visible[index],
                        backend.current_stream_handle(index), label)
        teach = switch.QUEUED_TEACH
        if teach is not None and into.queues_from_cpp:  # C++ queues this layout from now on
            teach(into.op, into.out, specs)
        return r

    return stats.traced(kernel, "launch", trace)

