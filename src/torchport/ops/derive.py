"""One ``out=`` kernel, three overloads: functional and in-place derived from it.

A vendor writes ``add.out``; PyTorch also calls ``add.Tensor`` (functional) and
``add_.Tensor`` (in-place). Their outputs' shape, dtype and strides are what
PyTorch's meta kernels say (type promotion and broadcasting are PyTorch's own),
so torchport runs the meta kernel, allocates or checks the outputs, and calls the
vendor kernel with ready output tensors:

* ``out=`` overload: ``out`` resized to the meta result when it does not match;
* functional overload: new device tensors, laid out as the meta result;
* in-place overload: ``out=self``, after checking the result has ``self``'s shape.

Before the vendor kernel writes, the ``out=`` and in-place overloads make the CPU's
memory-overlap checks (TensorIterator's, or the op's own): see :func:`check_overlap`.
The functional overload writes new tensors, which overlap nothing.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from torchport.memory.tensors import storage_nbytes
from torchport.ops import switch
from torchport.ops.declarations import Decline
from torchport.ops.plan import (
    DeviceMismatchError,
    check_common_device,
    cuda_checked_args,
    named_arguments,
    plan_for,
)
from torchport.ops.quiet import is_python_resize_warning, resize_warnings, silently

if TYPE_CHECKING:
    from torchport.core.contracts import DeviceBackend

Tensor = torch.Tensor
OpOverload = torch._ops.OpOverload


def _inputs(schema: Any) -> list[tuple[str, str]]:
    return [(a.name, str(a.type)) for a in schema.arguments
            if not (a.alias_info is not None and a.alias_info.is_write)]


_OUT_NAMES: dict[OpOverload, tuple[str, ...]] = {}


def out_names(op: OpOverload) -> list[str]:
    """Names of the written keyword-only arguments (``["out"]``, ``["values", "indices"]``);
    read from the schema once per overload (the wrappers below ask on every call)."""
    names = _OUT_NAMES.get(op)
    if names is None:
        names = _OUT_NAMES[op] = tuple(
            a.name for a in op._schema.arguments
            if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write)
    return list(names)


def is_out_overload(op: OpOverload) -> bool:
    return bool(out_names(op))


def functional_overloads(out_op: OpOverload) -> list[OpOverload]:
    """Overloads of the same name computing what ``out_op`` writes, as new tensors."""
    want, n = _inputs(out_op._schema), len(out_names(out_op))
    packet = out_op.overloadpacket
    found = []
    for name in packet.overloads():
        f = getattr(packet, name)
        s = f._schema
        if f is not out_op and not any(a.alias_info is not None for a in s.arguments) \
                and len(s.returns) == n and _inputs(s) == want:
            found.append(f)
    return found


def inplace_overloads(out_op: OpOverload) -> list[OpOverload]:
    """``<name>_`` overloads whose arguments are ``out_op``'s inputs, ``self`` written."""
    packet = getattr(torch.ops.aten, out_op.overloadpacket.__name__ + "_", None)
    if packet is None or len(out_names(out_op)) != 1:
        return []
    want = _inputs(out_op._schema)
    found = []
    for name in packet.overloads():
        op = getattr(packet, name)
        args = op._schema.arguments
        if args and args[0].alias_info is not None and args[0].alias_info.is_write \
                and [(a.name, str(a.type)) for a in args] == want:
            found.append(op)
    return found


def _meta(v: Any) -> Any:
    if isinstance(v, Tensor):
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
    if isinstance(v, (list, tuple)):
        return type(v)(_meta(x) for x in v)
    return v


def _meta_result(op: OpOverload, args: tuple, kwargs: dict) -> list[Tensor]:
    r = op(*_meta(args), **{k: _meta(v) for k, v in kwargs.items()})
    if r is None:  # an in-place op returning nothing (a foreach update)
        return []
    return [r] if isinstance(r, Tensor) else list(r)


def meta_accepts(op: OpOverload, args: tuple, kwargs: dict) -> bool:
    """Does ``op``'s meta kernel accept arguments laid out as these (no data-dependent
    result shape, no bad input)? A result it leaves undefined (a backward's gradient not
    asked for) is fine. Not cached: its callers cache their answer."""
    try:
        silently(lambda: _meta_result(op, args, kwargs))
    except Exception:
        return False
    return True


Spec = tuple[tuple[int, ...], tuple[int, ...], torch.dtype]  # shape, strides, dtype
_SPECS: dict[tuple, list[Spec]] = {}
_WARNS: dict[tuple, list[tuple[type[Warning], str]]] = {}  # what a cached meta call warned
_TENSOR = object()


def _sig(v: Any) -> Any:
    if isinstance(v, Tensor):
        return (_TENSOR, tuple(v.shape), v.stride(), v.dtype)
    if isinstance(v, (list, tuple)):
        return (type(v), tuple(_sig(x) for x in v))
    return (type(v), v)  # 2 and 2.0 are equal keys, but promote differently


def _layout_sig(v: Any) -> Any:
    """:func:`_sig` with a float by its type: the key of an op reading a tensor."""
    if type(v) is float:
        return float
    if isinstance(v, (list, tuple)) and not isinstance(v, Tensor):
        return (type(v), tuple(_layout_sig(x) for x in v))
    return _sig(v)


_READS: dict[OpOverload, bool] = {}


def reads_tensor(op: OpOverload) -> bool:
    """Does ``op`` read a tensor argument (not only write one)? Then no float's value
    decides its results' layout (``arange.out``'s float does: it reads none)."""
    reads = _READS.get(op)
    if reads is None:
        reads = _READS[op] = any(
            not (a.alias_info is not None and a.alias_info.is_write)
            and "Tensor" in str(a.real_type) for a in op._schema.arguments)
    return reads


def output_specs(op: OpOverload, args: tuple, kwargs: dict, quiet: bool = False) -> list[Spec]:
    """Shape, strides and dtype of each result of ``op``, from its meta kernel.

    Many meta kernels are Python reference implementations costing a millisecond; a
    training loop repeats the same shapes every step, so results are cached by the
    arguments' metadata (never their values: a meta kernel sees none), and by numbers but
    floats where the op reads a tensor (a learning rate that changes every step; see
    :func:`reads_tensor`). Errors (shape
    mismatches...) are raised each time, never cached, and the meta kernel's warnings (an
    ``out=`` resized) are warned again on each hit. ``quiet``: they are dropped."""
    sig = _layout_sig if reads_tensor(op) else _sig
    key: tuple | None = (op, tuple(sig(a) for a in args),
                         tuple((k, sig(v)) for k, v in kwargs.items()))
    try:
        hit = _SPECS.get(key)  # type: ignore[arg-type]
    except TypeError:  # an unhashable argument
        key, hit = None, None
    if hit is not None:
        if _WARNS and not quiet and key in _WARNS:  # as the CPU, every call
            for category, message in _WARNS[key]:
                warnings.warn(message, category, stacklevel=3)
        return hit
    if quiet:
        results = silently(lambda: _meta_result(op, args, kwargs))
    else:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            results = _meta_result(op, args, kwargs)
        said = _in_pytorchs_words(op, kwargs, results, said)
        for w in said:
            warnings.warn(w.message, w.category, stacklevel=3)
    specs = [(tuple(r.shape), r.stride(), r.dtype) for r in results]
    if key is not None:
        if len(_SPECS) > 16384:
            _SPECS.clear()
            _WARNS.clear()
        _SPECS[key] = specs
        if not quiet and said:
            _WARNS[key] = [(w.category, str(w.message)) for w in said]
    return specs


def _in_pytorchs_words(op: OpOverload, kwargs: dict, results: list[Tensor], said: list) -> list:
    """A meta kernel's warnings, the ``out=`` resize warning of a Python reference (its
    own words) told as the CPU's C++ kernels tell it (:func:`~torchport.ops.quiet.resize_warnings`):
    its outputs are resized in order, each to its result's shape."""
    if not any(is_python_resize_warning(w) for w in said):
        return said
    resized = iter([(tuple(kwargs[n].shape), tuple(r.shape))
                    for n, r in zip(out_names(op), results, strict=False)
                    if isinstance(kwargs.get(n), Tensor) and kwargs[n].shape != r.shape])
    told: list = []
    for w in said:
        pair = next(resized, None) if is_python_resize_warning(w) else None
        told += [w] if pair is None else resize_warnings(*pair)
    return told


def check_outs_not_inputs_to_resize(op: OpOverload, args: tuple, kwargs: dict,
                                    names: list[str] | None = None) -> None:
    """CPU's rule (TensorIterator's): an ``out=`` that is also an input of the call
    cannot be resized, its values would be gone before they are read. Nothing is
    written when it raises. ``names``: ``out_names(op)``, when the caller has them."""
    names = out_names(op) if names is None else names
    outs = [kwargs.get(n) for n in names]
    if not any(o is v for v in args for o in outs) and not any(
            o is v for k, v in kwargs.items() if k not in names for o in outs):
        return  # no argument is an output: the common call, no list built
    inputs = [v for v in args if isinstance(v, Tensor)]
    inputs += [v for k, v in kwargs.items() if k not in names and isinstance(v, Tensor)]
    if not any(kwargs.get(n) is v for n in names for v in inputs):
        return
    specs = output_specs(op, args, kwargs, quiet=True)  # its resize warning: an error here
    for name, (shape, _, _) in zip(names, specs, strict=True):
        out = kwargs[name]
        if tuple(out.shape) != shape and any(out is v for v in inputs):
            raise RuntimeError(f"output with shape {list(out.shape)} doesn't match the "
                               f"broadcast shape {list(shape)}")


_OVERLAP: dict[tuple, tuple[type[BaseException], str] | None] = {}
_MISS = object()
_is_alias_of = torch._C._is_alias_of
_internal_overlap = torch._debug_has_internal_overlap  # 0: no, 1: yes, 2: too hard to say


def check_overlap(op: OpOverload, args: tuple, kwargs: dict, outs: list[Tensor],
                  inputs: tuple | list[Any]) -> None:
    """Raise what the CPU raises when ``op`` would write ``outs`` over its own inputs.

    TensorIterator refuses an output with internal overlap (``out=x.expand(...)``) and
    an input that partially overlaps an output (``d.add_(d.t())``; the same memory, as
    in ``a.add_(b)`` writing ``a``, is fine), some ops refuse any overlap, others check
    nothing. A meta kernel sees no memory, so the CPU decides: the first call with such
    a layout runs the CPU overload on host tensors sharing memory as the arguments do
    (:func:`_cpu_overlap_error`). Plain calls (contiguous outputs on memory of their own)
    cost a contiguity test and an alias test per input."""
    for o in outs:
        if not o.is_contiguous():
            break
        for v in inputs:
            if isinstance(v, Tensor):
                if _is_alias_of(v, o):
                    break
            elif isinstance(v, (list, tuple)) and any(
                    isinstance(x, Tensor) and _is_alias_of(x, o) for x in v):
                break
        else:
            continue
        break
    else:
        return
    err = _cpu_overlap_error(op, args, kwargs)
    if err is not None:
        raise err[0](err[1])


def _flat_tensors(v: Any, into: list[Tensor]) -> None:
    """Tensors of ``v`` (also inside lists and dicts), in argument order."""
    if isinstance(v, Tensor):
        into.append(v)
    elif isinstance(v, (list, tuple)):
        for x in v:
            _flat_tensors(x, into)
    elif isinstance(v, dict):
        for x in v.values():
            _flat_tensors(x, into)


def _mirror(v: Any, made: Any) -> Any:
    """``v`` with its tensors replaced, in :func:`_flat_tensors` order, by ``made``'s."""
    if isinstance(v, Tensor):
        return next(made)
    if isinstance(v, dict):
        return {k: _mirror(x, made) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_mirror(x, made) for x in v)
    return v


def _plain_sig(v: Any) -> Any:
    """A non-tensor argument in the cache key: floats by type (a learning rate changes
    every step; it never changes what overlaps)."""
    if isinstance(v, (list, tuple)):
        return (type(v), tuple(_plain_sig(x) for x in v))
    return float if type(v) is float else (type(v), v)


def _cpu_overlap_error(op: OpOverload, args: tuple,
                       kwargs: dict) -> tuple[type[BaseException], str] | None:
    """The CPU's error for ``op`` on this aliasing layout, or ``None`` (cached per layout).

    The CPU overload runs twice on host tensors of the same shapes, strides and dtypes:
    sharing memory as the arguments do, and each on memory of its own. An error of the
    first run that the second does not raise is the CPU's overlap check (any other error
    is the vendor kernel's business, as it would be without aliasing): the second may
    fail on the made-up values (an index tensor of ones is out of range) where the first
    stopped earlier, at the overlap check. The tensors of the second run also hold no
    element twice. No device memory is read."""
    tensors: list[Tensor] = []
    _flat_tensors((args, kwargs), tensors)
    reps: list[Tensor] = []
    groups: list[int] = []
    for t in tensors:
        g = next((i for i, r in enumerate(reps) if _is_alias_of(t, r)), None)
        if g is None:
            g = len(reps)
            reps.append(t)
        groups.append(g)
    plain = (tuple(_plain_sig(a) for a in args if not isinstance(a, (Tensor, list, tuple))),
             tuple((k, _plain_sig(v)) for k, v in kwargs.items() if not isinstance(v, Tensor)))
    key: tuple | None = (op, plain, tuple(
        (g, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        for g, t in zip(groups, tensors, strict=True)))
    try:
        hit = _OVERLAP.get(key, _MISS)  # type: ignore[arg-type]
    except TypeError:  # an unhashable argument
        key, hit = None, _MISS
    if hit is not _MISS:
        return hit  # type: ignore[return-value]
    extent = [0] * len(reps)
    for g, t in zip(groups, tensors, strict=True):
        size = t.element_size()
        end = t.storage_offset() * size
        if t.numel():
            end += (sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
                    + 1) * size
        extent[g] = max(extent[g], end)
    memory = [torch.UntypedStorage(n) for n in extent]
    shared = []
    own = []
    for g, t in zip(groups, tensors, strict=True):
        shared.append(torch.empty(0, dtype=t.dtype).set_(memory[g], t.storage_offset(),
                                                          t.shape, t.stride()))
        # memory of its own, and no element twice (an expanded output's own overlap)
        o = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype) \
            if _internal_overlap(t) != 1 else torch.empty(t.shape, dtype=t.dtype)
        o.untyped_storage().fill_(1)
        own.append(o)
    for m in memory:
        m.fill_(1)  # no zero divisors: an integer op must not fail on the values
    found: tuple[type[BaseException], str] | None = None

    index_args = plan_for(op).index_args

    def run_on(memory: list[Tensor]) -> None:  # a resized out=: the CPU's warning, not ours
        a, k = _mirror((args, kwargs), iter(memory))
        for name, v in named_arguments(plan_for(op), a, k):
            if name in index_args:  # indices a kernel may trust: 0, valid everywhere
                for t in v if isinstance(v, (list, tuple)) else (v,):
                    if isinstance(t, Tensor) and t.numel() and not t.is_floating_point():
                        n = storage_nbytes(t.shape, t.stride(), t.element_size())
                        t.as_strided((n // t.element_size(),), (1,)).zero_()  # overlaps too
        silently(lambda: op(*a, **k))

    with _disable_current_modes():
        try:
            run_on(shared)
        except Exception as e:  # the CPU's verdict, whatever its type
            try:
                run_on(own)
            except Exception as e2:
                if (type(e2), str(e2)) != (type(e), str(e)):
                    found = (type(e), str(e))  # else: fails without aliasing too
            else:
                found = (type(e), str(e))
    if key is not None:
        if len(_OVERLAP) > 4096:
            _OVERLAP.clear()
        _OVERLAP[key] = found
    return found


def _tensors(v: Any) -> list[Tensor]:
    if isinstance(v, Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [t for x in v for t in _tensors(x)]
    return []


def foreign(backend: DeviceBackend, op: OpOverload, args: tuple, kwargs: dict,
            written: list[Any]) -> str | None:
    """Why the call breaks the kernel contract on devices, or None: every tensor a vendor's
    kernel gets is on the call's device, but for a 0-dim CPU tensor it only reads (a
    wrapped Python number). Such a call (an ``out=`` on the CPU or on another device of
    the backend, a CPU input of several elements, inputs on two devices) is not the
    kernel's: the next path raises CUDA's device error, or computes where CUDA does (a
    vendor's kernel would read a host or another device's address as its own). A 0-dim CPU
    operand of an op whose CUDA registration compares its tensors' devices raises CUDA's
    error here, before the kernel (:func:`~torchport.ops.plan.check_common_device`)."""
    out_ids = {id(t) for w in written for t in _tensors(w)}
    common: torch.device | None = None
    cpu_scalar = False
    for t in [*_tensors(list(args)), *_tensors(list(kwargs.values()))]:
        if t.device.type == backend.name:
            if common is None:
                common = t.device
            elif t.device != common:
                return f"tensors on {common} and {t.device}"
        elif t.device.type == "cpu" and t.dim() == 0 and id(t) not in out_ids:
            cpu_scalar = True
        else:
            return f"a tensor on {t.device}" + (" to write" if id(t) in out_ids else "")
    if cpu_scalar and common is not None:
        check_common_device(plan_for(op), args, kwargs)
    return None


def _kernel_specs(op: OpOverload, args: tuple, kwargs: dict, quiet: bool = False) -> list[Spec]:
    """:func:`output_specs` for a derived kernel. A meta kernel that rejects the call is
    often a Python reference (``torch._refs``), whose errors are not the kernels' own: a
    float ``alpha`` with integer tensors is its ``ValueError`` where the CPU and CUDA raise
    ``RuntimeError``, shapes that do not broadcast are "Attempting to broadcast a
    dimension..." where they say "The size of tensor a (3) must match...". Such a call
    takes the next path, whose CPU kernel raises the kernel's error, error class and words
    (the call costs a fallback's copies, once, as it fails). With the fallback off, the
    meta kernel's error is raised as it is: the next path would only say it is off."""
    try:
        return output_specs(op, args, kwargs, quiet=quiet)
    except Exception as e:
        if type(e).__module__.startswith("torchport") or not switch.FALLBACK_ENABLED:
            raise
        raise Decline(f"{op}: its meta kernel raises {type(e).__name__}: {e}") from e


# (out= op, its arguments' dtype signature) -> an out= of another dtype than its result's:
# (name, out dtype, result dtype), or None
_CAST_OUTS: dict[tuple, tuple[str, torch.dtype, torch.dtype] | None] = {}


def cast_out(out_op: OpOverload, args: tuple, kwargs: dict) -> tuple[str, torch.dtype, torch.dtype] | None:
    """An ``out=`` of another dtype than the functional overload's result, as ``(name, out
    dtype, result dtype)``, else ``None``. TensorIterator then computes in the result's
    dtype and casts into the ``out=`` (``mul(half, half, out=double)`` holds half-precision
    products), or refuses the cast (``neg``, ``sgn`` and ``bitwise_not`` keep their input's
    dtype: ``neg(half, out=double)`` raises); the meta kernels (Python references) accept
    it and would hand the kernel a float64 ``out=`` to write unrounded values into. Such
    calls are the CPU kernel's to decide."""
    names = out_names(out_op)
    key = (out_op, *map(_dtype_sig, args), *((k, _dtype_sig(v)) for k, v in kwargs.items()))
    try:
        return _CAST_OUTS[key]
    except KeyError:
        pass
    found = None
    functional = functional_overloads(out_op)
    if functional:
        inputs = {k: v for k, v in kwargs.items() if k not in names}
        try:
            specs = output_specs(functional[0], args, inputs, quiet=True)
        except Exception:  # the out= op's own checks speak for such a call
            specs = []
        for name, (_, _, result) in zip(names, specs, strict=False):
            out = kwargs.get(name)
            if isinstance(out, Tensor) and out.dtype != result:
                found = (name, out.dtype, result)
                break
    if len(_CAST_OUTS) > 4096:
        _CAST_OUTS.clear()
    _CAST_OUTS[key] = found
    return found


def out_kernel(backend: DeviceBackend, out_op: OpOverload, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``out_op`` itself: the outputs resized to the meta result before ``fn`` runs."""
    names = out_names(out_op)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        why = foreign(backend, out_op, args, kwargs, [kwargs.get(n) for n in names])
        if why:
            raise Decline(f"{out_op}: {why}")
        cast = cast_out(out_op, args, kwargs)
        if cast is not None:
            name, have, result = cast
            raise Decline(f"{out_op}: {name}= is {have} where the result is {result} (the CPU "
                          "kernel computes in the result's dtype and casts, or refuses)")
        check_overlap(out_op, args, kwargs, [kwargs[n] for n in names],
                      args if len(kwargs) == len(names)
                      else [*args, *(v for k, v in kwargs.items() if k not in names)])
        check_outs_not_inputs_to_resize(out_op, args, kwargs, names)
        specs = _kernel_specs(out_op, args, kwargs)
        for name, (shape, stride, _) in zip(names, specs, strict=True):
            out = kwargs[name]
            if out.shape != shape:
                backend.resize_device_tensor(out, shape, stride)
        fn(*args, **kwargs)
        outs = tuple(kwargs[n] for n in names)
        return outs[0] if len(outs) == 1 else outs
    return kernel


def functional_kernel(backend: DeviceBackend, op: OpOverload, out_op: OpOverload,
                      fn: Callable[..., Any]) -> Callable[..., Any]:
    """Functional ``op``: new device outputs laid out as the meta kernel says."""
    names = out_names(out_op)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        why = foreign(backend, op, args, kwargs, [])
        if why:
            raise Decline(f"{op}: {why}")
        specs = _kernel_specs(op, args, kwargs)
        index = _device_index(backend, args, kwargs)
        outs = [backend.empty_strided(shape, stride, dtype, index)
                for shape, stride, dtype in specs]
        try:
            fn(*args, **kwargs, **dict(zip(names, outs, strict=True)))
        except DeviceMismatchError:
            check_common_device(plan_for(op), args, kwargs)  # CUDA checks ``op``'s own
            raise
        return outs[0] if len(outs) == 1 else tuple(outs)
    return kernel


def _functional_of(op: OpOverload) -> OpOverload | None:
    """``mul.Tensor`` for ``mul_.Tensor``: the overload an in-place op computes the result
    of (``None`` where there is none)."""
    base = op._schema.name.removeprefix("aten::").removesuffix("_")
    packet = getattr(torch.ops.aten, base, None)
    return getattr(packet, op._overloadname, None) if packet is not None else None


# (in-place op, its arguments' dtype signature) -> the functional overload's result dtype
_RESULT_TYPES: dict[tuple, torch.dtype] = {}


def _dtype_sig(v: Any) -> Any:
    """What of an argument decides a result's dtype: a tensor's dtype and whether it is
    0-dim (then it promotes as a scalar), a number's type, a dtype itself."""
    if isinstance(v, Tensor):
        return (v.dtype, v.dim() == 0)
    if isinstance(v, torch.dtype):
        return v
    return type(v)


def check_result_castable(op: OpOverload, self: Tensor, args: tuple, kwargs: dict) -> None:
    """TensorIterator's rule for an in-place op: the computation's result type must cast to
    ``self``'s dtype (``int_tensor.mul_(float_tensor)``, ``bool_tensor.mul_(2)`` raise on the
    CPU and CUDA; the in-place op's meta kernel does not say)."""
    key = (op, _dtype_sig(self), *map(_dtype_sig, args),
           *((k, _dtype_sig(v)) for k, v in kwargs.items()))
    result = _RESULT_TYPES.get(key)
    if result is None:
        functional = _functional_of(op)
        if functional is None:
            return
        try:
            ((_, _, result),) = output_specs(functional, (self, *args), kwargs, quiet=True)
        except Exception:  # the in-place op's own checks speak for such a call
            return
        if len(_RESULT_TYPES) > 4096:
            _RESULT_TYPES.clear()
        _RESULT_TYPES[key] = result
    if not torch.can_cast(result, self.dtype):
        raise RuntimeError(f"result type {_type_name(result)} can't be cast to the desired "
                           f"output type {_type_name(self.dtype)}")


def _type_name(dtype: torch.dtype) -> str:
    """ATen's name of ``dtype`` (``Long`` for int64), as its messages give it."""
    return torch.empty(0, dtype=dtype).type().removeprefix("torch.").removesuffix("Tensor")


def inplace_kernel(backend: DeviceBackend, op: OpOverload, out_op: OpOverload,
                   fn: Callable[..., Any]) -> Callable[..., Any]:
    """In-place ``op``: ``out=self`` once the meta kernel agrees on ``self``'s shape."""
    (name,) = out_names(out_op)

    def kernel(self: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        why = foreign(backend, op, (self, *args), kwargs, [self])
        if why:
            raise Decline(f"{op}: {why}")
        check_overlap(op, (self, *args), kwargs, [self], [*args, *kwargs.values()])
        # PyTorch's checks; a mismatch is an error below, not the meta kernel's resize warning
        ((shape, _, _),) = _kernel_specs(op, (self, *args), kwargs, quiet=True)
        if shape != tuple(self.shape):
            raise RuntimeError(f"{op}: output with shape {list(self.shape)} doesn't match the "
                               f"broadcast shape {list(shape)}")
        check_result_castable(op, self, args, kwargs)
        try:
            fn(self, *args, **kwargs, **{name: self})
        except DeviceMismatchError:
            check_common_device(plan_for(op), (self, *args), kwargs)  # CUDA checks ``op``'s own
            raise
        return self
    return kernel


def planner(kind: str, op: OpOverload, out_op: OpOverload,
            refuses: Callable[[tuple, dict], bool]) -> Callable[..., list[Spec] | None]:
    """What the C++ caller of a vendor's out= kernel (``native_vendor_kernels.cpp``) asks once
    per layout of ``op``'s arguments (``kind``: ``"out"``, ``"functional"``, ``"inplace"``),
    for calls whose written tensors are contiguous and share memory with no other argument:
    the new outputs' specs (none for ``out=`` and in place), or ``None`` where the kernel
    above serves such calls (``refuses``: a dtype the vendor's kernel does not declare; an
    ``out=`` to resize; an in-place result of another shape). Its errors (a meta kernel's
    shape check) are the kernel's to raise, which C++ then calls. The layout decides each
    answer: a meta kernel sees no values (floats it sees only by type where the op reads a
    tensor)."""
    names = out_names(out_op)

    def out(*args: Any, **kwargs: Any) -> list[Spec] | None:
        if refuses(args, kwargs) or cast_out(out_op, args, kwargs) is not None:
            return None
        outs = [kwargs[n] for n in names]
        check_overlap(out_op, args, kwargs, outs,
                      [*args, *(v for k, v in kwargs.items() if k not in names)])
        with warnings.catch_warnings(record=True):  # kept with the specs: the kernel's to give
            warnings.simplefilter("always")
            specs = output_specs(out_op, args, kwargs)
        return None if any(o.shape != s[0] for o, s in zip(outs, specs, strict=True)) else []

    def functional(*args: Any, **kwargs: Any) -> list[Spec] | None:
        return None if refuses(args, kwargs) else output_specs(op, args, kwargs)

    def inplace(self: Tensor, *args: Any, **kwargs: Any) -> list[Spec] | None:
        if refuses((self, *args), kwargs):
            return None
        check_overlap(op, (self, *args), kwargs, [self], [*args, *kwargs.values()])
        ((shape, _, _),) = output_specs(op, (self, *args), kwargs, quiet=True)
        check_result_castable(op, self, args, kwargs)
        return [] if shape == tuple(self.shape) else None

    return {"out": out, "functional": functional, "inplace": inplace}[kind]


def checked_writes(op: OpOverload, fn: Callable[..., Any]) -> Callable[..., Any]:
    """A vendor's plain kernel of an in-place (``relu_``) or ``out=`` overload, behind the
    CPU's memory-overlap checks (:func:`check_overlap`), as the derived overloads are;
    ``fn`` itself for overloads that write no tensor argument."""
    names = out_names(op)
    args = op._schema.arguments
    inplace = not names and bool(args) and args[0].alias_info is not None \
        and args[0].alias_info.is_write and str(args[0].type) == "Tensor"
    if not (names or inplace):
        return fn

    def kernel(*a: Any, **k: Any) -> Any:
        if inplace:
            check_overlap(op, a, k, [a[0]], [*a[1:], *k.values()])
        else:
            check_overlap(op, a, k, [k[n] for n in names if n in k],
                          [*a, *(v for n, v in k.items() if n not in names)])
        return fn(*a, **k)
    return kernel


def checked_devices(op: OpOverload, fn: Callable[..., Any]) -> Callable[..., Any]:
    """A vendor's plain kernel behind CUDA's device check: a CPU operand of an op whose
    CUDA registration compares its tensors' devices (a 0-dim one too) raises CUDA's error
    before the kernel runs, as for the derived overloads (:func:`foreign`); ``fn`` itself for
    the other ops (decided once, at registration: no check on their calls)."""
    plan = plan_for(op)
    if not cuda_checked_args(plan):
        return fn

    def kernel(*a: Any, **k: Any) -> Any:
        for v in (*a, *k.values()):
            if isinstance(v, Tensor) and v.device.type == "cpu":
                check_common_device(plan, a, k)
                break
        return fn(*a, **k)
    return kernel


def _device_index(backend: DeviceBackend, args: tuple, kwargs: dict) -> int:
    for v in (*args, *kwargs.values()):
        if isinstance(v, Tensor) and v.device.type == backend.name:
            return v.device.index
    return backend.current_device()


def _has_bit(v: Any) -> bool:
    if isinstance(v, Tensor):
        return v.is_conj() or v.is_neg()
    return isinstance(v, (list, tuple)) and any(_has_bit(x) for x in v)


def _materialised(t: Tensor) -> Tensor:
    """A new tensor holding ``t``'s values, without conjugate or negative bits: the
    device's ``empty_like`` and ``copy_`` (which resolves the bits), not ``clone`` (a
    vendor's ``clone`` kernel may be the one asking)."""
    return torch.empty_like(t).copy_(t)


def resolved_bits(op: OpOverload, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, a vendor's kernel called with ``op``'s arguments, handed tensors without
    conjugate or negative bits, as CUDA's kernels read them through TensorIterator: an
    argument with a bit is materialised first, and a written one (``out=``, ``self`` in
    place) is written back through its view after ``fn`` wrote the materialised tensor (one
    object passed twice, ``add(x, y, out=x)``, stays one tensor). PyTorch's Conjugate and
    Negative fallbacks do this for most ops; the ops they let through (copies, clones, some
    linear algebra: ``hostkernels.schema.sees_view_bits``) get it here."""
    written = [a.name for a in op._schema.arguments
               if a.alias_info is not None and a.alias_info.is_write]
    positions = [i for i, a in enumerate(op._schema.arguments)
                 if a.name in written and not a.kwarg_only]

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if not (any(_has_bit(v) for v in args) or any(_has_bit(v) for v in kwargs.values())):
            return fn(*args, **kwargs)
        made: dict[int, Tensor] = {}

        def plain(v: Any) -> Any:
            if isinstance(v, Tensor) and (v.is_conj() or v.is_neg()):
                if id(v) not in made:
                    made[id(v)] = _materialised(v)
                return made[id(v)]
            if isinstance(v, (list, tuple)) and _has_bit(v):
                return type(v)(plain(x) for x in v)
            return v
        result = fn(*(plain(v) for v in args), **{n: plain(v) for n, v in kwargs.items()})
        back: dict[int, Tensor] = {}
        for v in [*(args[i] for i in positions if i < len(args)),
                  *(kwargs[n] for n in written if n in kwargs)]:
            if isinstance(v, Tensor) and id(v) in made and id(made[id(v)]) not in back:
                done = made[id(v)]
                if done.shape != v.shape:  # a plain kernel resized its out=
                    v.resize_(done.shape)
                v.copy_(done)  # the values through the view's bits
                back[id(done)] = v
        if isinstance(result, Tensor):
            return back.get(id(result), result)
        if isinstance(result, tuple):
            return tuple(back.get(id(r), r) if isinstance(r, Tensor) else r for r in result)
        return result
    return kernel
