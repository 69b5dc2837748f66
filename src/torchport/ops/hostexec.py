"""Run an ATen op's CPU kernel on device tensors, honouring the op's schema.

This is what the CPU fallback is made of, and what the sim backend's kernels
are made of too (with the simulated chip's own view of its memory in place of
host views). Given a way to see device tensors as CPU tensors it:

* maps device tensors (also inside lists) to CPU tensors, factory ``device=`` to CPU;
* runs the op (random ops on the device's generator, never the CPU one);
* makes ``out=`` and in-place arguments receive the result in the tensor the caller
  passed (resized when the CPU kernel resized its copy); an ``out=`` argument's CPU
  tensor ends where its device storage ends, so a CPU kernel growing it cannot write
  into other device memory;
* returns new results as device tensors on the op's device.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from torchport.core import native
from torchport.memory import qtensors, tensors
from torchport.ops import teardown
from torchport.ops.plan import (
    DeviceMismatchError,
    OpPlan,
    bind,
    check_common_device,
    named_arguments,
    numbers_as_tensors,
    plan_for,
)
from torchport.ops.quiet import warnings_of

if TYPE_CHECKING:
    from torchport.core.contracts import DeviceBackend

_CPU = torch.device("cpu")
_CPU_KS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_as_strided = torch.ops.aten.as_strided.default
Tensor = torch.Tensor


class HostArgumentError(RuntimeError):
    """A device tensor where CUDA's kernels read the argument on the host and require a CPU
    tensor (foreach's packed ``scalars``)."""


class GeneratorDeviceError(RuntimeError):
    """A random op was given a generator of another device type (CUDA's kernels raise
    RuntimeError with the same words)."""


def op_device(backend: DeviceBackend, op: Any, plan: OpPlan, args: tuple, kwargs: dict) -> int | None:
    """The device index an op runs on (``None``: a factory op naming a device of another
    type, ``ones_like(x, device="cpu")``, whose result stays there); raises where CUDA's
    kernels do when its tensors are on different devices: a CPU tensor is accepted as a
    0-dim operand (TensorIterator's CPU scalars) unless CUDA's registration of the op checks
    its devices (:func:`torchport.ops.plan.check_common_device`), or where
    :data:`torchport.ops.plan.CPU_ARGS` and :data:`~torchport.ops.plan.HOST_ARGS` say CUDA
    takes one."""
    name = backend.name
    found: torch.device | None = None
    cpu_scalar = False
    for arg, v in _named_tensors(plan, args, kwargs):
        d = v.device
        if d.type == name:
            if arg in plan.host_args:
                raise HostArgumentError(
                    f"Expected {arg} to be on CPU, got {d} instead (in {plan.overload_name}; "
                    f"pass them as a CPU tensor: {arg}.cpu())")
            if found is None:
                found = d
            elif d != found:
                _mismatch(found, d, plan)
        elif arg in plan.cpu_args or arg in plan.host_args:
            pass
        elif v.dim() > 0:
            if not _masked_fill_value(plan, arg, v, name, args, kwargs):
                check_common_device(plan, args, kwargs)
                _raise_argument_error(op, backend.name, args, kwargs)
                _mismatch(found or torch.device(name), d, plan, name, args, kwargs)
        else:
            cpu_scalar = True
    if cpu_scalar and found is not None:
        check_common_device(plan, args, kwargs)
    if plan.write_args:  # a 0-dim CPU tensor is an operand, never an output (as on CUDA)
        for v in _iter_tensors(*_written(plan, args, kwargs)):
            if v.device.type != name:
                _mismatch(found or torch.device(name), v.device, plan, name, args, kwargs)
    named = named_device(plan, args, kwargs)
    if named is not None:  # ``zeros_like(x, device="sim:1")``: there
        return backend.index_of(named) if named.type == name else None
    return backend.index_of(None) if found is None else found.index


def _named_tensors(plan: OpPlan, args: tuple, kwargs: dict):
    """(schema name, tensor) of each tensor of a call, also inside tensor lists."""
    for arg, v in named_arguments(plan, args, kwargs):
        if isinstance(v, Tensor):
            yield arg, v
        elif isinstance(v, (list, tuple)):
            for x in v:
                if isinstance(x, Tensor):
                    yield arg, x


def _masked_fill_value(plan: OpPlan, arg: str, v: Tensor, name: str, args: tuple,
                       kwargs: dict) -> bool:
    """``index_put_``'s CPU ``values`` of one element that CUDA takes: ATen's
    ``canDispatchToMaskedFill`` makes ``x[mask] = v`` a ``masked_fill_`` with ``v.item()``
    when nothing accumulates and the only index is a bool/uint8 mask on the device."""
    if arg != "values" or "indices" not in plan.cpu_args or v.numel() != 1:
        return False
    bound = bind(plan, args, kwargs)
    if bound.get("accumulate", False):
        return False
    given = [i for i in bound.get("indices") or () if i is not None]
    return len(given) == 1 and given[0].dtype in (torch.bool, torch.uint8) \
        and given[0].device.type == name


def named_device(plan: OpPlan, args: tuple, kwargs: dict) -> torch.device | None:
    """The device a factory op's ``device=`` argument names, or ``None``."""
    if not plan.has_device_arg:
        return None
    dev = kwargs.get("device")
    if dev is None:
        i = plan.arg_names.index("device")
        dev = args[i] if i < len(args) else None
    return None if dev is None else torch.device(dev)


def generator_error(expected: str, found: str, plan: OpPlan,
                    backend: DeviceBackend | None = None) -> GeneratorDeviceError:
    """CUDA's error for a random op given a generator of another device type."""
    fix = f"pass a generator made with torch.Generator(device={expected!r})"
    if backend is not None and backend.default_generators[:1] == tuple(backend.generators[:1]):
        # the device's default generators are CPU ones: the C++ library is unavailable
        fix = (f"{expected} has no torch.Generator ({native.why_no_generators()}): pass "
               f"torch.{expected}.default_generators[i] or seed with torch.{expected}.manual_seed")
    return GeneratorDeviceError(f"Expected a '{expected}' device type for generator but found "
                                f"'{found}' (in {plan.overload_name}; {fix})")


def cpu_generator_of(backend: DeviceBackend, given: torch.Generator,
                     plan: OpPlan) -> torch.Generator:
    """The CPU generator a CPU kernel draws from for a generator of ``backend``'s device
    type (of any index, as CUDA takes one); another type raises as CUDA's kernels do."""
    name = backend.name
    found = given.device.type
    if found != name:
        # torch.<device>.default_generators without the C++ library (the dispatcher
        # hands a kernel a new Python object: compare the generators themselves)
        if any(given._cdata == g._cdata for g in backend.generators):
            return given
        raise generator_error(name, found, plan, backend)
    return native.generator_state(given)


def _mismatch(a: torch.device, b: torch.device, plan: OpPlan, name: str = "",
              args: tuple = (), kwargs: dict | None = None) -> None:
    if plan.has_generator_arg and kwargs is not None:
        # an op on CPU tensors given a generator of this device reached its kernel by the
        # generator's dispatch key: CUDA's kernels blame the generator
        gen = kwargs.get("generator")
        i = plan.arg_names.index("generator")
        gen = args[i] if gen is None and i < len(args) else gen
        if isinstance(gen, torch.Generator) and gen.device.type == name and not any(
                v.device.type == name for v in _iter_tensors(args, kwargs)):
            raise generator_error(b.type, name, plan)
    raise DeviceMismatchError(
        f"Expected all tensors to be on the same device, but found at least two devices, "
        f"{a} and {b}! (in {plan.overload_name}; move them with .to({str(a)!r}))")


def _raise_argument_error(op: Any, name: str, args: tuple, kwargs: dict) -> None:
    """Before a device mismatch: the error the op's own argument checks raise, if any (on
    meta tensors of the same layouts). CUDA's kernels check their arguments' dtypes and
    shapes before TensorIterator compares devices (``embedding``'s index dtype)."""
    def meta(v: Any) -> Any:
        if isinstance(v, Tensor):
            return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
        if isinstance(v, (list, tuple)):
            return type(v)(meta(x) for x in v)
        if isinstance(v, torch.device) and v.type == name or \
                isinstance(v, str) and v.startswith(name):
            return torch.device("meta")
        return v
    try:
        op(*meta(args), **{k: meta(v) for k, v in kwargs.items()})
    except (RuntimeError, IndexError, ValueError, TypeError) as e:
        if not isinstance(e, NotImplementedError) and "meta" not in str(e).lower():
            raise e from None
    except Exception:  # noqa: BLE001 -- no meta kernel or a data-dependent one: the mismatch
        pass


def _written(plan: OpPlan, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The arguments ``op`` writes, as (positional, keyword) for :func:`_iter_tensors`."""
    pos = tuple(args[i] for i, n in enumerate(plan.arg_names[:len(args)])
                if n in plan.write_args)
    return pos, {k: v for k, v in kwargs.items() if k in plan.write_args}


def _iter_tensors(args: tuple, kwargs: dict):
    for v in (*args, *kwargs.values()):
        if isinstance(v, Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            for x in v:
                if isinstance(x, Tensor):
                    yield x


def run_view_op(op: Any, args: tuple, kwargs: dict) -> Any:
    """View ops only touch metadata: PyTorch's CPU kernel works on device tensors."""
    return op.redispatch(_CPU_KS, *args, **kwargs)


def drawing_from(gen: torch.Generator, fn: Callable[..., Any], args: list | tuple,
                 kwargs: dict) -> Any:
    """``fn(*args, **kwargs)`` with the CPU's default generator standing in for ``gen``: a
    CPU kernel without a generator argument draws from the default one; the device's
    stream advances, the CPU's does not."""
    cpu_gen = torch.default_generator
    saved = cpu_gen.get_state()
    cpu_gen.set_state(gen.get_state())
    try:
        return fn(*args, **kwargs)
    finally:
        gen.set_state(cpu_gen.get_state())
        cpu_gen.set_state(saved)


class HostCall:
    """One execution of ``op`` with device tensors seen through ``to_cpu``.

    ``zero_copy`` says whether ``to_cpu`` aliases device memory (then in-place
    writes land directly); otherwise written arguments are copied back."""

    __slots__ = ("backend", "op", "plan", "index", "to_cpu", "zero_copy", "views", "seen",
                 "bounded", "fixed", "shared", "copies")

    def __init__(self, backend: DeviceBackend, op: Any, plan: OpPlan, index: int | None,
                 to_cpu: Callable[[Tensor], Tensor], zero_copy: bool) -> None:
        self.backend = backend
        self.op = op
        self.plan = plan
        self.index = index
        self.to_cpu = to_cpu
        self.zero_copy = zero_copy
        self.views: list[tuple[Tensor, Tensor]] = []  # (device, cpu) pairs
        # One CPU tensor per device tensor: the CPU kernel sees an argument passed twice
        # (``out=`` that is also an input) as one tensor, and checks it as CUDA's does.
        self.seen: dict[int, Tensor] = {}
        # device storage address -> the CPU storage of exactly its bytes, for the storages
        # of out= arguments: every argument on one sees it (the CPU's overlap checks)
        self.bounded: dict[int, tuple[torch.UntypedStorage, int]] | None = None
        self.fixed = False  # one of them cannot grow (no C++ library): a second run may come
        # device-only memory: device storage address -> (one host copy of the bytes its
        # arguments span, the byte of the storage that copy starts at), for the storages
        # two argument tensors share: the CPU kernel sees their overlap as the device has it
        self.shared: dict[int, tuple[torch.UntypedStorage, int]] | None = None
        self.copies: set[int] = set()  # device tensors whose CPU tensors are copies

    def _map(self, v: Any) -> Any:
        if isinstance(v, Tensor):
            if v.device.type != self.backend.name:
                return v
            c = self.seen.get(id(v))
            if c is not None:
                return c
            if v.numel() == 0 and self.plan.is_inplace_or_out:
                # An empty out= grows on CPU, then on device; an empty in-place
                # argument keeps its shape (rand_like of a (0, 5, 0) tensor). No data
                # to read: where it is also an input, the same stand-in serves.
                c = qtensors.over_storage(v, torch.UntypedStorage(0), 0, v.shape, v.stride()) \
                    if v.is_quantized else torch.empty_strided(v.shape, v.stride(), dtype=v.dtype)
            else:
                b = self.bounded.get(v.untyped_storage().data_ptr()) if self.bounded \
                    else None
                s = self.shared.get(tensors.storage_ptr(v)) if self.shared and not \
                    v.is_quantized else None
                if b is not None:
                    c = torch.empty(0, dtype=v.dtype).set_(b[0], v.storage_offset(), v.shape,
                                                           v.stride())
                elif s is not None:
                    c = torch.empty(0, dtype=v.dtype).set_(
                        s[0], (v.storage_offset() * v.element_size() - s[1]) // v.element_size(),
                        v.shape, v.stride())
                else:
                    c = self.to_cpu(v)
                # Raw-memory views drop the lazy conjugate/negative bits: put them back.
                if v.is_conj():
                    c = c.conj()
                if v.is_neg():
                    c = torch._neg_view(c)
            self.views.append((v, c))
            self.seen[id(v)] = c
            return c
        if isinstance(v, (list, tuple)) and v and any(isinstance(x, Tensor) for x in v):
            return type(v)(self._map(x) for x in v)
        if isinstance(v, torch.device) and v.type == self.backend.name:
            return _CPU
        if isinstance(v, str) and v.startswith(self.backend.name):
            return _CPU
        return v

    def run(self, args: tuple, kwargs: dict) -> Any:
        if self.plan.out_args and self.zero_copy:
            self._bound_outs(args, kwargs)
        elif not self.zero_copy and self.to_cpu == self.backend.to_host:
            self._stage_shared(args, kwargs)
        cargs, ckw = self._map_all(args, kwargs)
        try:
            result = self._first_call(args, kwargs, cargs, ckw)
        except RuntimeError as e:
            if not self.bounded or "not resizable" not in str(e):
                raise
            cargs, ckw, result = self._grow_copies(args, kwargs)
        if self.bounded:
            self._note_copies()
        self._write_back(args, kwargs, cargs, ckw)
        return self._results(result, args, kwargs)

    def _map_all(self, args: tuple, kwargs: dict) -> tuple[list, dict]:
        cargs = [self._map(a) for a in numbers_as_tensors(self.plan, args)]
        ckw = {k: self._map(v) for k, v in kwargs.items()}
        if self.plan.has_device_arg and "pin_memory" in ckw:
            ckw["pin_memory"] = None
        return cargs, ckw

    def _call(self, args: tuple, kwargs: dict, cargs: list, ckw: dict) -> Any:
        if self.plan.random:
            return self._run_random(args, kwargs, cargs, ckw)
        return self.op(*cargs, **ckw)

    def _bound_outs(self, args: tuple, kwargs: dict) -> None:
        """CPU storages of exactly the bytes of the out= arguments' device storages (a view
        of device memory may reach past them): a CPU kernel that must grow an out= grows
        it into host memory (with the C++ library; else it finds it not resizable and the
        call runs again on copies) instead of writing into the memory of other tensors."""
        bounded: dict[int, tuple[torch.UntypedStorage, int]] = {}
        for name in self.plan.out_args:
            i = self.plan.arg_names.index(name)
            v = kwargs[name] if name in kwargs else args[i] if i < len(args) else None
            for t in (v if isinstance(v, (list, tuple)) else (v,)):
                if not isinstance(t, Tensor) or t.device.type != self.backend.name \
                        or t.numel() == 0:
                    continue
                dev = t.untyped_storage()
                if dev.data_ptr() in bounded:
                    continue
                # the host address of the storage's first byte, whatever part of it
                # the view reaches: every argument on it gets this one CPU storage
                at = self.to_cpu(t).data_ptr() - t.storage_offset() * t.element_size()
                n = dev.nbytes()
                st = native.growable_host_storage(at, n)
                bounded[dev.data_ptr()] = (tensors.host_storage(at, n) if st is None else st,
                                           at)
                self.fixed = self.fixed or st is None
        self.bounded = bounded or None

    def _stage_shared(self, args: tuple, kwargs: dict) -> None:
        """Device-only memory: the tensors of the call that share a device storage (an
        ``out=`` over an input's elements, two views of one buffer) get one host copy of
        the bytes they span, from a 64-byte boundary, instead of one copy each, so the CPU
        kernel sees them overlap as they do on the device: its overlap checks raise as on
        CUDA, and an in-place write is seen by the other views. Tensors of a storage of
        their own are copied alone, as before."""
        groups: dict[int, list[Tensor]] = {}
        for t in _iter_tensors(args, kwargs):
            if t.device.type == self.backend.name and t.layout == torch.strided \
                    and t.numel() and not t.is_quantized:
                group = groups.setdefault(tensors.storage_ptr(t), [])
                if all(t is not u for u in group):
                    group.append(t)
        shared: dict[int, tuple[torch.UntypedStorage, int]] = {}
        for ptr, group in groups.items():
            if len(group) < 2:
                continue
            spans = [tensors.byte_span(t) for t in group]
            base = min(start for start, _ in spans) // 64 * 64
            end = max(start + n for start, n in spans)
            index = group[0].device.index
            self.backend.host_sync(index)
            buf = tensors.read_bytes(self.backend, index, ptr + base, end - base)
            shared[ptr] = (buf.untyped_storage(), base)
        self.shared = shared or None

    def _note_copies(self) -> None:
        """The device tensors whose CPU tensors' storage is no longer their memory (the CPU
        kernel grew it into host memory, or a second run used copies): written back."""
        moved = {k for k, (st, at) in self.bounded.items() if st.data_ptr() != at}
        if moved:
            self.copies = {id(d) for d, _ in self.views
                           if d.numel() and d.untyped_storage().data_ptr() in moved}

    def _grow_copies(self, args: tuple, kwargs: dict) -> tuple[list, dict, Any]:
        """Without the C++ library: the call again, with the out= arguments' storages
        copied to resizable host memory for the CPU kernel to grow."""
        assert self.bounded is not None
        self.bounded = {k: (st.clone(), at) for k, (st, at) in self.bounded.items()}
        self.views.clear()
        self.seen.clear()
        cargs, ckw = self._map_all(args, kwargs)
        return cargs, ckw, self._call(args, kwargs, cargs, ckw)

    def _first_call(self, args: tuple, kwargs: dict, cargs: list, ckw: dict) -> Any:
        """The CPU kernel's call; where an out= cannot grow (no C++ library), its warnings
        are held until it returns, so that a run that stops at the growth (and runs again
        on copies, :meth:`_grow_copies`) does not tell them twice."""
        if not self.fixed:
            return self._call(args, kwargs, cargs, ckw)
        result: list = []
        said = warnings_of(lambda: result.append(self._call(args, kwargs, cargs, ckw)))
        for w in said:
            warnings.warn(w.message, w.category, stacklevel=2)
        return result[0]

    def _run_random(self, args: tuple, kwargs: dict, cargs: list, ckw: dict) -> Any:
        if self.plan.has_generator_arg:
            i = self.plan.arg_names.index("generator")
            given = cargs[i] if i < len(cargs) else ckw.get("generator")
            gen = self.backend.generators[self.index] if given is None \
                else self._generator_state(given, args, kwargs)
            if i < len(cargs):
                cargs[i] = gen
            else:
                ckw["generator"] = gen
            return self.op(*cargs, **ckw)
        return drawing_from(self.backend.generators[self.index], self.op, cargs, ckw)

    def _generator_state(self, given: torch.Generator, args: tuple,
                         kwargs: dict) -> torch.Generator:
        """The CPU generator the CPU kernel draws from for a ``generator=`` argument: the
        state of a generator of this device type (of any index, as CUDA takes one); another
        type raises as CUDA's kernels do."""
        name = self.backend.name
        found = given.device.type
        if not self.views:  # no device tensor: the op runs where its device= says
            named = named_device(self.plan, args, kwargs)
            if named is None or named.type != name:  # a CPU op reached us by the generator
                raise generator_error("cpu" if named is None else named.type, found, self.plan)
        return cpu_generator_of(self.backend, given, self.plan)

    def _write_back(self, args: tuple, kwargs: dict, cargs: list, ckw: dict) -> None:
        plan = self.plan
        if not plan.written_args:
            return
        for name in plan.written_args:
            if name in kwargs:
                dev, cpu = kwargs[name], ckw[name]
            else:
                i = plan.arg_names.index(name)
                if i >= len(args):
                    continue
                dev, cpu = args[i], cargs[i]
            if isinstance(dev, Tensor):
                self._write_one(dev, cpu)
            elif isinstance(dev, (list, tuple)):
                for d, c in zip(dev, cpu, strict=True):
                    if isinstance(d, Tensor):
                        self._write_one(d, c)

    def _write_one(self, dev: Tensor, cpu: Tensor) -> None:
        if dev.device.type != self.backend.name:
            return
        same_layout = dev.shape == cpu.shape and dev.stride() == cpu.stride()
        if cpu.is_conj() != dev.is_conj() or cpu.is_neg() != dev.is_neg():
            # The CPU kernel flipped a lazy bit of its out= argument (linalg_lu_solve.out
            # with left=False sets the conjugate bit of ``out``): its memory now holds
            # other values than the device tensor's bits say. Store the values.
            vals = cpu.resolve_conj().resolve_neg()
            if dev.is_conj():
                vals = vals.conj().resolve_conj()
            if dev.is_neg():
                vals = vals.neg()
            if not same_layout:
                self.backend.resize_device_tensor(dev, cpu.shape, cpu.stride())
            self.backend.write_tensor(dev, vals)
            return
        if not same_layout:
            self.backend.resize_device_tensor(dev, cpu.shape, cpu.stride())
        elif self.zero_copy and dev.numel() > 0 and id(dev) not in self.copies:
            return  # the CPU kernel already wrote device memory
        self.backend.write_tensor(dev, cpu)

    def _results(self, result: Any, args: tuple, kwargs: dict) -> Any:
        plan = self.plan
        if plan.num_returns == 0:
            return None
        if plan.num_returns == 1:
            return self._result_one(result, plan.return_alias[0], args, kwargs)
        return tuple(self._result_one(r, a, args, kwargs)
                     for r, a in zip(result, plan.return_alias, strict=True))

    def _result_one(self, r: Any, alias: str | None, args: tuple, kwargs: dict) -> Any:
        if alias is not None:
            if alias in kwargs:
                return kwargs[alias]
            return args[self.plan.arg_names.index(alias)]
        if isinstance(r, Tensor):
            return self._to_device(r)
        if isinstance(r, (list, tuple)):
            return type(r)(self._to_device(x) if isinstance(x, Tensor) else x for x in r)
        return r

    def _to_device(self, r: Tensor) -> Tensor:
        if r.device.type != "cpu" or self.index is None:
            return r
        if r._is_zerotensor():
            # _efficientzerotensor: a ZeroTensor has no storage to copy; the device gets
            # real zeros (same values; autograd treats them as an ordinary tensor).
            r = torch.zeros(r.shape, dtype=r.dtype)
        if self.zero_copy and r.numel() > 0:
            ptr = tensors.storage_ptr(r)
            for dev, cpu in self.views:
                if tensors.storage_ptr(cpu) == ptr and cpu.numel() > 0:
                    # The CPU kernel returned (a view of) an input: keep aliasing on device.
                    return _as_strided.redispatch(_CPU_KS, dev, r.shape, r.stride(),
                                                  r.storage_offset())
        return self.backend.result_to_device(r, self.index)  # a large new one: adopted


def run_on_host(backend: DeviceBackend, op: Any, args: tuple, kwargs: dict,
                to_cpu: Callable[[Tensor], Tensor] | None = None,
                zero_copy: bool | None = None) -> Any:
    """Run ``op`` with its CPU kernel; the default view is the backend's own."""
    plan = plan_for(op)
    if plan.is_view:
        return run_view_op(op, args, kwargs)
    if plan.stride_blind_out:
        outs = [kwargs.get(n) for n in plan.out_args]
        if all(isinstance(o, Tensor) for o in outs) and not all(o.is_contiguous() for o in outs):
            return _into_contiguous(backend, op, plan, outs, args, kwargs, to_cpu, zero_copy)
    return _run_on_host(backend, op, plan, args, kwargs, to_cpu, zero_copy)


def _run_on_host(backend: DeviceBackend, op: Any, plan: OpPlan, args: tuple, kwargs: dict,
                 to_cpu: Callable[[Tensor], Tensor] | None, zero_copy: bool | None) -> Any:
    index = op_device(backend, op, plan, args, kwargs)
    if to_cpu is None:
        to_cpu = backend.to_host
        zero_copy = backend.runtime.host_addressable
    call = HostCall(backend, op, plan, index, to_cpu, bool(zero_copy))
    if teardown.ACTIVE:
        # its Python storages, which its CPU tensors use, must outlive them
        teardown.keep(call)
    return call.run(args, kwargs)


def _into_contiguous(backend: DeviceBackend, op: Any, plan: OpPlan, outs: list[Tensor],
                     args: tuple, kwargs: dict, to_cpu: Callable[[Tensor], Tensor] | None,
                     zero_copy: bool | None) -> Any:
    """A stride-blind ``out=`` kernel (:data:`torchport.ops.plan.STRIDE_BLIND_OUT`) given
    a non-contiguous output: what CUDA writes into it, computed into new contiguous
    tensors and copied in (its strides kept). Outputs of another size are resized by the
    kernel, which lays them out contiguously: those take the kernel as they are."""
    fresh = {n: torch.empty(0, dtype=o.dtype, device=o.device)
             for n, o in zip(plan.out_args, outs, strict=True)}
    _run_on_host(backend, op, plan, args, {**kwargs, **fresh}, to_cpu, zero_copy)
    if any(fresh[n].shape != o.shape for n, o in zip(plan.out_args, outs, strict=True)):
        return _run_on_host(backend, op, plan, args, kwargs, to_cpu, zero_copy)
    for n, o in zip(plan.out_args, outs, strict=True):
        o.copy_(fresh[n])
    return outs[0] if len(outs) == 1 else tuple(outs)
