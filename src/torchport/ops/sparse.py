"""Sparse layouts on the device: COO (SparsePrivateUse1) and compressed ones (CSR, CSC,
BSR, BSC: SparseCsrPrivateUse1).

A sparse device tensor is PyTorch's own sparse tensor whose indices and values are dense
device tensors. Two kinds of kernel serve it:

* **structural** ops (constructors, ``_indices``/``_values``, ``_nnz``, ``copy_``,
  ``clone``, ``zero_``, resizes) run PyTorch's SparseCPU / SparseCsrCPU kernel on the
  device tensors themselves: those kernels only rearrange metadata and call other ops
  (``at::empty``, ``Tensor.to``) that dispatch to the device, as view ops do for dense
  tensors;
* every other op runs PyTorch's CPU sparse kernel (:class:`SparseHostCall`): each sparse
  argument becomes a CPU sparse tensor over host views (or copies, in device-only memory)
  of its indices and values, dense arguments go as the CPU fallback takes them
  (:mod:`torchport.ops.hostexec`), written arguments receive the result, and results land
  on the device in their layout.

The CPU kernels are the CPU fallback of sparse ops (a :class:`FallbackWarning` per op,
``TORCHPORT_FALLBACK=0`` refuses them), unless the backend's kernel set declares them its
own with ``ks.sparse_host_ops(to_cpu)`` -- a device whose kernels are CPU kernels on its
own view of its memory (the sim): then they run on that view, as native kernels. A
vendor's own sparse kernel is declared with ``ks.sparse_kernel("mm", layout=...)``; it
takes the op before this path, and a :class:`~torchport.ops.Decline` hands the call back.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from torchport.ops import fallback, hostexec, stats
from torchport.ops.declarations import Decline, KernelDecl
from torchport.ops.plan import plan_for

if TYPE_CHECKING:
    from torchport.core.contracts import DeviceBackend

Tensor = torch.Tensor
_K = torch._C.DispatchKey
COO_CPU_KS = torch._C.DispatchKeySet(_K.SparseCPU)
CSR_CPU_KS = torch._C.DispatchKeySet(_K.SparseCsrCPU)
COMPRESSED = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)
KEYS = {"coo": ("SparsePrivateUse1", "SparseCPU"), "compressed": ("SparseCsrPrivateUse1",
                                                                  "SparseCsrCPU")}

# Ops whose sparse CPU kernels read no values: they run on the device tensors themselves.
STRUCTURAL = frozenset({
    "_sparse_coo_tensor_with_dims", "_sparse_coo_tensor_with_dims_and_tensors",
    "_indices", "_values", "indices", "values", "_nnz", "is_coalesced", "_coalesced_",
    "sparse_dim", "dense_dim", "_dimI", "_dimV", "sparse_resize_", "sparse_resize_and_clear_",
    "empty", "empty_like", "clone", "zero_", "resize_as_sparse_",
    "crow_indices", "col_indices", "ccol_indices", "row_indices",
    "view_as_real", "view_as_complex",  # views: values viewed, the same indices
})
_VENDOR: dict[tuple[str, Any], Callable[..., Any]] = {}  # (key, overload) -> vendor kernel
# the device's own view of its memory, where the CPU's sparse kernels are its own
_HOST_VIEW: list[Callable[[Tensor], Tensor]] = []

# Structural for both operands sparse only (a dense one takes the general path).
_SPARSE_PAIR = frozenset({"copy_", "copy_sparse_to_sparse_"})

_LAYOUT_ATTRS = {torch.sparse_csr: ("crow_indices", "col_indices"),
                 torch.sparse_bsr: ("crow_indices", "col_indices"),
                 torch.sparse_csc: ("ccol_indices", "row_indices"),
                 torch.sparse_bsc: ("ccol_indices", "row_indices")}
# Ops on dense device tensors whose results are sparse: the dense paths make dense results.
TO_SPARSE = ("_to_sparse", "_to_sparse.sparse_dim", "_to_sparse_csr", "_to_sparse_csc",
             "_to_sparse_bsr", "_to_sparse_bsc")
# The invariant checks of a sparse tensor's parts (dense tensors): composite kernels that
# call CPU/CUDA DispatchStubs directly ("missing kernel for sim"); torch.load runs them on
# every sparse tensor it loads from torch 2.14 on.
VALIDATE = ("_validate_sparse_coo_tensor_args", "_validate_sparse_compressed_tensor_args",
            "_validate_sparse_csr_tensor_args", "_validate_sparse_csc_tensor_args",
            "_validate_sparse_bsr_tensor_args", "_validate_sparse_bsc_tensor_args")


def key_of(layout: torch.layout | None) -> str:
    """The device's dispatch key of sparse tensors of ``layout``."""
    return KEYS["compressed" if layout in COMPRESSED else "coo"][0]


def is_sparse(t: Any) -> bool:
    """A tensor of a sparse layout (COO or compressed)."""
    return isinstance(t, Tensor) and t.layout != torch.strided


class SparseHostCall(hostexec.HostCall):
    """:class:`~torchport.ops.hostexec.HostCall` that also maps sparse device tensors to
    CPU sparse tensors, writes sparse arguments back and moves sparse results."""

    __slots__ = ()

    def _map(self, v: Any) -> Any:
        if not isinstance(v, Tensor) or v.device.type != self.backend.name:
            return super()._map(v)
        c = self.seen.get(id(v))
        if c is not None:
            return c
        c = self._sparse_to_cpu(v) if is_sparse(v) else super()._map(v)
        if v.requires_grad and (c.is_floating_point() or c.is_complex()) \
                and torch.is_grad_enabled():
            # some sparse CPU kernels keep what their backward needs only for inputs that
            # require grad (_sparse_mm_reduce_impl's arg_out): tell them (a new alias,
            # never a cached view; autograd records nothing below its own key)
            c = c.detach().requires_grad_()
        self.seen[id(v)] = c
        return c

    def _host(self, dev: Tensor) -> Tensor:
        cpu = self.to_cpu(dev)
        self.views.append((dev, cpu))  # results aliasing it stay aliased on the device
        return cpu

    def _sparse_to_cpu(self, v: Tensor) -> Tensor:
        if v.layout == torch.sparse_coo:
            return torch.ops.aten._sparse_coo_tensor_with_dims_and_tensors(
                v.sparse_dim(), v.dense_dim(), v.shape, self._host(v._indices()),
                self._host(v._values()), dtype=v.dtype, layout=torch.sparse_coo,
                device="cpu", is_coalesced=v.is_coalesced())
        compressed, plain = _LAYOUT_ATTRS[v.layout]
        return torch.ops.aten._sparse_compressed_tensor_unsafe(
            self._host(getattr(v, compressed)()), self._host(getattr(v, plain)()),
            self._host(v.values()), v.shape, dtype=v.dtype, layout=v.layout, device="cpu")

    def _call(self, args: tuple, kwargs: dict, cargs: list, ckw: dict) -> Any:
        """The CPU kernel, with each dense argument it writes that starts past its
        storage's beginning given as a fresh copy, then copied back: the CPU's dense-sparse
        in-place kernels (``add_``, ``sub_``, ``mul_`` of a dense view by a sparse tensor)
        write at the storage's beginning instead (CUDA's honour the offset), which on a
        device's view of its memory is another tensor's."""
        moved: list[tuple[Tensor, Tensor]] = []

        def fresh(c: Any) -> Any:
            if isinstance(c, Tensor) and not is_sparse(c) and c.storage_offset() and c.numel():
                f = c.clone()
                moved.append((c, f))
                return f
            return c
        if any(is_sparse(v) for v in hostexec._iter_tensors(cargs, ckw)):
            names = self.plan.arg_names
            for name in self.plan.write_args:
                if name in ckw:
                    ckw[name] = fresh(ckw[name])
                elif names.index(name) < len(cargs):
                    cargs[names.index(name)] = fresh(cargs[names.index(name)])
        r = super()._call(args, kwargs, cargs, ckw)
        for c, f in moved:
            if f.shape == c.shape and f.stride() == c.stride():
                c.copy_(f)  # else the write-back resizes the device tensor and stores f
                r = c if r is f else r
        return r

    def _result_one(self, r: Any, alias: str | None, args: tuple, kwargs: dict) -> Any:
        if alias is not None and alias not in self.plan.write_args:
            alias = None  # a sparse "view" (permute, unsqueeze, select) is a new tensor here
        return super()._result_one(r, alias, args, kwargs)

    def _bound_outs(self, args: tuple, kwargs: dict) -> None:
        if any(is_sparse(t) for t in hostexec._iter_tensors(*hostexec._written(
                self.plan, args, kwargs))):
            self.bounded = None  # a sparse out= is rebuilt, never grown in place
            return
        super()._bound_outs(args, kwargs)

    def _write_one(self, dev: Tensor, cpu: Tensor) -> None:
        if dev.device.type != self.backend.name:
            return
        if is_sparse(dev) or is_sparse(cpu):
            if is_sparse(dev) != is_sparse(cpu) or dev.layout != cpu.layout:
                raise RuntimeError(f"{self.plan.overload_name}: the CPU kernel changed the "
                                   f"layout of an argument it writes ({dev.layout} to "
                                   f"{cpu.layout}); use the op's functional form")
            _assign_sparse(dev, self._to_device(cpu))
            return
        super()._write_one(dev, cpu)

    def _dense_to_device(self, r: Tensor) -> Tensor:
        """A dense result on the device. One in an argument's memory stays an alias of that
        argument, found by address: a device's own view of its memory may be one storage
        for many device tensors; one elsewhere in device memory is copied."""
        if r.device.type != "cpu" or self.index is None:
            return r
        if r._is_zerotensor():
            r = torch.zeros(r.shape, dtype=r.dtype)
        elif self.zero_copy and r.numel() > 0:
            ptr, shared = r.untyped_storage().data_ptr(), False
            for dev, cpu in self.views:
                if cpu.numel() == 0 or cpu.untyped_storage().data_ptr() != ptr:
                    continue
                shared = True
                alias = _alias_in(dev, cpu, r)
                if alias is not None:
                    return alias
            if shared:
                r = r.clone()
        return self.backend.result_to_device(r, self.index)

    def _to_device(self, r: Tensor) -> Tensor:
        if not is_sparse(r) or self.index is None:
            return self._dense_to_device(r)
        device = self.backend.devices[self.index]
        if r.layout == torch.sparse_coo:
            return torch.ops.aten._sparse_coo_tensor_with_dims_and_tensors(
                r.sparse_dim(), r.dense_dim(), r.shape, self._dense_to_device(r._indices()),
                self._dense_to_device(r._values()), dtype=r.dtype, layout=torch.sparse_coo,
                device=device, is_coalesced=r.is_coalesced())
        compressed, plain = _LAYOUT_ATTRS[r.layout]
        return torch.ops.aten._sparse_compressed_tensor_unsafe(
            self._dense_to_device(getattr(r, compressed)()),
            self._dense_to_device(getattr(r, plain)()),
            self._dense_to_device(r.values()), r.shape, dtype=r.dtype, layout=r.layout,
            device=device)


def _alias_in(dev: Tensor, cpu: Tensor, r: Tensor) -> Tensor | None:
    """``r`` as a view of device tensor ``dev`` (seen on the host as ``cpu``), when ``r``
    lies in ``dev``'s storage; else ``None``."""
    size = r.element_size()
    if cpu.dtype != r.dtype or dev.dtype != r.dtype or min(r.stride(), default=0) < 0:
        return None
    start = cpu.data_ptr() - dev.storage_offset() * size  # dev's storage, seen on the host
    offset, rest = divmod(r.data_ptr() - start, size)
    span = (sum((n - 1) * st for n, st in zip(r.shape, r.stride(), strict=True)) + 1) * size
    if rest or offset < 0 or r.data_ptr() + span > start + dev.untyped_storage().nbytes():
        return None
    return hostexec._as_strided.redispatch(hostexec._CPU_KS, dev, r.shape, r.stride(), offset)


def _assign_sparse(dev: Tensor, new: Tensor) -> None:
    """Make device tensor ``dev`` hold sparse device tensor ``new`` (same layout): the
    write-back of an in-place op or ``out=``."""
    if dev.layout == torch.sparse_coo:
        torch.ops.aten.copy_.default.redispatch(COO_CPU_KS, dev, new)
        return
    # a compressed tensor's copy_ requires equal nnz: take the new one's sizes first
    torch.ops.aten.resize_as_sparse_.default.redispatch(CSR_CPU_KS, dev, new)
    torch.ops.aten.copy_.default.redispatch(CSR_CPU_KS, dev, new)


def run_on_host(backend: DeviceBackend, op: Any, args: tuple, kwargs: dict) -> Any:
    """``op`` by its CPU kernel, sparse device arguments seen as CPU sparse tensors: over
    the device's own view where it declared one, else over ``Backend.to_host``'s."""
    plan = plan_for(op)
    index = hostexec.op_device(backend, op, plan, args, kwargs)
    if _HOST_VIEW:
        backend.host_sync(backend.current_device() if index is None else index)
        return SparseHostCall(backend, op, plan, index, _HOST_VIEW[0], True).run(args, kwargs)
    return SparseHostCall(backend, op, plan, index, backend.to_host,
                          backend.runtime.host_addressable).run(args, kwargs)


def _structural(base: str, args: tuple, kwargs: dict) -> bool:
    if base in STRUCTURAL:
        return True
    if base in _SPARSE_PAIR:
        return all(is_sparse(v) for v in hostexec._iter_tensors(args, kwargs))
    return False


def _run_structural(backend: DeviceBackend, op: Any, args: tuple, kwargs: dict) -> Any:
    """PyTorch's sparse CPU kernel on the device tensors themselves, under the device guard
    of the op's device (the one CUDA's generated wrapper sets: new members are made on the
    current device)."""
    ks = COO_CPU_KS
    index = None
    for v in hostexec._iter_tensors(args, kwargs):
        if v.layout in COMPRESSED:
            ks = CSR_CPU_KS
        if index is None and v.device.type == backend.name:
            index = v.device.index
    if kwargs.get("layout") in COMPRESSED:
        ks = CSR_CPU_KS
    named = kwargs.get("device")
    if named is not None and torch.device(named).type == backend.name:
        index = backend.index_of(named)
    if index is None or index == backend.current_device():
        return op.redispatch(ks, *args, **kwargs)
    before = backend.current_device()
    backend.set_device(index)
    try:
        return op.redispatch(ks, *args, **kwargs)
    finally:
        backend.set_device(before)


def run(backend: DeviceBackend, op: Any, args: tuple, kwargs: dict,
        key: str = "SparsePrivateUse1") -> Any:
    """The sparse path of one call on dispatch key ``key``: the vendor's kernel, else a
    structural kernel in place, else the CPU's. Op statistics see the first as ``native``
    (sub-path ``sparse``), the last as ``fallback`` (sub-path ``sparse``), or ``native``
    where the backend declared the CPU's sparse kernels its own."""
    name = plan_for(op).overload_name
    forced = fallback.is_forced(name)
    vendor = _VENDOR.get((key, op)) if _VENDOR else None
    if vendor is not None and not forced:
        try:
            return _timed(name, "native", vendor, args, kwargs)
        except Decline:
            pass
    if _structural(name.partition(".")[0], args, kwargs):
        return _run_structural(backend, op, args, kwargs)
    if _HOST_VIEW and not forced:
        return _timed(name, "native", lambda *a, **k: run_on_host(backend, op, a, k), args,
                      kwargs)
    if not forced:
        if not fallback._ENABLED:
            raise NotImplementedError(
                f"{name} on sparse {backend.name} tensors has no {backend.name} kernel and the "
                f"CPU fallback is off (TORCHPORT_FALLBACK=0); declare a sparse kernel "
                f"(KernelSet.sparse_kernel) or enable the fallback")
        if fallback._WARN and name not in fallback._WARNED:
            fallback._warn_once(backend, name, args, kwargs)
    return _timed(name, "fallback", lambda *a, **k: run_on_host(backend, op, a, k), args,
                  kwargs)


def _timed(name: str, path: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    if not stats.ENABLED:
        return fn(*args, **kwargs)
    t0 = time.perf_counter()
    try:
        return fn(*args, **kwargs)
    finally:
        stats.add(name, path, args, kwargs, time.perf_counter() - t0, "sparse")


def _composite_shadowed(cpu_key: str) -> list[str]:
    """ATen overloads with a kernel for ``cpu_key`` that a composite kernel would take for
    the device's sparse key before the fallback (``is_coalesced``, ``clone``, ``mul``)."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    out = []
    for qualified in torch._C._dispatch_get_all_op_names():
        if not qualified.startswith("aten::") or not has(qualified, cpu_key):
            continue
        if has(qualified, "CompositeExplicitAutograd") or \
                has(qualified, "CompositeExplicitAutogradNonFunctional"):
            out.append(qualified[len("aten::"):])
    return out


def declare(decl: KernelDecl, op: torch._ops.OpOverload) -> bool:
    """Take a vendor's sparse kernel of ``op`` (the first declaration wins); the sparse
    path asks it first, and a :class:`Decline` falls through to PyTorch's CPU kernel."""
    key = key_of(decl.layout)
    if (key, op) in _VENDOR or decl.fn is None:
        return False
    _VENDOR[(key, op)] = decl.fn
    return True


def withdraw(decl: KernelDecl, op: torch._ops.OpOverload) -> None:
    """Forget the vendor's sparse kernel of ``op`` that ``decl`` declared."""
    key = (key_of(decl.layout), op)
    if _VENDOR.get(key) is decl.fn:
        del _VENDOR[key]


def withdraw_host_view(to_cpu: Callable[[Tensor], Tensor]) -> None:
    """Forget a :func:`declare_host_view` of ``to_cpu``."""
    if _HOST_VIEW and _HOST_VIEW[0] is to_cpu:
        _HOST_VIEW.clear()


def declare_host_view(to_cpu: Callable[[Tensor], Tensor]) -> bool:
    """The backend's kernels are the CPU's over ``to_cpu``'s views, sparse ones included
    (the first declaration wins)."""
    if _HOST_VIEW:
        return False
    _HOST_VIEW.append(to_cpu)
    return True


def install(backend: DeviceBackend, lib: torch.library.Library, taken: set[str]) -> None:
    """Register the sparse path for the device's sparse keys: a fallback, plus each op a
    composite kernel would otherwise take; and the dense-to-sparse conversions the vendor
    has no kernel for (``taken``: overloads with a strided kernel)."""
    for key, cpu_key in KEYS.values():
        fallback.register(backend, _fallback(backend, key), key)
        for name in _composite_shadowed(cpu_key):
            lib.impl(name, _kernel(backend, _resolve(name), key), key)
    for name in (*TO_SPARSE, *VALIDATE):
        if name not in taken:
            lib.impl(name, _kernel(backend, _resolve(name), "PrivateUse1"), "PrivateUse1")


def _resolve(name: str) -> torch._ops.OpOverload:
    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


def _fallback(backend: DeviceBackend, key: str) -> Callable[..., Any]:
    def sparse_fallback(keyset: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return run(backend, op, args, kwargs, key)
    return sparse_fallback


def _kernel(backend: DeviceBackend, op: torch._ops.OpOverload, key: str) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        return run(backend, op, args, kwargs, key)
    return kernel
