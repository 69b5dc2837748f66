"""Factory ops (``full``, ``zeros_like``, ``new_ones``, ``arange``) made on the device."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from torchport.ops import fallback, hostviews, quiet, stats
from torchport.ops.hostkernels import outputs, trials
from torchport.ops.hostkernels.into_device import launch_call
from torchport.ops.hostkernels.layouts import LayoutCache, layout_of
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
_OPTIONS = ("dtype", "layout", "device", "pin_memory")
_ARANGE_END = torch.ops.aten.arange.default  # ATen's arange(end) is arange(0, end, 1)
# Results up to this size prove a factory's out= overload on the call itself (once per key);
# a larger one before that takes the composite.
_TRIAL_MAX_BYTES = 1 << 16


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
    queued = composite_out(op) if backend.runtime.asynchronous else None
    if queued is not None:
        return stats.traced(queued_factory(backend, op, *queued, views, layouts, kernel, slow),
                            "launch", trace)
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



def composite_out(op: torch._ops.OpOverload) -> tuple[torch._ops.OpOverload, tuple] | None:
    """The ``out=`` overload with a CPU kernel that PyTorch's composite of a factory taking
    no tensor computes into, and the arguments put before the factory's (``arange(end)``
    is ``arange.start_out(0, end)``): the ``out=`` overload's arguments are the factory's
    less the tensor options, then any left at their defaults (``step=1``). ``None`` if
    there is none, or if the composite is an allocation and an in-place fill (``full``,
    ``zeros``), which an asynchronous runtime queues already."""
    if op is _ARANGE_END:
        return torch.ops.aten.arange.start_out, (0,)
    want = [(a.name, str(a.type)) for a in op._schema.arguments if a.name not in _OPTIONS]
    if any("Tensor" in t for _, t in want):
        return None
    packet = op.overloadpacket
    for overload in packet.overloads():
        cand = getattr(packet, overload)
        args = cand._schema.arguments
        outs = [a.name for a in args if a.alias_info is not None and a.alias_info.is_write]
        rest = [a for a in args if a.name not in outs]
        if len(outs) == 1 and [(a.name, str(a.type)) for a in rest[:len(want)]] == want \
                and all(a.has_default_value() for a in rest[len(want):]) \
                and torch._C._dispatch_has_kernel_for_dispatch_key(cand.name(), "CPU"):
            return cand, ()
    return None


def queued_factory(backend: DeviceBackend, op: torch._ops.OpOverload,
                   out_op: torch._ops.OpOverload, before: tuple, views: hostviews.HostViews,
                   layouts: LayoutCache, composite: Callable[..., Any],
                   slow: Call | None = None) -> Callable[..., Any]:
    """A factory on an asynchronous runtime, as CUDA makes it: its result laid out as the
    meta kernel says, allocated now, ``out_op`` (what PyTorch's composite calls, given
    ``before`` first) queued on the current stream to fill it -- no wait for the stream.
    The layouts are cached by the arguments' values (an ``arange``'s length hangs on its
    floats'). ``out_op`` is trusted per key of the arguments' types once a call gave the
    CPU factory's bits through it; until then, and for pinned memory, the composite
    (which waits for the stream) makes the result. ``slow``: as for the other kernels."""
    rt = backend.runtime
    label = str(op)
    trusted = LayoutCache()  # the arguments' types -> whether out_op gives the factory's bits

    def learn(args: tuple, kwargs: dict) -> Any:
        """A call's result layout, or ``False`` where ``out_op`` is not trusted for it."""
        options = {k: v for k, v in kwargs.items() if k != "pin_memory"}
        meta = op(*args, **{**options, "device": "meta"})  # the factory's errors, at the call
        spec = outputs.spec_for(backend, meta.shape, meta.stride(), meta.dtype)
        types = (tuple(map(layout_of, args)), tuple((k, layout_of(v)) for k, v in options.items()))
        ok = trusted.get(types)
        if ok is None:
            if spec.nbytes > _TRIAL_MAX_BYTES:
                return None  # proven on a smaller call first
            want = op(*args, **{**options, "device": "cpu"})
            got = trials.patterned(spec.size, spec.stride, spec.dtype)
            try:
                ok = not quiet.warnings_of(lambda: out_op(*before, *args, out=got)) \
                    and want.stride() == got.stride() and trials.same_bits(want, got)
            except Exception:
                ok = False
            trusted.put(types, ok)
        return spec if ok else False

    fb = fallback

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if slow is not None and fb.SLOW:
            return slow(args, kwargs)
        if kwargs.get("pin_memory"):
            return composite(*args, **kwargs)
        # by value, and by type: arange(6) and arange(6.0) are equal keys of other dtypes
        key = (*[(type(a), a) for a in args], *[(k, type(v), v) for k, v in kwargs.items()])
        try:
            spec = layouts.get(key)
        except TypeError:  # an unhashable argument
            return composite(*args, **kwargs)
        if spec is None:
            spec = learn(args, kwargs)
            if spec is None:
                return composite(*args, **kwargs)
            layouts.put(key, spec)
        if spec is False:
            return composite(*args, **kwargs)
        index = backend.index_of(kwargs.get("device"))
        r = outputs.new_output(backend, index, spec)
        if spec.nbytes:
            view = views.entry(r)[0]
            launch_call(rt, backend.visible[index], backend.current_stream_handle(index),
                        out_op, (*before, *args), {"out": view}, label)
        return r

    return kernel
