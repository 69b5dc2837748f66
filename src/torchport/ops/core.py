"""Kernels every backend gets from torchport: allocation, copies, resize, set_, scalars.

They are written once against the runtime interface, so a vendor never
implements them: memory comes from the caching allocator and bytes move with
the runtime's copy functions (or zero-copy host views when it allows them).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from torchport.core import native
from torchport.memory import tensors
from torchport.ops import hostviews
from torchport.ops.declarations import Decline

if TYPE_CHECKING:
    from torchport.core.contracts import DeviceBackend

_CPU_KS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
#: Core overloads a vendor's kernel set may take over: a ``copy_`` kernel is offered every
#: same-device copy (one span of bytes too; any layout and dtype; the core kernel still does
#: the others), a ``_to_copy`` kernel is tried first. Either may raise Decline for an input.
OVERRIDABLE = frozenset({"copy_", "_to_copy"})
_set_storage = torch.ops.aten.set_.source_Storage_storage_offset


def strides_for(size, memory_format: torch.memory_format | None) -> list[int]:
    """Strides of a new tensor in ``memory_format`` (CUDA's rules)."""
    size = list(size)
    if memory_format == torch.channels_last and len(size) == 4:
        n, c, h, w = size
        return [h * w * c, 1, w * c, c] if c else tensors.contiguous_strides(size)
    if memory_format == torch.channels_last_3d and len(size) == 5:
        n, c, d, h, w = size
        return [d * h * w * c, 1, h * w * c, w * c, c] if c else tensors.contiguous_strides(size)
    if memory_format in (torch.channels_last, torch.channels_last_3d):
        raise RuntimeError(f"required rank {4 if memory_format == torch.channels_last else 5} "
                           f"tensor to use {memory_format} format, got size {size}")
    return tensors.contiguous_strides(size)


def preserved_strides(t: torch.Tensor) -> list[int]:
    """Strides of a copy of ``t`` in ``preserve_format`` (``.to()``, ``clone``): ``t``'s own
    when non-overlapping and dense, else dense ones in ``t``'s order of dimensions -- what
    PyTorch's ``empty_like`` computes (``infer_dense_strides``), asked of a meta tensor."""
    if tensors.is_non_overlapping_and_dense(t):
        return list(t.stride())
    meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    return list(torch.empty_like(meta).stride())


def copy_between(backend: DeviceBackend, dst: torch.Tensor, src: torch.Tensor,
                 non_blocking: bool = False,
                 overrides: dict[str, Callable[..., Any]] | None = None) -> torch.Tensor:
    """``dst.copy_(src)`` where either side is a device tensor (``overrides``: the vendor's
    kernels for :data:`OVERRIDABLE` overloads)."""
    name = backend.name
    same_device = src.device == dst.device
    if same_device and src.data_ptr() == dst.data_ptr() and src.stride() == dst.stride() \
            and src.shape == dst.shape and src.dtype == dst.dtype \
            and src.is_conj() == dst.is_conj() and src.is_neg() == dst.is_neg():
        return dst  # ATen's early exit: the same elements, nothing to copy
    if not dst.is_contiguous() and torch._debug_has_internal_overlap(dst) == 1:
        raise RuntimeError(_INTERNAL_OVERLAP)  # ATen's (TensorIterator's) check of the output
    if same_device:
        _assert_no_partial_overlap(dst, src)
    if src.shape != dst.shape:
        src = _broadcast_source(src, dst)
    if dst.numel() == 0:
        return dst
    if dst.device.type == name:
        if src.device == dst.device:
            rt = backend.runtime
            host_views = rt.host_addressable and not rt.asynchronous
            vendor = overrides.get("copy_") if overrides else None
            if vendor is not None:  # declared: it serves every same-device copy it takes
                try:
                    vendor(dst, src, non_blocking)  # the device's own strided copy
                    return dst
                except Decline:
                    pass
            if not rt.host_addressable and _plain_bytes(src, dst):
                # device-only memory, one span of bytes: the runtime copies within the
                # device, in stream order
                i = dst.device.index
                p = backend.phys(i)
                if dst.data_ptr() != src.data_ptr():  # else the same elements: nothing to do
                    _after_current_stream(backend, i)
                    rt.copy_d2d(p, dst.data_ptr(), p, src.data_ptr(),
                                dst.numel() * dst.element_size(),
                                backend.current_stream_handle(i) if rt.asynchronous else None)
                return dst
            if host_views:
                # one device, memory the host can address: ATen's copy between the two views
                values = _host_values(backend, src, _host_view(backend, src))
                _host_view(backend, dst).copy_(_as_stored_in(dst, values))
                return dst
            if rt.host_addressable and _queueable_copy(src, dst):
                _queue_copy(backend, dst, src)  # queued, as a device's copy kernel is
                return dst
        if src.device.type == name and src.device != dst.device and _plain_bytes(src, dst):
            rt = backend.runtime
            n = dst.numel() * dst.element_size()
            di, si = dst.device.index, src.device.index
            stream = backend.current_stream_handle(di) if non_blocking else None
            if stream is None:  # the runtime copies now: after both devices' queued work
                backend.host_sync(si)
                backend.host_sync(di)
                _after_current_stream(backend, si)
                _after_current_stream(backend, di)
                rt.copy_d2d(backend.phys(di), dst.data_ptr(), backend.phys(si), src.data_ptr(), n)
                return dst
            if rt.asynchronous:  # CUDA's two-way barrier between the two current streams
                _stream_waits(backend, di, stream, si, backend.current_stream_handle(si))
            rt.copy_d2d(backend.phys(di), dst.data_ptr(), backend.phys(si), src.data_ptr(), n,
                        stream)
            if rt.asynchronous:
                _stream_waits(backend, si, backend.current_stream_handle(si), di, stream)
            return dst
        if src.device.type == name:
            _after_current_stream(backend, src.device.index)
            src = _host_values(backend, src)
        elif src.device.type != "cpu":
            raise RuntimeError(f"copy_ from {src.device} to {dst.device} is not supported; "
                               f"go through the CPU: .cpu().to({str(dst.device)!r})")
        if not non_blocking:
            _after_current_stream(backend, dst.device.index)
        backend.write_tensor(dst, _as_stored_in(dst, src), non_blocking)
        return dst
    if dst.device.type != "cpu":
        raise RuntimeError(f"copy_ from {src.device} to {dst.device} is not supported; "
                           f"go through the CPU")
    _after_current_stream(backend, src.device.index)
    dst.copy_(_host_values(backend, src))
    return dst


def _queueable_copy(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """May a copy within one device of an asynchronous runtime be queued? Its errors (shapes,
    overlaps) were raised already; not with lazy conj/neg bits (resolved by reading), nor
    complex into real (the CPU warns at the call)."""
    return not (src.is_conj() or src.is_neg() or dst.is_conj() or dst.is_neg()
                or (src.is_complex() and not dst.is_complex()))


def _queue_copy(backend: DeviceBackend, dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` (tensors of one device) queued on its current stream: from C++
    where C++ queues host ops (no Python on the stream's worker), else as a copy between the
    host's views, run in inference mode, as device work knows no autograd."""
    queued = _cpp_queued_copy()
    if queued is not None and queued(dst, src):
        return
    i = dst.device.index
    hd, hs = _host_view(backend, dst), _host_view(backend, src)

    def copy() -> None:
        with torch._C._InferenceMode(True):
            hd.copy_(hs)
    backend.runtime.launch(backend.phys(i), backend.current_stream_handle(i), copy, "copy_")


@functools.cache
def _cpp_queued_copy() -> Any:
    """``native_queued_ops.cpp``'s copy (``None`` without the library)."""
    return native.python_function("torchport_queued_copy",
                                  [ctypes.py_object, ctypes.py_object], ctypes.c_int)


def _after_current_stream(backend: DeviceBackend, index: int) -> None:
    """Order a blocking copy after the work on device ``index``'s current stream, as CUDA
    does, on a runtime declared synchronous: its kernels may still put their work on the
    stream's own queue (a vendor library that enqueues), where a copy on the default queue
    would not see it. (Asynchronous runtimes: ``host_sync`` already waits for the stream.)"""
    rt = backend.runtime
    if not rt.asynchronous:
        stream = backend.current_stream_handle(index)
        if stream is not None:
            rt.synchronize_stream(backend.phys(index), stream)


def _stream_waits(backend: DeviceBackend, index: int, stream: Any, other: int, other_stream: Any) -> None:
    """Make later work on ``stream`` of device ``index`` wait for the work queued so far on
    ``other_stream`` of device ``other``. A non-blocking copy between two devices is ordered
    this way both ways, as CUDA's is: after what the source's current stream queued (its
    producer) and what the destination's did, and before what either queues next (a write
    to the source, a free of its block)."""
    rt = backend.runtime
    p = backend.phys(other)
    event = rt.create_event(p)
    rt.record_event(p, event, other_stream)
    rt.stream_wait_event(backend.phys(index), stream, event)
    rt.destroy_event(p, event)  # as CUDA allows once the wait is queued


_INTERNAL_OVERLAP = ("unsupported operation: more than one element of the written-to tensor "
                     "refers to a single memory location. Please clone() the tensor before "
                     "performing the operation.")


def _assert_no_partial_overlap(dst: torch.Tensor, src: torch.Tensor) -> None:
    """ATen's check before a copy (TensorIterator's): ``dst`` and ``src`` may share memory
    fully (one layout) or not at all. The host's views of two device tensors are separate
    CPU storages, so the CPU's own check cannot see it; it is made on the device tensors
    (``get_overlap_status``: dense layouts only, as ATen's)."""
    if dst.numel() == 0 or src.numel() == 0 \
            or dst.untyped_storage().data_ptr() != src.untyped_storage().data_ptr() \
            or not (tensors.is_non_overlapping_and_dense(dst)
                    and tensors.is_non_overlapping_and_dense(src)):
        return
    d0, s0 = dst.data_ptr(), src.data_ptr()
    d1, s1 = d0 + dst.numel() * dst.element_size(), s0 + src.numel() * src.element_size()
    if (d0, d1) == (s0, s1) and dst.stride() == src.stride():
        return  # the same elements in the same layout
    if d0 < s1 and s0 < d1:
        raise RuntimeError("unsupported operation: some elements of the input tensor and the "
                           "written-to tensor refer to a single memory location. Please clone() "
                           "the tensor before performing the operation.")


def _broadcast_source(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """``src`` expanded to ``dst``'s shape; where it does not broadcast, ATen's own error
    for the copy (TensorIterator's, asked of meta tensors), as the CPU and CUDA raise it."""
    try:
        return src.expand(dst.shape)
    except RuntimeError:
        torch.empty(dst.shape, device="meta").copy_(torch.empty(src.shape, device="meta"))
        raise


def _host_view(backend: DeviceBackend, t: torch.Tensor) -> torch.Tensor:
    """The host's view of ``t`` (host-addressable memory; cached by layout)."""
    return hostviews.for_to_cpu(backend.host_view, backend.devices).entry(t, plain=False)[0]


def _host_values(backend: DeviceBackend, t: torch.Tensor, h: torch.Tensor | None = None) -> torch.Tensor:
    """A CPU tensor with ``t``'s values (``h``: its raw memory view, when made already);
    raw memory views lose the lazy conj/neg bits, so they are put back."""
    if h is None:
        h = backend.to_host(t)
    if t.is_conj():
        h = h.conj()
    if t.is_neg():
        h = torch._neg_view(h)
    return h


def _as_stored_in(dst: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The bytes to store in ``dst`` so that reading it (with its conj/neg bits) gives
    ``values``."""
    if dst.is_conj():
        values = values.conj()
    if dst.is_neg():
        values = torch._neg_view(values)
    return values.resolve_conj().resolve_neg()


def _plain_bytes(src: torch.Tensor, dst: torch.Tensor) -> bool:
    return (src.dtype == dst.dtype and src.is_contiguous() and dst.is_contiguous()
            and src.is_conj() == dst.is_conj() and src.is_neg() == dst.is_neg())


def core_kernels(backend: DeviceBackend, overrides: dict[str, Callable[..., Any]] | None = None
                 ) -> dict[str, Callable[..., Any]]:
    """ATen overload name -> kernel, for the ops torchport implements for every backend.
    ``overrides`` (read at call time, so a kernel set added later counts): the vendor's
    kernels for :data:`OVERRIDABLE` overloads."""
    vendor: dict[str, Callable[..., Any]] = {} if overrides is None else overrides

    # A kind of allocation (size, strides or memory format, dtype, layout, device, the
    # current device) -> _new_tensor's arguments: the checks and the layout arithmetic
    # run on its first call only (its errors included)
    made: dict[tuple, tuple] = {}
    current = backend.current_device
    new_tensor = backend._new_tensor

    def kind(device: torch.device | None, dtype: torch.dtype | None) -> tuple:
        return (torch.get_default_dtype() if dtype is None else dtype, device,
                current() if device is None or device.index is None else None)

    def remember(key: tuple, t: torch.Tensor) -> torch.Tensor:
        if len(made) > 1024:
            made.clear()
        made[key] = (t.device.index, list(t.shape), list(t.stride()), t.dtype,
                     tensors.storage_nbytes(t.shape, t.stride(), t.element_size()))
        return t

    def empty_memory_format(size, dtype=None, layout=None, device=None, pin_memory=None,
                            memory_format=None):
        key = (tuple(size), memory_format, layout, *kind(device, dtype))
        spec = made.get(key)
        if spec is not None:
            return new_tensor(*spec)
        _check_layout(layout)
        return remember(key, backend.empty_strided(size, strides_for(size, memory_format),
                                                   dtype, device, given_strides=False))

    def empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
        key = (tuple(size), tuple(stride), layout, *kind(device, dtype))
        spec = made.get(key)
        if spec is not None:
            return new_tensor(*spec)
        _check_layout(layout)
        return remember(key, backend.empty_strided(size, stride, dtype, device))

    def copy_(self, src, non_blocking=False):
        if not isinstance(src, torch.Tensor):  # t.copy_(2.5): the dispatcher's wrapped number
            src = native.wrapped_number(src)
        return copy_between(backend, self, src, non_blocking, vendor)

    def _copy_from(self, dst, non_blocking=False):
        return copy_between(backend, dst, self, non_blocking, vendor)

    def _copy_from_and_resize(self, dst):
        if dst.shape != self.shape:
            backend.resize_device_tensor(dst, self.shape, tensors.contiguous_strides(self.shape))
        return copy_between(backend, dst, self, overrides=vendor)

    def resize_(self, size, memory_format=None):
        if memory_format is None and list(self.shape) == list(size):
            return self  # the CPU's rule: the same sizes keep their strides
        backend.resize_device_tensor(self, size, strides_for(size, memory_format))
        return self

    def set_storage(self, source, storage_offset=0, size=None, stride=None):
        if size is None:
            size = [source.nbytes() // self.element_size()]
        if stride is None:
            stride = tensors.contiguous_strides(size)
        _check_same_device(backend, self, source.device)
        backend.grow_storage(source, tensors.check_layout(size, stride, self.element_size(),
                                                          storage_offset, sizes_first=True))
        return _set_storage.redispatch(_CPU_KS, self, source, storage_offset, size, stride)

    def set_tensor(self, source):
        _check_same_device(backend, self, source.device)
        return _set_storage.redispatch(_CPU_KS, self, source.untyped_storage(),
                                       source.storage_offset(), source.shape, source.stride())

    def set_empty(self):
        empty = backend.empty([0], self.dtype, self.device.index)
        return _set_storage.redispatch(_CPU_KS, self, empty.untyped_storage(), 0, [0], [1])

    def to_copy(self, dtype=None, layout=None, device=None, pin_memory=None,
                non_blocking=False, memory_format=None):
        # Own kernel: PyTorch's would pin the CPU destination of a non_blocking copy, which
        # needs a pinned-memory allocator hook a Python backend cannot register.
        own = vendor.get("_to_copy")
        if own is not None:
            try:
                return own(self, dtype=dtype, layout=layout, device=device,
                           pin_memory=pin_memory, non_blocking=non_blocking,
                           memory_format=memory_format)
            except Decline:
                pass
        _check_layout(layout)
        if type(self).shape is not torch.Tensor.shape:
            # a subclass that hides its metadata from Python (a lazy module's
            # UninitializedParameter): copy the plain tensor underneath, as ATen's C++ does
            with torch._C.DisableTorchFunctionSubclass():
                self = torch._C.TensorBase.as_subclass(self, torch.Tensor)
        dtype = dtype or self.dtype
        device = torch.device(device) if device is not None else self.device
        stride = preserved_strides(self) if memory_format in (None, torch.preserve_format) \
            else strides_for(self.shape, memory_format)
        if device.type == backend.name:
            out = backend.empty_strided(self.shape, stride, dtype, device)
        else:
            out = torch.empty_strided(self.shape, stride, dtype=dtype, device=device)
        return copy_between(backend, out, self, non_blocking, vendor)

    def local_scalar_dense(self):
        # a training loop's loss.item() every step: the cached view, not a new one
        if backend.runtime.host_addressable:
            backend.host_sync(self.device.index)
            return _host_view(backend, self).item()
        return backend.to_host(self).item()

    return {
        "empty.memory_format": empty_memory_format,
        "empty_strided": empty_strided,
        "copy_": copy_,
        "_copy_from": _copy_from,
        "_copy_from_and_resize": _copy_from_and_resize,
        "resize_": resize_,
        "set_.source_Storage": set_storage,
        "set_.source_Storage_storage_offset": set_storage,
        "set_.source_Tensor": set_tensor,
        "set_": set_empty,
        "_local_scalar_dense": local_scalar_dense,
        "_to_copy": to_copy,
    }


def _check_layout(layout: Any) -> None:
    if layout is not None and layout != torch.strided:
        raise RuntimeError(f"torchport devices hold strided tensors only, got layout={layout}")


def _check_same_device(backend: DeviceBackend, t: torch.Tensor, device: torch.device) -> None:
    if device.type != backend.name or device.index != t.device.index:
        raise RuntimeError(f"set_: storage is on {device} but the tensor is on {t.device}; "
                           f"move the storage first")
