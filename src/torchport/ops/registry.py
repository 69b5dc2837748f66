"""Kernel registry: how a vendor's kernels reach PyTorch's dispatcher.

A vendor groups kernels in a :class:`KernelSet` (:mod:`torchport.ops.declarations`) and
hands it to its :class:`~torchport.backend.Backend`. Two kinds of declaration:

* ``@ks.out_kernel("add.out")`` -- the usual way: one ``out=`` kernel; torchport
  derives the functional (``add.Tensor``) and in-place (``add_.Tensor``) overloads,
  taking output shape, dtype and strides from PyTorch's meta kernels, and calls it
  with ready output tensors (:mod:`torchport.ops.derive`);
* ``@ks.kernel("mm")`` / ``@ks.kernel("add.Tensor")`` -- a plain ATen-signature
  kernel: it receives device tensors and returns device tensors, full control;
* ``ks.host_ops(["add", "mul.out"], to_cpu=...)`` -- run PyTorch's CPU kernel on
  the device's own view of its memory (what a simulator or a unified-memory
  device can do; the sim backend's kernels are made this way).

A name without overload (``"add"``) covers the whole family. Every overload
without a kernel reaches the CPU fallback (``torchport.ops.fallback``), or a
decomposition into ops that have kernels. A kernel may raise :class:`Decline`
for an input it does not handle (``dtypes=`` declares that for it); the op then
takes the next path.
Declarations stay inspectable: :func:`native_overloads` lists them.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from torchport.core.libraries import keep_past_exit
from torchport.ops import (
    c_kernels,
    core,
    derive,
    fallback,
    hostexec,
    hostkernels,
    native_factories,
    native_hostops,
    native_vendor,
    native_views,
    paths,
    quantized,
    sparse,
    stats,
    teardown,
)
from torchport.ops.declarations import CFunction, Decline, KernelDecl, KernelSet
from torchport.ops.plan import numbers_as_tensors, plan_for

if TYPE_CHECKING:
    from torchport.core.contracts import DeviceBackend


def resolve_overloads(name: str) -> list[torch._ops.OpOverload]:
    """``"add"`` -> every overload of aten.add; ``"add.out"`` -> that one."""
    base, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, base, None)
    if packet is None:
        raise ValueError(f"unknown ATen op {name!r}")
    if overload:
        return [getattr(packet, overload)]
    return [getattr(packet, o) for o in packet.overloads()]


def _has_backend_slot(op: torch._ops.OpOverload) -> bool:
    """False for ops that decompose above the backend (CompositeImplicitAutograd).

    A composite that also has a CPU kernel (``silu_backward``, ``mish_backward``)
    is no composite on the CPU: the dispatcher prefers a backend's own kernel over
    the composite one, so the CPU runs its fused kernel. The device keeps the same
    slot, so that its kernel computes what the CPU computes instead of the
    composite's pieces (other rounding)."""
    name = op._schema.name + ("." + op._schema.overload_name if op._schema.overload_name else "")
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    try:
        return not has(name, "CompositeImplicitAutograd") or has(name, "CPU")
    except RuntimeError:  # TorchScript-only overloads (aten::add.t) are not dispatcher ops
        return False


_NATIVE: dict[str, KernelDecl] = {}
_CORE: set[str] = set()
_OVERRIDES: dict[str, Callable[..., Any]] = {}  # the vendor's core.OVERRIDABLE kernels


def drop_override(backend: DeviceBackend, name: str) -> None:
    """Forget a vendor's kernel for the core overload ``name`` (the core kernel serves
    alone again)."""
    _OVERRIDES.pop(name, None)
    _NATIVE.pop(name, None)
    if name in _CORE:
        stats.OWN.add(name)
    backend.host_op_kernels.keep_in_python(name, False)


def native_overloads() -> dict[str, KernelDecl]:
    """Overload name ("add.out") -> its declaration, for tools and reports."""
    return dict(_NATIVE)


def core_overloads() -> frozenset[str]:
    """Overloads torchport implements for every backend (allocation, copies, ``set_``)."""
    return frozenset(_CORE)


def _wrap(backend: DeviceBackend, op: torch._ops.OpOverload, name: str, fn: Callable[..., Any],
          route: fallback.Route, traced: Callable[..., Any] | None = None) -> Callable[..., Any]:
    """A native kernel as registered: one flag check, then the kernel.

    The flag (``fallback.SLOW``) is set while some op is forced to the CPU or op
    statistics record; then :func:`fallback.run_native_slow` reads the
    precomputed per-overload route and calls ``traced`` (the kernel noting its
    sub-paths), or ``fn``. A :class:`Decline` takes the next path."""
    fb = fallback
    slow_fn = fn if traced is None else traced

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if fb.SLOW:
            return fb.run_native_slow(backend, op, route, slow_fn, args, kwargs)
        try:
            return fn(*args, **kwargs)
        except Decline:
            return fb.next_path(backend, op, name, args, kwargs)
    return kernel


def _host_kernel(backend: DeviceBackend, op: torch._ops.OpOverload, name: str, decl: KernelDecl,
                 route: fallback.Route) -> Callable[..., Any]:
    """A host-op kernel as registered; without a dtype restriction it checks the
    slow-path flag itself (one Python frame less on every call)."""
    if decl.dtypes is not None:
        kernel, traced = hostkernels.host_kernels(backend, op, decl.to_cpu)
        return _wrap(backend, op, name, _dtype_checked(op, kernel, decl.dtypes), route,
                     _dtype_checked(op, traced, decl.dtypes))
    holder: list[Callable[..., Any]] = []

    def slow(args: tuple, kwargs: dict) -> Any:
        return fallback.run_native_slow(backend, op, route, holder[0], args, kwargs)
    kernel, traced = hostkernels.host_kernels(backend, op, decl.to_cpu, slow)
    holder.append(traced)
    return kernel


def install(backend: DeviceBackend) -> None:
    """Register core kernels, the backend's kernel sets and the fallback."""
    lib = backend.library()
    taken: set[str] = set()
    factories: dict[str, Callable[..., Any]] = {}  # registered by native_factories, or C++
    for name, fn in core.core_kernels(backend, _OVERRIDES).items():
        op = resolve_overloads(name)[0]
        # Never forced: the fallback itself allocates and copies with them.
        kernel = _wrap(backend, op, name, fn, fallback.Route(name))
        if name in native_factories.OPS:
            factories[name] = kernel
        elif name in native_hostops.CORE:
            # or the C++ host-op kernel serves it (also between the host and the device),
            # unless a vendor kernel takes it over (then the core kernel asks it)
            backend.host_op_kernels.add(name, op, kernel, cpu_tensors=True)
            if name in _OVERRIDES:
                backend.host_op_kernels.keep_in_python(name)
        else:
            lib.impl(name, kernel, "PrivateUse1")
        taken.add(name)
        _CORE.add(name)
        if name not in _OVERRIDES:
            stats.OWN.add(name)
    fills: list[tuple[KernelDecl, Callable[..., Any]]] = []
    for ks in backend.kernel_sets:
        install_kernel_set(backend, ks, lib, taken, fills=fills)
    _install_zero(backend, lib, taken, fills)  # after every set: a zero_ of a later one wins
    from torchport.ops import device_routes  # after the backend's own: its kernels win
    routes = device_routes.fallback_routes(taken)
    stats.OWN.update(install_kernel_set(backend, device_routes.make_kernel_set(backend), lib,
                                        taken, warn=False))
    fallback.register(backend, fallback.make_fallback(backend), "PrivateUse1", routes)
    quantized.install(backend, lib)
    quantized.install_int_mm_route()
    sparse.install(backend, lib, taken)
    native_views.install(backend)
    native_factories.install(backend, factories)
    native_hostops.install(backend)
    _cache_argument_classes()
    teardown.install()


def _cache_argument_classes() -> None:
    """PyTorch converts a Python argument of an op called from Python after looking its
    SymInt/SymFloat/SymBool (or TypedStorage) class up with an import, once, on first use; during the
    interpreter's finalization that import fails. The device's Python kernels call ops so,
    and the first such call may be in a finaliser at exit (``t.sum()`` in a ``__del__``):
    one conversion of each kind now caches the classes."""
    z = torch.zeros(1)
    torch.ops.aten.sum.dim_IntList._op(z, [0], False)  # an int list, a bool
    torch.ops.aten.add.Tensor._op(z, z, alpha=1.5)  # a float Scalar
    torch.ops.aten.dropout.default._op(z, 0.0, False)  # a float
    torch.ops.aten.select.int._op(z, 0, 0)  # SymInts
    numbers_as_tensors(plan_for(torch.ops.aten.copysign.Tensor), (z, 2.0))  # wrapped numbers
    torch.empty(0).set_(torch.UntypedStorage(0), 0, (0,), (1,))  # a storage (TypedStorage's)


def overload_name(op: torch._ops.OpOverload) -> str:
    """``"add.out"`` for ``aten::add.out``; ``"mm"`` for ``aten::mm`` (the default overload)."""
    s = op._schema
    return s.name.split("::")[1] + ("." + s.overload_name if s.overload_name else "")


_DERIVED = {"out": lambda b, op, out, fn: derive.out_kernel(b, op, fn),
            "functional": derive.functional_kernel, "inplace": derive.inplace_kernel}


def _expand(decl: KernelDecl) -> list[tuple[torch._ops.OpOverload, str | None,
                                            torch._ops.OpOverload | None, KernelDecl]]:
    """(overload, how derive makes its kernel -- ``"out"``, ``"functional"``, ``"inplace"``,
    or ``None`` for the declared function itself --, the out= overload it is made from,
    declaration) for every overload a declaration covers."""
    ops = resolve_overloads(decl.name)
    if decl.kind != "out":
        return [(op, None, None, decl) for op in ops]
    out: list[tuple[torch._ops.OpOverload, str | None, torch._ops.OpOverload | None,
                    KernelDecl]] = []
    for o in ops:
        if not derive.is_out_overload(o):
            continue
        out.append((o, "out", o, decl))
        oname = overload_name(o)
        out += [(f, "functional", o, decl.derived(oname)) for f in derive.functional_overloads(o)]
        out += [(i, "inplace", o, decl.derived(oname)) for i in derive.inplace_overloads(o)]
    if not out:
        raise ValueError(f"out_kernel({decl.name!r}): no out= overload of that name")
    return out


def _vendor_function(backend: DeviceBackend, decl: KernelDecl,
                     out_op: torch._ops.OpOverload | None) -> Callable[..., Any]:
    """The declared kernel as Python calls it: a C function through ``ctypes``."""
    if isinstance(decl.fn, CFunction):
        assert out_op is not None
        return c_kernels.CKernel(decl.fn, out_op, backend)
    assert decl.fn is not None
    return decl.fn


def install_kernel_set(backend: DeviceBackend, ks: KernelSet, lib: torch.library.Library,
                       taken: set[str] | None = None, warn: bool = True,
                       fills: list[tuple[KernelDecl, Callable[..., Any]]] | None = None,
                       added: _AddedSet | None = None) -> list[str]:
    """Register a kernel set's declarations (at registration, or later for one added
    after it: ``added`` then notes what to withdraw); returns the overloads registered. The
    first declaration of an overload wins; one that names an overload (or a core one) and
    makes nothing native because others were first is reported (``warn``). A
    ``fill_.Scalar`` kernel also serves ``zero_`` where no declaration does: decided at the
    end, or by the caller that passes ``fills``."""
    undo = [] if added is None else added.undo
    native_before = set(_NATIVE)
    if taken is None:
        taken = set(_NATIVE) | _CORE
    own_fills = fills is None
    fills = [] if fills is None else fills
    done = []
    for decl in ks.decls:
        if decl.kind == "autograd":
            for op in resolve_overloads(decl.name):
                lib.impl(overload_name(op), decl.fn, "AutogradPrivateUse1")
                done.append(overload_name(op))
            continue
        if decl.kind == "sparse":
            done += _install_sparse(decl, undo)
            continue
        if decl.kind == "sparse_host":  # no overload of its own: the whole sparse path
            assert decl.to_cpu is not None
            if sparse.declare_host_view(decl.to_cpu):
                undo.append(lambda f=decl.to_cpu: sparse.withdraw_host_view(f))
            continue
        if decl.kind == "quantized_host":  # the QuantizedPrivateUse1 path, and the dense
            assert decl.to_cpu is not None  # ops that make quantized tensors
            if quantized.declare_host_view(decl.to_cpu):
                undo.append(lambda f=decl.to_cpu: quantized.withdraw_host_view(f))
                done += _install_quantizing(backend, lib, taken, decl)
            continue
        ignored, installed = [], False
        made: dict[torch._ops.OpOverload | None, Callable[..., Any]] = {}
        for op, make, out_op, d in _expand(decl):
            oname = overload_name(op)
            if oname in core.OVERRIDABLE and d.kind == "aten" and oname not in _OVERRIDES:
                own = d.fn if d.math_bits else _declines_bits(op, d.fn)
                _OVERRIDES[oname] = own if d.dtypes is None else _dtype_checked(op, own, d.dtypes)
                backend.host_op_kernels.keep_in_python(oname)  # the core kernel asks it
                stats.OWN.discard(oname)  # the vendor's kernel does the work
                undo.append(lambda n=oname: drop_override(backend, n))
                _NATIVE[oname] = d
                done.append(oname)
                installed = True
                continue
            if oname in taken:
                ignored.append(oname)
            if oname in taken or not _has_backend_slot(op):
                continue
            route = fallback.route_for(oname)
            vendor: Callable[..., Any] | None = None
            if d.kind == "host":
                fn = _host_kernel(backend, op, oname, d, route)
            else:
                if out_op not in made:
                    made[out_op] = _vendor_function(backend, d, out_op)
                vendor = made[out_op]
                # (the C++ caller hands the vendor's kernel no tensor with a bit)
                inner = derive.resolved_bits(op if out_op is None else out_op, vendor) \
                    if _resolves_bits(op, d) else vendor
                fn = derive.checked_devices(op, derive.checked_writes(op, inner)) \
                    if make is None else _DERIVED[make](backend, op, out_op, inner)
                if oname == "fill_.Scalar" and make is None:  # zero_ may call it
                    fills.append((d, fn if d.dtypes is None else _dtype_checked(op, fn, d.dtypes)))
                if d.dtypes is not None:
                    fn = _dtype_checked(op, fn, d.dtypes)
                fn = _wrap(backend, op, oname, fn, route)
            if d.kind == "host" and plan_for(op).is_view and native_views.switchable(op):
                backend.view_kernels.add(oname, fn)  # or PyTorch's C++ kernels serve
                undo.append(lambda n=oname: backend.view_kernels.remove(n))
            elif d.kind == "host" and d.dtypes is None and native_hostops.servable(op):
                backend.host_op_kernels.add(oname, op, fn)  # or the C++ host-op kernel serves
                undo.append(lambda n=oname: backend.host_op_kernels.remove(n))
            elif d.kind == "host" and d.dtypes is None and \
                    hostkernels.schema.factory(op, random=True):
                backend.host_op_kernels.add(oname, op, fn, composite=True)  # (likewise)
                undo.append(lambda n=oname: backend.host_op_kernels.remove(n))
            elif make is not None and out_op is not None and vendor is not None and \
                    _no_layout_from_values(op, make) and native_vendor.register(
                        backend, oname, op, make, out_op, fn, vendor,
                        _refuses(d.dtypes), _next_path(backend, op, oname),
                        0 if added is None else added.group):
                pass  # the C++ caller of the vendor's kernel serves (Python's calls: fn)
            else:
                if oname in native_views.OPS:  # the vendor's own view kernel serves
                    backend.view_kernels.give_way(oname)
                    undo.append(lambda n=oname: backend.view_kernels.take_back(n))
                lib.impl(oname, fn, "PrivateUse1")
            taken.add(oname)
            _NATIVE[oname] = d
            done.append(oname)
            installed = True
        if ignored and not installed and warn and decl.kind != "host" \
                and ("." in decl.name or any(n in _CORE for n in ignored)):
            warnings.warn(f"{ks.name}: the declaration of {decl.name!r} is ignored: "
                          f"{', '.join(ignored)} already has a kernel (torchport's own, or an "
                          f"earlier declaration); declare each overload once", stacklevel=3)
    if own_fills:
        done += _install_zero(backend, lib, taken, fills)
    for name in set(_NATIVE) - native_before:
        undo.append(lambda n=name: _NATIVE.pop(n, None))
    paths.forget_decisions()
    return done


class _AddedSet:
    """What a kernel set added after registration installed, for :func:`remove_kernel_set`:
    its own library (Python kernels), its C++ group (``native_vendor``), and how to undo the
    rest (overrides, host-op and view kernels, sparse and quantized declarations)."""

    def __init__(self, group: int) -> None:
        self.lib = keep_past_exit(torch.library.Library("aten", "IMPL"))
        self.group = group
        self.undo: list[Callable[[], None]] = []


_ADDED: dict[int, tuple[KernelSet, _AddedSet]] = {}  # id(kernel set) ->
_GROUPS = itertools.count(1)  # (0: the sets given at registration)


def add_kernel_set(backend: DeviceBackend, ks: KernelSet) -> list[str]:
    """Install a kernel set after registration, withdrawable by :func:`remove_kernel_set`."""
    added = _AddedSet(next(_GROUPS))
    _ADDED[id(ks)] = (ks, added)
    return install_kernel_set(backend, ks, added.lib, added=added)


def remove_kernel_set(backend: DeviceBackend, ks: KernelSet) -> None:
    """Withdraw what :func:`add_kernel_set` installed for ``ks``: its overloads take the
    path they took before it (torchport's kernel, a decomposition, the fallback). None of
    its kernels may be running in another thread."""
    entry = _ADDED.pop(id(ks), None)
    if entry is None:
        raise ValueError(f"kernel set {ks.name!r} was not added after registration "
                         f"(Backend.add_kernels); a set given at registration stays")
    _, added = entry
    for undo in reversed(added.undo):
        undo()
    native_vendor.remove(added.group)
    added.lib._destroy()
    paths.forget_decisions()


def _install_zero(backend: DeviceBackend, lib: torch.library.Library, taken: set[str],
                  fills: list[tuple[KernelDecl, Callable[..., Any]]]) -> list[str]:
    """``zero_`` served by the vendor's (first) ``fill_.Scalar`` kernel (``zero_`` is
    ``fill_(0)``, as on the CPU and CUDA), unless a kernel of its own serves it."""
    if not fills or "zero_" in taken:
        return []
    decl, fill = fills[0]
    op = torch.ops.aten.zero_.default

    def zero_(self: torch.Tensor) -> torch.Tensor:
        fill(self, 0)
        return self
    lib.impl("zero_", _wrap(backend, op, "zero_", zero_, fallback.route_for("zero_")),
             "PrivateUse1")
    taken.add("zero_")
    _NATIVE["zero_"] = decl.derived("fill_.Scalar")
    return ["zero_"]


#: Overloads that reach a kernel with conjugate/negative views but read no values (views
#: are found by their schema): the views are handed as they are.
_METADATA_OPS = frozenset({"_unsafe_view", "set_", "resize_", "requires_grad_",
                           "_has_same_storage_numel", "empty_like", "full_like",
                           "_new_zeros_with_same_feature_meta"})


def _resolves_bits(op: torch._ops.OpOverload, decl: KernelDecl) -> bool:
    """Does torchport materialise conjugate/negative views before ``decl``'s kernel of
    ``op`` runs? Where PyTorch's Conjugate/Negative fallbacks let them through to it (they
    resolve them for the other ops), unless the kernel declares ``math_bits`` or ``op`` is
    a view or reads no values."""
    return not decl.math_bits and hostkernels.schema.sees_view_bits(op) \
        and not plan_for(op).is_view and torch.Tag.inplace_view not in op.tags \
        and op._schema.name.split("::")[1] not in _METADATA_OPS


def _declines_bits(op: torch._ops.OpOverload, fn: Callable[..., Any]) -> Callable[..., Any]:
    """A vendor's ``copy_``/``_to_copy`` kernel without ``math_bits``: offered the copies
    without conjugate/negative views (torchport's core copy resolves those, materialising
    being itself a copy)."""
    def kernel(*args: Any, **kwargs: Any) -> Any:
        for v in hostexec._iter_tensors(args, kwargs):
            if v.is_conj() or v.is_neg():
                raise Decline(f"{op}: a conjugate or negative view (math_bits not declared)")
        return fn(*args, **kwargs)
    return kernel


def _install_quantizing(backend: DeviceBackend, lib: torch.library.Library, taken: set[str],
                        decl: KernelDecl) -> list[str]:
    """The CPU's kernels of the dense ops of quantization, native on the device (those
    another declaration took keep their kernel)."""
    done = []
    for name in quantized.QUANTIZING:
        for op in resolve_overloads(name):
            oname = overload_name(op)
            if oname in taken or not _has_backend_slot(op):
                continue
            lib.impl(oname, _wrap(backend, op, oname, quantized.dense_kernel(backend, op),
                                  fallback.route_for(oname)), "PrivateUse1")
            taken.add(oname)
            _NATIVE[oname] = decl
            done.append(oname)
    return done


def _install_sparse(decl: KernelDecl, undo: list[Callable[[], None]]) -> list[str]:
    """A vendor's sparse kernel, which the sparse path of its layout's dispatch key asks
    first (the first declaration of an overload wins)."""
    done = []
    for op in resolve_overloads(decl.name):
        oname = overload_name(op)
        if _has_backend_slot(op) and sparse.declare(decl, op):
            undo.append(lambda o=op: sparse.withdraw(decl, o))
            _NATIVE[f"{oname} ({sparse.key_of(decl.layout)})"] = decl
            done.append(oname)
    return done


def _no_layout_from_values(op: torch._ops.OpOverload, kind: str) -> bool:
    """Is ``op`` in place or does it read a tensor? Then no float's value decides its
    results' layout, and C++ may key its calls by layout (``native_vendor``)."""
    return kind == "inplace" or derive.reads_tensor(op)


def _refuses(dtypes: frozenset[torch.dtype] | None) -> Callable[[tuple, dict], bool]:
    """Does a call have a tensor of a dtype the kernel does not declare?"""
    def refuses(args: tuple, kwargs: dict) -> bool:
        return dtypes is not None and any(
            v.dtype not in dtypes for v in hostexec._iter_tensors(args, kwargs))
    return refuses


def _next_path(backend: DeviceBackend, op: torch._ops.OpOverload,
               name: str) -> Callable[..., Any]:
    """The path of a call the vendor's kernel declined."""
    def next_path(*args: Any, **kwargs: Any) -> Any:
        return fallback.next_path(backend, op, name, args, kwargs)
    return next_path


def _dtype_checked(op: torch._ops.OpOverload, fn: Callable[..., Any],
                   dtypes: frozenset[torch.dtype]) -> Callable[..., Any]:
    """A kernel declared for some dtypes declines the others."""
    def kernel(*args: Any, **kwargs: Any) -> Any:
        for v in hostexec._iter_tensors(args, kwargs):
            if v.dtype not in dtypes:
                raise Decline(f"{op} does not handle {v.dtype}")
        return fn(*args, **kwargs)
    return kernel


def wrap_kernel(backend: DeviceBackend, op: torch._ops.OpOverload,
                fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` wrapped as a kernel set's native kernel of ``op`` is: a :class:`Decline`
    takes the next path; forced fallback and op statistics see it. For tools and tests
    that register a kernel of their own (``Library.impl(name, kernel, "PrivateUse1")``)."""
    name = overload_name(op)
    return _wrap(backend, op, name, fn, fallback.route_for(name))
