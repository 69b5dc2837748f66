"""The fast path of host-op kernels: the common call shape, interpreted once.

Most calls a model makes are functional ops (``add.Tensor``, ``mm``, ``sum``) whose
tensor arguments all live on one device: nothing is written in place, nothing is
random, no ``device=`` argument, no list of tensors in the schema. For those, a host-op kernel
maps each device tensor to the chip's view of it, runs the CPU kernel, and moves
each new result into a fresh device block -- no schema walk per call. Every other
call (and any tensor on another device, a conjugate view, a CPU scalar tensor)
takes the general path, :func:`torchport.ops.hostexec.run_on_host`, which
handles the whole schema.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from torchport.ops import derive, fallback, hostexec
from torchport.ops.plan import plan_for

if TYPE_CHECKING:
    from torchport.backend import Backend

Tensor = torch.Tensor
_CPU_KS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_as_strided = torch.ops.aten.as_strided.default


def qualifies(op: torch._ops.OpOverload) -> bool:
    """Can calls of ``op`` take the fast path (decided from its schema, once)?"""
    p = plan_for(op)
    return not (p.write_args or p.random or p.has_device_arg or p.is_view
                or p.mixed_device_ok or p.num_returns == 0 or _takes_tensor_lists(op))


def in_place(op: torch._ops.OpOverload) -> bool:
    """An in-place op (``add_``, ``_foreach_mul_``): it writes its first argument (a
    tensor or a list of them) and returns it or nothing; no resize, no randomness."""
    p = plan_for(op)
    first = p.arg_names[0] if p.arg_names else None
    return (op._schema.name.endswith("_") and p.write_args == (first,) and not p.random
            and not p.has_device_arg and not p.mixed_device_ok
            and all(a == first for a in p.return_alias))


def _device_views(args: tuple, kwargs: dict, name: str, to_cpu: Callable[[Tensor], Tensor],
                  lists: bool = False) -> tuple[Any, list, list] | None:
    """``(device, args with device tensors as the chip's views, the views)`` when every
    tensor argument (and, with ``lists``, every element of a tensor list) is a plain
    tensor on one ``name`` device; ``None`` otherwise (the general path's business)."""
    device = None
    cargs: list = []
    views: list = []
    for a in args:
        if isinstance(a, Tensor):
            d = a.device
            if d.type != name or (device is not None and d != device) or a.is_conj() \
                    or a.is_neg():
                return None
            device = d
            a = to_cpu(a)
            views.append(a)
        elif lists and type(a) in (list, tuple) and any(isinstance(x, Tensor) for x in a):
            mapped = _device_views(a, {}, name, to_cpu)
            if mapped is None or len(mapped[2]) != len(a) \
                    or (device is not None and mapped[0] != device):
                return None  # None entries, scalars, other devices
            device, a = mapped[0], mapped[1]
        cargs.append(a)
    if device is None:
        return None
    unmapped = (Tensor, list, tuple) if lists else Tensor  # keyword tensors: general path
    for v in kwargs.values():
        if isinstance(v, unmapped):
            return None
    return device, cargs, views


def _inplace_kernel(backend: Backend, op: torch._ops.OpOverload,
                    to_cpu: Callable[[Tensor], Tensor], general: Callable[[tuple, dict], Any],
                    slow: Callable[[tuple, dict], Any] | None) -> Callable[..., Any]:
    """In-place ops on the chip's zero-copy view: the CPU kernel writes device memory
    directly, so the result is the argument itself. Asynchronous runtimes take the
    general path (the host computes, after the current stream)."""
    if backend.runtime.asynchronous:
        return lambda *args, **kwargs: general(args, kwargs)
    fb = fallback
    name = backend.name
    returns_self = bool(plan_for(op).return_alias)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if slow is not None and fb.SLOW:
            return slow(args, kwargs)
        mapped = _device_views(args, kwargs, name, to_cpu, lists=True)
        if mapped is None:
            return general(args, kwargs)
        op(*mapped[1], **kwargs)
        return args[0] if returns_self else None

    return kernel


def _takes_tensor_lists(op: torch._ops.OpOverload) -> bool:
    return any(isinstance(a.type, torch.ListType) and "Tensor" in str(a.type.getElementType())
               for a in op._schema.arguments)


def host_kernel(backend: Backend, op: torch._ops.OpOverload, to_cpu: Callable[[Tensor], Tensor],
                slow: Callable[[tuple, dict], Any] | None = None) -> Callable[..., Any]:
    """A kernel running ``op``'s CPU implementation on the views ``to_cpu`` makes.

    With ``slow``, the kernel hands its calls to ``slow(args, kwargs)`` while
    ``fallback.SLOW`` is set (ops forced to the CPU, statistics, debug hooks)."""
    run = hostexec.run_on_host
    fb = fallback
    asynchronous = backend.runtime.asynchronous

    def general(args: tuple, kwargs: dict) -> Any:
        if slow is not None and fb.SLOW:
            return slow(args, kwargs)
        if asynchronous:  # computed by the host right now: queued kernels first
            _sync_devices(backend, args, kwargs)
        return run(backend, op, args, kwargs, to_cpu, True)

    if plan_for(op).is_view:
        redispatch = op._handle.redispatch_boxed

        def view(*args: Any, **kwargs: Any) -> Any:
            if slow is not None and fb.SLOW:
                return slow(args, kwargs)
            return redispatch(_CPU_KS, *args, **kwargs)
        return view
    if in_place(op):
        return _inplace_kernel(backend, op, to_cpu, general, slow)
    if not qualifies(op):
        return lambda *args, **kwargs: general(args, kwargs)
    name = backend.name
    adopt = backend.to_device
    into = _IntoDevice(backend, op, to_cpu)
    check = slow is not None
    if asynchronous:
        return _launching_kernel(backend, op, into, general, slow)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if check and fb.SLOW:
            return slow(args, kwargs)
        mapped = _device_views(args, kwargs, name, to_cpu)
        if mapped is None:
            return general(args, kwargs)
        device, cargs, views = mapped
        index = device.index
        if into.out is not None and views[0].numel() >= LARGE_NUMEL:
            r = into(index, args, cargs, kwargs)
            if r is not None:
                return r
        r = op(*cargs, **kwargs)
        if isinstance(r, Tensor):
            return _result(r, index, views, args, adopt)
        return type(r)(_result(x, index, views, args, adopt) if isinstance(x, Tensor) else x
                       for x in r)

    return kernel


def _result(r: Tensor, index: int, views: list[Tensor], args: tuple,
            adopt: Callable[[Tensor, int], Tensor]) -> Tensor:
    """A new device tensor with ``r``'s values -- or, when the CPU kernel returned (a
    view of) an input, the same view of the device input."""
    if r.numel():
        ptr = r.untyped_storage().data_ptr()
        for i, v in enumerate(views):
            if v.untyped_storage().data_ptr() == ptr:
                dev = [a for a in args if isinstance(a, Tensor)][i]
                # offsets count from the view's storage, which may start before dev's
                shift = v.storage_offset() - dev.storage_offset()
                return _as_strided.redispatch(_CPU_KS, dev, r.shape, r.stride(),
                                              r.storage_offset() - shift)
    return adopt(r, index)


# Inputs at least this large compute straight into device memory (the result's
# layout comes from the meta kernel); smaller ones compute into a CPU result that
# is then copied, which costs less than the meta call.
LARGE_NUMEL = 1 << 15


def out_overload(op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """The ``out=`` overload computing what functional ``op`` returns (``add.Tensor`` ->
    ``add.out``), or ``None``."""
    def inputs(schema: Any) -> list[tuple[str, str]]:
        return [(a.name, str(a.type)) for a in schema.arguments
                if not (a.alias_info is not None and a.alias_info.is_write)]
    want = inputs(op._schema)
    n = len(op._schema.returns)
    for name in op.overloadpacket.overloads():
        cand = getattr(op.overloadpacket, name)
        s = cand._schema
        outs = [a for a in s.arguments if a.alias_info is not None and a.alias_info.is_write]
        if cand is not op and len(outs) == n and all(a.kwarg_only for a in outs) \
                and inputs(s) == want:
            return cand
    return None


class _IntoDevice:
    """Computes a functional op with its ``out=`` overload into new device tensors."""

    def __init__(self, backend: Backend, op: torch._ops.OpOverload,
                 to_cpu: Callable[[Tensor], Tensor]) -> None:
        self.backend = backend
        self.op = op
        self.to_cpu = to_cpu
        returns = op._schema.returns
        plain = all(isinstance(r.type, torch.TensorType) for r in returns)
        self.out = out_overload(op) if plain else None  # Tensor[] results: CPU, then copy
        self.single = len(returns) == 1
        if self.out is not None:
            self.out_names = [a.name for a in self.out._schema.arguments
                              if a.alias_info is not None and a.alias_info.is_write]

    def _outputs(self, index: int, args: tuple, kwargs: dict) -> tuple[Any, list] | None:
        """New device tensors shaped as the meta kernel says, or ``None``."""
        try:
            specs = derive.output_specs(self.op, args, kwargs)
        except Exception:  # no meta kernel, a data-dependent shape, a non-tensor result
            self.out = None
            return None
        b = self.backend
        outs = [b.empty_strided(shape, stride, dtype, index) for shape, stride, dtype in specs]
        return (outs[0] if self.single else tuple(outs)), outs

    def _out_kwargs(self, outs: list) -> dict:
        to_cpu = self.to_cpu
        return {n: to_cpu(o) for n, o in zip(self.out_names, outs, strict=True)}

    def __call__(self, index: int, args: tuple, cargs: list, kwargs: dict) -> Any:
        made = self._outputs(index, args, kwargs)
        if made is None:
            return None
        result, outs = made
        self.out(*cargs, **kwargs, **self._out_kwargs(outs))
        return result

    def launch(self, index: int, args: tuple, kwargs: dict, rt: Any, phys: int, stream: Any,
               label: str) -> Any:
        """Queue the computation on ``stream``; the results, or ``None`` (not launchable)."""
        made = self._outputs(index, args, kwargs)
        if made is None:
            return None
        result, outs = made
        to_cpu = self.to_cpu
        cargs = [to_cpu(a) if isinstance(a, Tensor) else a for a in args]
        ckw = {k: to_cpu(v) if isinstance(v, Tensor) else v for k, v in kwargs.items()}
        ckw.update(self._out_kwargs(outs))
        out = self.out
        rt.launch(phys, stream, lambda: out(*cargs, **ckw), label)
        return result


def _sync_devices(backend: Backend, args: tuple, kwargs: dict) -> None:
    done = set()
    for v in hostexec._iter_tensors(args, kwargs):
        d = v.device
        if d.type == backend.name and d.index not in done:
            done.add(d.index)
            backend.host_sync(d.index)


def _launching_kernel(backend: Backend, op: torch._ops.OpOverload, into: _IntoDevice,
                      general: Callable[[tuple, dict], Any],
                      slow: Callable[[tuple, dict], Any] | None) -> Callable[..., Any]:
    """Asynchronous runtimes: allocate the results now (layout from the meta kernel),
    queue the computation on the current stream, return before it ran."""
    fb = fallback
    name = backend.name
    rt = backend.runtime
    label = str(op)

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
        index = device.index
        launched = into.launch(index, args, kwargs, rt, backend.visible[index],
                               backend.current_stream_handle(index), label)
        return general(args, kwargs) if launched is None else launched

    return kernel
