"""The functional kernel -- the hot path of most calls a model makes -- and random ops.

A functional op (``add.Tensor``, ``mm``, ``sum``) whose tensors are plain tensors of one
device maps each to the chip's view (a dict hit), looks its outputs' layouts up in the
op's :class:`~.layouts.LayoutCache` (keyed by the inputs' layouts), makes new device
tensors, and runs the CPU ``out=`` kernel straight into them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from torchport.memory import tensors
from torchport.ops import fallback, hostexec, stats
from torchport.ops.hostkernels import schema
from torchport.ops.hostkernels.into_device import IntoDevice
from torchport.ops.hostkernels.mapping import CPU_KS, Call, on_views

if TYPE_CHECKING:
    from torchport.core.contracts import DeviceBackend

Tensor = torch.Tensor


def functional_kernel(backend: DeviceBackend, into: IntoDevice, general: Call,
                      slow: Call | None, trace: bool = False) -> Callable[..., Any]:
    """``into.op``'s kernel: every input mapped through the view cache, the outputs'
    layouts from the layout cache, new device tensors, and the ``out=`` overload of the
    CPU kernel writing straight into them (sub-path ``out``). The first call with a
    layout learns it (``trial``); an op without an ``out=`` overload, or inputs its meta
    kernel cannot take, compute a CPU result that is then moved (``cpu-result``);
    anything else is the general path (``general``). ``trace``: note the sub-path taken
    for :func:`torchport.ops.record` (a separate kernel, used only while recording)."""
    fb = fallback
    entries = into.views.entries
    add_view = into.views.add
    layouts = into.layouts
    allocators = backend.allocators
    # the C++ allocator's one-call tensors (tensors.new_device_tensor), per device
    new_tensors = [getattr(a, "new_tensor", None) for a in allocators]
    finalizing = sys.is_finalizing  # (PyTorch cannot adopt a C++-made tensor then)
    devices = backend.devices
    watch = tensors.watch
    wrap_block = tensors.wrap_block
    new_capsule = tensors._new_capsule
    import_dlpack = tensors._import_dlpack
    dl_name = tensors.DL_NAME
    function_modes = torch._C._is_torch_function_mode_enabled
    dispatch_modes = torch._C._len_torch_dispatch_stack
    out_name = into.out_names[0] if into.single and into.out_names else None
    outputs = stats.noted(into.outputs, "out", trace)
    first = stats.noted(into.first_call, "trial", trace)
    compute = stats.noted(into.compute, "cpu-result", trace)
    general = stats.noted(general, "general", trace)
    check = slow is not None
    Tensor_ = Tensor
    bits = schema.sees_view_bits(into.op)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if check and fb.SLOW:
            return slow(args, kwargs)
        device = None
        cargs = []
        key = []
        for a in args:
            if isinstance(a, Tensor_):
                e = entries.get((a.data_ptr(), a.dtype, a.shape, a.stride()))
                if e is None:
                    e = add_view(a, (a.data_ptr(), a.dtype, a.shape, a.stride()))
                    if e is None:  # not a plain tensor of this backend's devices
                        return general(args, kwargs)
                if e[2] is not device:
                    if device is not None:
                        return general(args, kwargs)
                    device = e[2]
                if bits and (a.is_conj() or a.is_neg()):
                    return general(args, kwargs)
                cargs.append(e[0])
                key.append(e[1])
            else:  # a float's value never changes a layout (an optimizer's step sizes)
                cargs.append(a)
                t = type(a)
                key.append(t if t is float else (t, tuple(a) if t is list else a))
        if device is None:
            return general(args, kwargs)
        if kwargs:
            for k, v in kwargs.items():
                if isinstance(v, (Tensor_, list, tuple)):
                    return general(args, kwargs)
                key.append((k, float) if type(v) is float else (k, type(v), v))
        key = tuple(key)
        try:
            outs = layouts.get(key)
        except TypeError:  # an unhashable argument
            return compute(device.index, args, cargs, kwargs)
        if outs is None:
            return first(key, device.index, args, cargs, kwargs)
        if outs is False:
            return compute(device.index, args, cargs, kwargs)
        call, specs, fast = outs
        if out_name is None:
            return outputs(device.index, call, specs, fast, cargs, kwargs)
        index = device.index
        hook = backend.stream_hook
        nbytes, dtype, size, stride, shape_t, stride_t, headers = specs[0]
        # outputs.new_output, inlined (tests/test_ops_hotpath.py proves them equal)
        new = new_tensors[index]
        if new is not None and not finalizing():  # the C++ allocator: one call
            r = new(nbytes, dtype, size, stride, None if hook is None else hook(index))
            ptr = r.data_ptr()
        else:
            alloc = allocators[index]
            block = alloc.malloc(nbytes, None if hook is None else hook(index)) if nbytes \
                else None
            ptr = block.ptr if nbytes else 0
            h = headers[index]
            if h is not None:
                h[1].value = ptr
                r = import_dlpack(new_capsule(h[0], dl_name, None))
                if r.data_ptr() == ptr:
                    watch(r.untyped_storage(), alloc, block)
                else:  # another thread rewrote the header in between: the slow way
                    h = None
            if h is None:
                r = wrap_block(devices[index], alloc, block, nbytes, dtype, size, stride)
        k = (ptr, dtype, shape_t, stride_t)
        e = entries.get(k)
        if e is None:
            e = add_view(r, k)
        kwargs[out_name] = e[0]
        if fast is not None and not function_modes() and not dispatch_modes():  # call_out
            fast(*cargs, **kwargs)
        else:
            call(CPU_KS, *cargs, **kwargs)
        return r

    return stats.traced(kernel, "out", trace)


def random_kernel(backend: DeviceBackend, into: IntoDevice, general: Call, slow: Call | None,
                  trace: bool = False) -> Callable[..., Any]:
    """Random functional ops: the CPU kernel on the chip's views, drawing from the
    device's generator (:func:`hostexec.drawing_from`), its results moved to the device
    (large ones adopted; sub-path ``random``). No ``out=`` trial: a trial would draw
    twice."""
    generators = backend.generators
    compute = into.compute

    def body(args: tuple, cargs: list, kwargs: dict) -> Any:
        index = next(a for a in args if isinstance(a, Tensor)).device.index
        return hostexec.drawing_from(generators[index], compute, (index, args, cargs, kwargs),
                                     {})

    kernel = on_views(into.views, schema.sees_view_bits(into.op),
                      stats.noted(general, "general", trace), slow, body)
    return stats.traced(kernel, "random", trace)
