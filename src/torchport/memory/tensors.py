"""Device allocations -> real ``torch.Tensor`` objects, and bytes to and from them.

A device tensor is a plain ``torch.Tensor`` on ``<device>:<index>`` whose storage
is a block of the caching allocator; the block returns to the allocator when the
storage dies. Everything else (views, autograd, serialization) is PyTorch's own.

Moving bytes uses only the runtime's copy functions, unless the runtime declares
its memory host-addressable, in which case a zero-copy host view is built.
"""

from __future__ import annotations

import ctypes
import math
import sys
import weakref
from typing import TYPE_CHECKING, Any

import torch

from torchport.memory import qtensors

if TYPE_CHECKING:
    from torchport.core.contracts import DeviceBackend

_CPU = torch.device("cpu")
_CPU_KS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_set_storage = torch.ops.aten.set_.source_Storage_storage_offset
_view_dtype = torch.ops.aten.view.dtype
_construct_storage = torch._C._construct_storage_from_data_pointer


# ---- DLPack plumbing -------------------------------------------------------------
# PyTorch's DLPack import is the one way Python can make a tensor on any
# ``<device>:<index>`` (docs/memory.md); the capsule wraps a ``DLManagedTensor`` of our
# own that describes device memory.
class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_KDL_EXT_DEV = 12
_DL_CODES: dict[torch.dtype, tuple[int, int]] = {
    torch.bool: (6, 8), torch.uint8: (1, 8), torch.int8: (0, 8), torch.int16: (0, 16),
    torch.int32: (0, 32), torch.int64: (0, 64), torch.float16: (2, 16),
    torch.float32: (2, 32), torch.float64: (2, 64), torch.bfloat16: (4, 16),
    torch.complex64: (5, 64), torch.complex128: (5, 128), torch.uint16: (1, 16),
    torch.uint32: (1, 32), torch.uint64: (1, 64),
}


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype = ctypes.py_object
_new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_import_dlpack = torch._C._from_dlpack
DL_NAME = b"dltensor"
_DATA_OFFSET = _DLManagedTensor.dl_tensor.offset + _DLTensor.data.offset


# ---- one DLPack header per layout ----------------------------------------------------
# Importing a ready header whose data pointer was just rewritten is the cheapest way
# Python has to make a device tensor (an alias plus ``set_`` costs several times more):
# PyTorch's import is a single C++ call building TensorImpl and storage. A header is
# (its address, its data field, the storage bytes of its layout). PyTorch keeps the
# header's address and reads its ``deleter`` field when the storage dies, so headers
# are never freed (their deleter stays null: blocks come back through the storage's
# weakref, below); at most ``_MAX_HEADERS`` of them, later layouts take the slow way.
_HEADERS: dict[tuple, tuple | None] = {}
_KEEP: list = []  # the headers' memory, for the life of the process
_MAX_HEADERS = 1 << 16
Header = tuple  # (address, data field as ctypes.c_void_p, storage bytes)


def layout_header(index: int, dtype: torch.dtype, size, stride) -> Header | None:
    """The header of a (device index, dtype, size, stride) layout, or ``None`` where
    DLPack cannot make it (a dtype it lacks, no bytes, PyTorch changing the layout)."""
    key = (index, dtype, tuple(size), tuple(stride))
    h = _HEADERS.get(key, False)
    if h is False:
        if len(_HEADERS) >= _MAX_HEADERS:
            return None
        h = _HEADERS[key] = _make_header(*key)
    return h


def header_count() -> int:
    """How many layouts have a header (or were found to need the slow way)."""
    return len(_HEADERS)


def set_max_headers(n: int) -> int:
    """Bound the layout headers kept (they live as long as the process); returns the
    previous bound. A layout met past it takes the slow way, one storage built per
    tensor: for tools and tests that exercise that way, or limit the memory kept."""
    global _MAX_HEADERS
    old, _MAX_HEADERS = _MAX_HEADERS, int(n)
    return old


def _new_header(index: int, dtype: torch.dtype, size, stride, nbytes: int) -> Header:
    """A DLPack header (deleter null) describing a layout on device ``index``, its memory
    kept for the life of the process."""
    m = _DLManagedTensor()
    ndim = len(size)
    shape = (ctypes.c_int64 * max(ndim, 1))(*size)
    strides = (ctypes.c_int64 * max(ndim, 1))(*stride)
    dl = m.dl_tensor
    dl.device = _DLDevice(_KDL_EXT_DEV, index)
    dl.ndim = ndim
    dl.dtype = _DLDataType(*_DL_CODES[dtype], 1)
    dl.shape = shape
    dl.strides = strides
    _KEEP.append((m, shape, strides))
    address = ctypes.addressof(m)
    return (address, ctypes.c_void_p.from_address(address + _DATA_OFFSET), nbytes)


def _make_header(index: int, dtype: torch.dtype, size: tuple, stride: tuple) -> Header | None:
    nbytes = storage_nbytes(size, stride, dtype.itemsize)
    if dtype not in _DL_CODES or nbytes == 0:
        return None
    header = _new_header(index, dtype, size, stride, nbytes)
    try:  # a trial import at a fake address, never read: is the layout kept as asked?
        t = import_header(header, 1 << 12)
    except Exception:
        return None
    if t is None or tuple(t.shape) != size or t.stride() != stride or t.dtype != dtype \
            or t.device.index != index or t.untyped_storage().nbytes() != nbytes:
        return None
    return header


def _from_dlpack(ptr: int, device_index: int, dtype: torch.dtype, size, stride) -> torch.Tensor:
    """A device tensor over ``ptr`` made by PyTorch's DLPack import (owns nothing)."""
    return import_header(_new_header(device_index, dtype, size, stride, 0), ptr)


def import_header(header: Header, ptr: int) -> torch.Tensor | None:
    """A device tensor over ``ptr`` (owning nothing) in ``header``'s layout; ``None``
    if another thread rewrote the header in between (then take the slow way)."""
    header[1].value = ptr
    t = _import_dlpack(_new_capsule(header[0], DL_NAME, None))
    return t if t.data_ptr() == ptr else None


# ---- device tensors over allocator blocks ------------------------------------------
# With the C++ allocator, :func:`new_device_tensor` makes a tensor in one call, its
# storage's DataPtr returning the block (no Python object needed for the storage's life,
# so the autograd engine sees the true reference counts). Blocks handed to Python
# (``malloc``, ``adopt``) and every block of the Python allocator take the path below.
# A new device tensor comes from its layout's DLPack header (above); where there is
# none, from a storage built over the block (``_construct_storage_from_data_pointer``,
# no copy, no deleter) given to a fresh TensorImpl (an alias of a per-(device, dtype)
# template) with ``set_``. Either way the storage's Python object is watched: PyTorch
# keeps it alive exactly as long as some tensor or view uses the storage, so its
# weakref callback (which CPython runs with any in-flight exception saved) is where
# the block goes back to the allocator. The weakref itself says which block (a
# :class:`_BlockRef`), and the block keeps its weakref alive: nothing else to look up
# on the hot path of every op.
_alias_boxed = torch.ops.aten.alias.default._handle.redispatch_boxed
_set_storage_boxed = _set_storage._handle.redispatch_boxed
_TEMPLATES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


class _BlockRef(weakref.ref):
    """A weak reference to a device storage whose death frees block ``ptr`` (the
    callback is the allocator's ``storage_died``; ``ptr=None``: it no longer owns one)."""

    __slots__ = ("allocator", "ptr")


def watch(storage: torch.UntypedStorage, allocator, block) -> None:
    """Return ``block`` to ``allocator`` when ``storage`` dies."""
    ref = _BlockRef(storage, allocator.storage_died)
    ref.allocator = allocator
    ref.ptr = block.ptr
    block.owner = ref


def _template(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    t = _TEMPLATES.get((device, dtype))
    if t is None:
        if dtype in _DL_CODES:
            t = _from_dlpack(0, device.index, dtype, [0], [1])
        else:  # dtypes DLPack cannot describe: reinterpret an empty byte tensor
            t = _view_dtype.redispatch(_CPU_KS, _from_dlpack(0, device.index, torch.uint8,
                                                             [0], [1]), dtype)
        _TEMPLATES[(device, dtype)] = t
    return t


def _block_of(st: torch.UntypedStorage) -> tuple | None:
    """(allocator, block) a storage returns when it dies, detached from it, or ``None``."""
    for ref in weakref.getweakrefs(st):
        if isinstance(ref, _BlockRef) and ref.ptr is not None:
            ptr, ref.ptr = ref.ptr, None
            return ref.allocator, ref.allocator.active[ptr]
    return None


def swap_storage_blocks(a: torch.UntypedStorage, b: torch.UntypedStorage) -> None:
    """Exchange the memory of two device storages, the return of each block included
    (``_swap_data_ptr_`` moves pointer and size; the blocks' owners move here)."""
    owned_a, owned_b = _block_of(a), _block_of(b)
    a._swap_data_ptr_(b)
    for st, owned in ((a, owned_b), (b, owned_a)):
        if owned is not None:
            watch(st, *owned)


_LOOK_UP = object()


def wrap_block(device: torch.device, allocator, block, nbytes: int, dtype: torch.dtype,
               size, stride, header: Header | None | object = _LOOK_UP) -> torch.Tensor:
    """A device tensor over ``nbytes`` of ``block``, returned to ``allocator`` when its
    storage dies (``block=None``: a zero-byte tensor, no memory). ``header``: the
    layout's :func:`layout_header`, where the caller keeps it already."""
    if block is None:
        storage = _construct_storage(0, device, 0)
    else:
        h = layout_header(device.index, dtype, size, stride) if header is _LOOK_UP else header
        if h is not None and h[2] == nbytes:
            t = import_header(h, block.ptr)
            if t is not None:
                watch(t.untyped_storage(), allocator, block)
                return t
        storage = _construct_storage(block.ptr, device, nbytes)
        watch(storage, allocator, block)
    shell = _alias_boxed(_CPU_KS, _template(device, dtype))
    return _set_storage_boxed(_CPU_KS, shell, storage, 0, size, stride)


def new_device_tensor(device: torch.device, alloc, nbytes: int, dtype: torch.dtype, size,
                      stride, stream: Any = None,
                      header: Header | None | object = _LOOK_UP) -> torch.Tensor:
    """A new device tensor of ``nbytes`` (its storage's bytes) from ``alloc`` on ``stream``
    (a runtime stream handle, ``None``: the default stream): the one way the layers above
    make device tensors. With the C++ allocator one call, whose storage returns the block
    from its deleter; else :func:`wrap_block` over a block of the Python allocator
    (``header`` as :func:`wrap_block` takes it)."""
    new = getattr(alloc, "new_tensor", None)
    if new is not None and not sys.is_finalizing():  # (PyTorch cannot adopt its result then)
        return new(nbytes, dtype, size, stride, stream)
    block = alloc.malloc(nbytes, stream) if nbytes else None
    return wrap_block(device, alloc, block, nbytes, dtype, size, stride, header)


_INT64_MAX = 2**63 - 1


def check_layout(size, stride, itemsize: int = 1, offset: int = 0, *,
                 sizes_first: bool = False, given_strides: bool = True) -> int:
    """The bytes a new layout needs, after the CPU's checks and with its errors, before
    any memory is taken: Python's integers do not overflow, so a layout past int64 would
    reach C++ (or DLPack's import, which aborts the process) as a number it cannot take.

    PyTorch checks the storage size before the strides when it makes a tensor
    (``empty_generic``), and the element count and strides first when it resizes one
    (``resize_``, ``set_``: ``sizes_first``); its storage error names the strides where
    the caller gave them (``given_strides``)."""
    if any(d < 0 for d in size):
        neg = next(d for d in size if d < 0)
        raise RuntimeError(f"Trying to create tensor with negative dimension {neg}: {size}")
    if len(stride) != len(size):
        raise RuntimeError(f"dimensionality of sizes ({len(size)}) must match dimensionality "
                           f"of strides ({len(stride)})")
    if sizes_first:
        _check_sizes(size, stride)
    nbytes = 0
    if 0 not in size:
        if any(st < 0 and d > 1 for d, st in zip(size, stride, strict=True)) \
                or (nbytes := storage_nbytes(size, stride, itemsize, offset)) > _INT64_MAX:
            strides = f" and strides={list(stride)}" if given_strides else ""
            raise RuntimeError(f"Storage size calculation overflowed with sizes={list(size)}"
                               f"{strides}")
    if not sizes_first:
        _check_sizes(size, stride)
    return nbytes


def _check_sizes(size, stride) -> None:
    numel = 1
    for d in size:
        numel *= d
    if numel > _INT64_MAX:
        raise RuntimeError("numel: integer multiplication overflow")
    if any(st > _INT64_MAX for st in stride):
        raise RuntimeError("Stride calculation overflowed")


def storage_nbytes(size, stride, itemsize: int, offset: int = 0) -> int:
    """Bytes a (size, stride, storage_offset) layout needs, as ``computeStorageNbytes``."""
    if any(s == 0 for s in size):
        return 0
    extent = 1 + offset + sum((s - 1) * st for s, st in zip(size, stride, strict=True))
    return extent * itemsize


def contiguous_strides(size) -> list[int]:
    strides, acc = [], 1
    for s in reversed(list(size)):
        strides.append(acc)
        acc *= max(s, 1)
    return strides[::-1]


def storage_ptr(t: torch.Tensor) -> int:
    """The address ``t``'s storage starts at (0 for a tensor without elements, which
    PyTorch gives no address), without a call into the storage's Python object."""
    return t.data_ptr() - t.storage_offset() * t.element_size() if t.numel() else 0


# ---- host views and staging ------------------------------------------------------
def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """(first byte, byte count) of the storage range a tensor can touch."""
    n = storage_nbytes(t.shape, t.stride(), t.element_size())
    start = t.storage_offset() * t.element_size()
    if t.dtype in qtensors.SUB_BYTE:  # packed values: the storage holds fewer bytes
        n = min(n, t.untyped_storage().nbytes() - start)
    return start, n


def host_storage(address: int, nbytes: int) -> torch.UntypedStorage:
    """A CPU storage over the ``nbytes`` of host memory at ``address`` (no copy, no
    deleter, not resizable): the caller keeps the memory alive."""
    return _construct_storage(address, _CPU, nbytes)


def host_view(backend: DeviceBackend, t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor aliasing device tensor ``t`` (host-addressable runtimes only)."""
    ptr = storage_ptr(t)
    if ptr == 0:  # no elements
        if t.is_quantized:
            return qtensors.over_storage(t, torch.UntypedStorage(0), 0, t.shape, t.stride())
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
    nbytes = sum(byte_span(t))
    cpu_storage = host_storage(backend.runtime.host_address(ptr), nbytes)
    if t.is_quantized:  # the same integers, read with the same quantization parameters
        return qtensors.over_storage(t, cpu_storage, t.storage_offset(), t.shape, t.stride())
    return torch.empty(0, dtype=t.dtype).set_(cpu_storage, t.storage_offset(), t.shape, t.stride())


def read_bytes(backend: DeviceBackend, index: int, ptr: int, n: int, stream=None) -> torch.Tensor:
    """A CPU ``uint8`` copy of the ``n`` device bytes at ``ptr`` on device ``index`` (at
    least one byte long), via the runtime."""
    buf = torch.empty(max(n, 1), dtype=torch.uint8)
    if n:
        backend.runtime.copy_d2h(backend.phys(index), buf.data_ptr(), ptr, n, stream)
    return buf


def read_to_host(backend: DeviceBackend, t: torch.Tensor, stream=None) -> torch.Tensor:
    """A CPU copy of device tensor ``t`` (same shape and strides), via the runtime."""
    start, n = byte_span(t)
    buf = read_bytes(backend, t.device.index, storage_ptr(t) + start, n, stream)
    if t.dtype.itemsize > 1 and n % t.dtype.itemsize:
        raise RuntimeError(f"misaligned storage span of {n} bytes for {t.dtype}")
    if t.is_quantized:
        return qtensors.over_storage(t, buf.untyped_storage(), 0, t.shape, t.stride())
    typed = buf[:n].view(t.dtype) if n else torch.empty(0, dtype=t.dtype)
    return typed.as_strided(t.shape, t.stride(), 0) if n else torch.empty_strided(
        t.shape, t.stride(), dtype=t.dtype)


def write_from_host(backend: DeviceBackend, dst: torch.Tensor, src: torch.Tensor, stream=None) -> None:
    """Write CPU tensor ``src`` (same shape; any dtype, strides) into device tensor ``dst``."""
    if dst.numel() == 0:
        return
    rt, idx = backend.runtime, backend.phys(dst.device.index)
    start, n = byte_span(dst)
    dptr = storage_ptr(dst) + start
    if is_dense_row_major(dst):
        staged = src.to(dst.dtype).contiguous()
        if staged.data_ptr() == src.data_ptr() and stream is not None:
            staged = staged.clone()  # the caller may reuse src before the copy runs
        rt.copy_h2d(idx, dptr, staged.data_ptr(), n, stream)
        if stream is not None:
            backend.keep_alive_until_stream(idx, stream, staged)
        return
    # Read-modify-write of the storage span keeps the bytes between strided elements.
    span = read_to_host(backend, dst)
    span.copy_(src)
    store_span(backend, dst, span)


def store_span(backend: DeviceBackend, dst: torch.Tensor, span: torch.Tensor) -> None:
    """Write back a :func:`read_to_host` copy of ``dst`` (changed on the host): the bytes
    of its whole storage span, those between strided elements included."""
    start, n = byte_span(dst)
    if n:
        backend.runtime.copy_h2d(backend.phys(dst.device.index), storage_ptr(dst) + start,
                                 span.untyped_storage().data_ptr(), n, None)


def is_dense_row_major(t: torch.Tensor) -> bool:
    """Contiguous, and its bytes are exactly its storage span's."""
    return t.is_contiguous() and (t.numel() * t.element_size()) == byte_span(t)[1]


def is_non_overlapping_and_dense(t: torch.Tensor) -> bool:
    if t.numel() <= 1:
        return True
    dims = sorted((st, s) for s, st in zip(t.shape, t.stride(), strict=True) if s != 1)
    expected = 1
    for st, s in dims:
        if st != expected:
            return False
        expected *= s
    return True


def numel(size) -> int:
    return math.prod(size)
