"""The glue, through ctypes, to the caching allocator of torchport's C++ library.

With the library the pools live in C++ (``native_caching_allocator.cpp``, the rules of
:mod:`torchport.memory.blocks`): a storage made there returns its block from its DataPtr's
deleter, and Python is entered only for a segment, an out-of-memory message, a device
synchronize and the events of stream-aware freeing. :class:`NativeAllocator` gives it
:class:`~torchport.memory.allocator.DeviceAllocator`'s interface; :func:`_native_allocators`
declares the library's functions and hands it the runtime's callbacks. Kept apart from the
Python allocator, which serves without the library:
:func:`torchport.memory.allocator.make_allocators` is the one switch between them.
"""

from __future__ import annotations

import atexit
import ctypes
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from torchport.core import interrupts
from torchport.memory.allocator_stats import _POOLS, AllocatorStatistics, _Stat
from torchport.memory.blocks import K_SMALL_SIZE, SEGMENT_FREED
from torchport.runtime import Runtime

_NAMES = ("allocation", "segment", "active", "inactive_split", "allocated_bytes",
          "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes")
_COUNTER_NAMES = ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc",
                  "num_device_free")
_METRICS = ("current", "peak", "allocated", "freed")
_N_STATS = len(_NAMES) * len(_POOLS) * len(_METRICS) + len(_COUNTER_NAMES)
# memory_stats() order (that of the Python allocator): sorted by (name, pool)
_STATS_ORDER = [(f"{n}.{p}.{m}", (_NAMES.index(n) * 3 + _POOLS.index(p)) * 4 + k)
                for n, p in sorted((n, p) for n in _NAMES for p in _POOLS)
                for k, m in enumerate(_METRICS)]
_OOM_KIND = 1


class NativeBlock:
    """A block of the C++ allocator handed to Python (:meth:`NativeAllocator.malloc`):
    its address, and ``owner`` as :class:`Block`'s (the weak reference that frees it, kept
    by the allocator while the block is allocated: a weakref's callback runs only if the
    weakref is alive)."""

    __slots__ = ("_owners", "ptr")

    def __init__(self, ptr: int, owners: dict[int, Any]) -> None:
        self.ptr = ptr
        self._owners = owners

    @property
    def owner(self) -> Any:
        return self._owners.get(self.ptr)

    @owner.setter
    def owner(self, ref: Any) -> None:
        self._owners[self.ptr] = ref


class BlockInfo(NativeBlock):
    """What the C++ allocator holds of an allocated block (read when asked)."""

    __slots__ = ("__weakref__", "_alloc", "adopted", "allocated", "requested", "size", "small",
                 "stream")

    def __init__(self, ptr: int, alloc: NativeAllocator, size: int, requested: int,
                 stream: Any, adopted: bool) -> None:
        super().__init__(ptr, alloc.owners)
        self._alloc = alloc
        self.size = size
        self.requested = requested
        self.stream = stream
        self.adopted = adopted
        self.allocated = True
        self.small = size <= K_SMALL_SIZE

    @property
    def stream_uses(self) -> set:
        """The streams ``record_stream`` named for the block (now)."""
        return self._alloc._stream_uses(self.ptr)


@dataclass(frozen=True)
class SegmentInfo:
    segment_size: int
    small: bool


class _ActiveBlocks:
    """The allocated blocks of a :class:`NativeAllocator` by address (a read-only mapping)."""

    def __init__(self, alloc: NativeAllocator) -> None:
        self._a = alloc

    def get(self, ptr: int, default: Any = None) -> Any:
        info = self._a._block(ptr)
        return default if info is None else info

    def __getitem__(self, ptr: int) -> BlockInfo:
        info = self._a._block(ptr)
        if info is None:
            raise KeyError(ptr)
        return info

    def __contains__(self, ptr: object) -> bool:
        return isinstance(ptr, int) and self._a._block(ptr) is not None

    def __iter__(self):
        return iter(self._a._list(0))

    def __len__(self) -> int:
        return self._a._counts()[2]

    def values(self) -> list[BlockInfo]:
        return [b for b in (self._a._block(p) for p in self._a._list(0)) if b is not None]


class NativeAllocator:
    """The caching allocator of one device, in the C++ library: :class:`DeviceAllocator`'s
    interface and behaviour, without a Python round trip per allocation and free."""

    def __init__(self, cpp: Any, runtime: Runtime, phys: int, logical: int,
                 device_name: str, max_parked: Callable[[], int]) -> None:
        self.cpp = cpp
        self.runtime = runtime
        self.phys = phys
        self.logical = logical
        self.device_name = device_name
        self.lock = threading.RLock()  # (callers' own; the pools are locked in C++)
        self._fraction: float | None = None
        # the cap on parked blocks, the Python allocator's (read at each configure)
        self._max_parked = max_parked
        # set by torchport.device.streams: the guard stream id of a runtime stream handle, and back
        self.stream_id_of: Callable[[Any], int] = lambda handle: 0
        self.stream_of: Callable[[int, int], Any] = lambda index, sid: None
        self.free_events = self.event_query = self.event_release = None  # (C++ records them)
        self.active = _ActiveBlocks(self)
        # the weak references of the storages over blocks made in Python (tensors.watch)
        owners: dict[int, Any] = {}
        self._infos: weakref.WeakValueDictionary[int, BlockInfo] = weakref.WeakValueDictionary()
        self.owners = owners
        i = logical
        # (through PyDLL, keeping the GIL: a call that released and took it back would cost
        # more than the allocation)
        hot = _py_library(cpp) or cpp
        c_malloc, c_free = hot.torchport_caching_malloc, hot.torchport_caching_free
        c_new = getattr(_py_library(cpp), "torchport_caching_new_tensor", None)

        def malloc(nbytes: int, stream: Any = None) -> NativeBlock:
            """A block of at least ``nbytes``; raises ``torch.OutOfMemoryError``."""
            ptr = c_malloc(i, nbytes, 0 if stream is None else self.stream_id_of(stream))
            if not ptr:
                raise self._error()
            return NativeBlock(ptr, owners)

        def free(ptr: int) -> None:
            if not c_free(i, ptr):
                raise self._error()

        def storage_died(ref: Any) -> None:
            """Weakref callback of a storage made over a :class:`NativeBlock`."""
            ptr = ref.ptr
            if ptr is None:
                return
            if owners.get(ptr) is ref:
                del owners[ptr]
            if not c_free(i, ptr):
                raise self._error()

        self.malloc = malloc
        self.free = free
        self.storage_died = storage_died
        self.new_tensor: Callable[..., torch.Tensor] | None = None
        # (buffer, dtype, size, stride, stream) -> an adopted device tensor, or None
        self.adopted_tensor: Callable[..., torch.Tensor | None] | None = \
            None if c_new is None else self._adopted_tensor
        if c_new is not None:
            def new_tensor(nbytes: int, dtype: torch.dtype, size: Any, stride: Any,
                           stream: Any = None) -> torch.Tensor:
                """A device tensor over a new block, freed by its storage's deleter."""
                t = c_new(i, nbytes, dtype, size, stride,
                          0 if stream is None else self.stream_id_of(stream))
                if t is None:
                    raise self._error()
                return t

            self.new_tensor = new_tensor

    def release(self, ptr: int) -> None:
        """The block at ``ptr``, held by a storage made in Python (:func:`tensors.watch`),
        leaves that storage (a resize gave it a new block): freed now, not when it dies."""
        ref = self.owners.pop(ptr, None)
        if ref is not None and ref.ptr == ptr:
            ref.ptr = None
            self.free(ptr)

    def _error(self) -> BaseException:
        msg = self.cpp.torchport_caching_error().decode("utf-8", "replace")
        if self.cpp.torchport_caching_error_kind() == _OOM_KIND:
            return torch.OutOfMemoryError(msg)
        return RuntimeError(msg)

    def _check(self, ok: int) -> None:
        if not ok:
            raise self._error()

    def _configure(self) -> None:
        limit = -1.0
        if self._fraction is not None:
            limit = self._fraction * self.runtime.get_device_properties(self.phys).total_memory
        self._check(self.cpp.torchport_caching_configure(self.logical, limit, self._max_parked()))

    @property
    def fraction(self) -> float | None:
        return self._fraction

    @fraction.setter
    def fraction(self, value: float | None) -> None:
        self._fraction = value
        self._configure()

    def _within_fraction(self, nbytes: int) -> bool:
        if self._fraction is None:
            return True
        total = self.runtime.get_device_properties(self.phys).total_memory
        return self.reserved() + nbytes <= self._fraction * total

    # ---- statistics ------------------------------------------------------------
    def _stats(self, refresh: bool) -> Any:
        out = (ctypes.c_int64 * _N_STATS)()
        self._check(self.cpp.torchport_caching_stats(self.logical, out, int(refresh)))
        return out

    def stat(self, name: str, pool: str = "all") -> _Stat:
        """One statistic (``torch.cuda.memory_stats`` naming), up to date."""
        v = self._stats(False)
        k = (_NAMES.index(name) * 3 + _POOLS.index(pool)) * 4
        s = _Stat()
        s.current, s.peak, s.allocated, s.freed = v[k:k + 4]
        return s

    def memory_stats(self) -> dict[str, int]:
        v = self._stats(True)
        out = {key: v[k] for key, k in _STATS_ORDER}
        base = _N_STATS - len(_COUNTER_NAMES)
        for j, name in enumerate(_COUNTER_NAMES):
            out[name] = v[base + j]
        out["max_split_size"] = -1
        out["oversize_allocations.current"] = 0
        out["oversize_segments.current"] = 0
        return out

    def _counter(self, name: str) -> int:
        return self._stats(False)[_N_STATS - len(_COUNTER_NAMES) + _COUNTER_NAMES.index(name)]

    num_alloc_retries = property(lambda self: self._counter("num_alloc_retries"))
    num_ooms = property(lambda self: self._counter("num_ooms"))
    num_sync_all_streams = property(lambda self: self._counter("num_sync_all_streams"))
    num_device_alloc = property(lambda self: self._counter("num_device_alloc"))
    num_device_free = property(lambda self: self._counter("num_device_free"))

    def allocated(self) -> int:
        return self.stat("allocated_bytes").current

    def reserved(self) -> int:
        return self.stat("reserved_bytes").current

    def reset_peak(self) -> None:
        self._check(self.cpp.torchport_caching_reset_peak(self.logical))

    def reset_accumulated(self) -> None:
        self._check(self.cpp.torchport_caching_reset_accumulated(self.logical))

    # ---- state, for introspection and tests ----------------------------------------
    def _counts(self) -> list[int]:
        out = (ctypes.c_int64 * 7)()
        self._check(self.cpp.torchport_caching_counts(self.logical, out))
        return list(out)

    def _list(self, what: int) -> list[int]:
        cap = 256
        while True:
            out = (ctypes.c_int64 * cap)()
            n = self.cpp.torchport_caching_list(self.logical, what, out, cap)
            if n < 0:
                raise self._error()
            if n <= cap:
                return list(out[:n])
            cap = n + 64  # grew in between: ask again

    def _read_block(self, ptr: int) -> list[int]:
        cap = 64
        while True:
            out = (ctypes.c_int64 * cap)()
            n = self.cpp.torchport_caching_block(self.logical, ptr, out, cap)
            if n <= cap:
                return list(out[:n])
            cap = n + 16

    def _block(self, ptr: int) -> BlockInfo | None:
        v = self._read_block(ptr)
        if not v:
            return None
        size, requested, sid, adopted = v[:4]
        handle = getattr(self.stream_of(self.logical, sid), "handle", None)
        info = self._infos.get(ptr)  # the same object while a caller holds it, as Block's
        if info is None:
            info = self._infos[ptr] = BlockInfo(ptr, self, size, requested, handle,
                                                bool(adopted))
        else:
            info.size, info.requested, info.stream, info.adopted = size, requested, handle, \
                bool(adopted)
            info.small = size <= K_SMALL_SIZE
        return info

    def _stream_uses(self, ptr: int) -> set:
        v = self._read_block(ptr)
        return {self.stream_of(v[5 + 2 * k], v[6 + 2 * k]) for k in range(v[4] if v else 0)}

    def record_use(self, ptr: int, stream_device: int, stream_id: int) -> bool:
        """``Tensor.record_stream``: the block at ``ptr`` waits, when freed, for the work
        queued so far on that stream; ``False`` where no block of this allocator is there."""
        return bool(self.cpp.torchport_caching_record_use(self.logical, ptr, stream_device,
                                                          stream_id))

    @property
    def num_parked(self) -> int:
        return self._counts()[0]

    @property
    def slow_mallocs(self) -> int:
        """Requests since the start that no parked block of their exact size served (the
        Python allocator's calls of ``_malloc``)."""
        return self._counts()[6]

    @property
    def full(self) -> bool:
        return bool(self._counts()[1])

    @property
    def parked(self) -> dict[tuple[int, int], list[int]]:
        """Parked blocks by (id of the stream's runtime handle, size): their sizes."""
        v = self._list(3)
        out: dict[tuple[int, int], list[int]] = {}
        for k in range(0, len(v), 3):
            handle = getattr(self.stream_of(self.logical, v[k]), "handle", None)
            out[(id(handle), v[k + 1])] = [v[k + 1]] * v[k + 2]
        return out

    @property
    def segments(self) -> dict[int, SegmentInfo]:
        v = self._list(2)
        return {v[k]: SegmentInfo(v[k + 1], bool(v[k + 2])) for k in range(0, len(v), 3)}

    def pending_blocks(self) -> list[NativeBlock]:
        """The freed blocks waiting for queued work (oldest first per stream)."""
        return [NativeBlock(p, self.owners) for p in self._list(1)]

    # ---- allocation paths that are not hot ------------------------------------------
    def _adopted_by_runtime(self, buffer: torch.UntypedStorage, stream: Any) -> tuple | None:
        """(address, bytes, stream id) of ``buffer`` once the runtime adopted it, or ``None``
        where it declines or the memory fraction forbids it."""
        nbytes = buffer.nbytes()
        if not self._within_fraction(nbytes):
            return None
        ptr = self.runtime.adopt_host(self.phys, buffer)
        if ptr is None:
            return None
        return ptr, nbytes, 0 if stream is None else self.stream_id_of(stream)

    def adopt_segment(self, ptr: int, nbytes: int, stream: Any = None) -> NativeBlock:
        """As :meth:`DeviceAllocator.adopt_segment`."""
        self._check(self.cpp.torchport_caching_adopt(
            self.logical, ptr, nbytes, 0 if stream is None else self.stream_id_of(stream)))
        return NativeBlock(ptr, self.owners)

    def adopt(self, buffer: torch.UntypedStorage, stream: Any = None) -> NativeBlock | None:
        """As :meth:`DeviceAllocator.adopt`."""
        adopted = self._adopted_by_runtime(buffer, stream)
        if adopted is None:
            return None
        self._check(self.cpp.torchport_caching_adopt(self.logical, *adopted))
        return NativeBlock(adopted[0], self.owners)

    def _adopted_tensor(self, buffer: torch.UntypedStorage, dtype: torch.dtype, size: Any,
                        stride: Any, stream: Any = None) -> torch.Tensor | None:
        """A device tensor over ``buffer`` adopted by the runtime (as :meth:`adopt`), whose
        storage's C++ deleter returns it, or ``None`` where the runtime declines."""
        adopted = self._adopted_by_runtime(buffer, stream)
        if adopted is None:
            return None
        ptr, nbytes, sid = adopted
        t = _py_library(self.cpp).torchport_caching_adopted_tensor(
            self.logical, ptr, nbytes, dtype, list(size), list(stride), sid)
        if t is None:
            self.runtime.free(self.phys, ptr)
            raise self._error()
        return t

    def empty_cache(self) -> None:
        """Return every fully free segment to the runtime (``torch.<device>.empty_cache``)."""
        if self.runtime.asynchronous:
            self.runtime.synchronize(self.phys)  # queued kernels may still use cached blocks
        self._configure()  # (the parking cap, where a test changed it)
        self._check(self.cpp.torchport_caching_empty_cache(self.logical))

    _oom_message = AllocatorStatistics._oom_message

    def snapshot(self) -> list[dict[str, Any]]:
        """Segments and their blocks, in the shape of ``torch.cuda.memory_snapshot()``."""
        v = self._list(4)
        out, k = [], 0
        while k < len(v):
            ptr, seg_size, small, n = v[k:k + 4]
            k += 4
            blocks = []
            for _ in range(n):
                bptr, size, allocated, requested = v[k:k + 4]
                k += 4
                blocks.append({"address": bptr, "size": size,
                               "state": "active_allocated" if allocated else "inactive",
                               "requested_size": requested})
            out.append({"device": self.logical, "address": ptr, "total_size": seg_size,
                        "allocated_size": sum(x["size"] for x in blocks
                                              if x["state"] == "active_allocated"),
                        "segment_type": "small" if small else "large", "blocks": blocks})
        return out


_PY: list[Any] = []


def _py_library(cpp: Any) -> Any:
    """The library's functions that take Python objects (holding the GIL), or ``None``
    where it was built without Python's headers."""
    if not hasattr(cpp, "torchport_caching_new_tensor"):
        return None
    if _PY:
        return _PY[0]
    py = ctypes.PyDLL(cpp._name)
    _PY.append(py)
    py.torchport_caching_malloc.argtypes = [ctypes.c_int, ctypes.c_uint64, ctypes.c_longlong]
    py.torchport_caching_malloc.restype = ctypes.c_uint64
    py.torchport_caching_free.argtypes = [ctypes.c_int, ctypes.c_uint64]
    py.torchport_caching_free.restype = ctypes.c_int
    f = py.torchport_caching_new_tensor
    f.argtypes = [ctypes.c_int, ctypes.c_uint64, ctypes.py_object, ctypes.py_object,
                  ctypes.py_object, ctypes.c_longlong]
    f.restype = ctypes.py_object
    f = py.torchport_caching_adopted_tensor
    f.argtypes = [ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.py_object,
                  ctypes.py_object, ctypes.py_object, ctypes.c_longlong]
    f.restype = ctypes.py_object
    return py


_SEG_MALLOC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_uint64,
                               ctypes.POINTER(ctypes.c_uint64))
_SEG_FREE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64)
_ON_DEVICE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)
_OOM = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_uint64)
_RELEASE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_uint64)
_INTERPRETER = ("PyGILState_Check", "PyEval_SaveThread", "PyEval_RestoreThread",
                "PyGILState_Ensure", "PyGILState_Release", "PyErr_Fetch", "PyErr_Restore")
_KEEP: list[Any] = []  # the callbacks C++ holds, for the life of the process


def _declare(cpp: Any) -> None:
    u64, i64, c_int = ctypes.c_uint64, ctypes.c_longlong, ctypes.c_int
    p64 = ctypes.POINTER(ctypes.c_int64)
    for name, res, args in (
            ("torchport_caching_enable", c_int, [ctypes.POINTER(ctypes.c_void_p), c_int, c_int,
                                                 c_int]),
            ("torchport_caching_detach", None, []),
            ("torchport_caching_at_exit", None, []),
            ("torchport_caching_error", ctypes.c_char_p, []),
            ("torchport_caching_error_kind", c_int, []),
            ("torchport_caching_malloc", u64, [c_int, u64, i64]),
            ("torchport_caching_free", c_int, [c_int, u64]),
            ("torchport_caching_adopt", c_int, [c_int, u64, u64, i64]),
            ("torchport_caching_stats", c_int, [c_int, p64, c_int]),
            ("torchport_caching_reset_peak", c_int, [c_int]),
            ("torchport_caching_reset_accumulated", c_int, [c_int]),
            ("torchport_caching_empty_cache", c_int, [c_int]),
            ("torchport_caching_configure", c_int, [c_int, ctypes.c_double, i64]),
            ("torchport_caching_counts", c_int, [c_int, p64]),
            ("torchport_caching_list", i64, [c_int, c_int, p64, i64]),
            ("torchport_caching_block", i64, [c_int, u64, p64, i64]),
            ("torchport_caching_record_use", c_int, [c_int, u64, c_int, i64]),
            ("torchport_allocator_fail", None, [c_int, ctypes.c_char_p])):
        f = getattr(cpp, name)
        f.restype = res
        f.argtypes = args


def _callback(cpp: Any, fn: Callable[..., None]) -> Callable[..., int]:
    """``fn`` as a C callback: 1 when it returned, 0 after handing its exception to C++
    (which raises it as the matching c10::Error)."""
    def call(*args: Any) -> int:
        try:
            interrupts.to_completion(fn, *args)  # (Ctrl-C: raised once back in C++)
            return 1
        except BaseException as e:  # noqa: BLE001 (every exception must reach C++)
            interrupts.redeliver(e)
            kind = _OOM_KIND if isinstance(e, torch.OutOfMemoryError) else 0
            msg = str(e) if kind or type(e) is RuntimeError else f"{type(e).__name__}: {e}"
            cpp.torchport_allocator_fail(kind, msg.encode("utf-8", "replace"))
            return 0
    return call


def _set_default_stream_query(cpp: Any, runtime: Runtime,
                              allocs: list[NativeAllocator]) -> None:
    """An asynchronous runtime's C query of its default streams
    (``NativeCopies.query_default_stream``), which C++ asks before ``runtime.query_stream``
    for each freed block: a settled queue then costs no Python call."""
    if not runtime.asynchronous or not hasattr(cpp, "torchport_caching_set_default_stream_query"):
        return
    copies = runtime.native_copies()
    if copies is None or not copies.query_default_stream:
        return
    _KEEP.append(copies)  # (C++ holds its function and context for the process)
    f = cpp.torchport_caching_set_default_stream_query
    f.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    f.restype = ctypes.c_int
    for a in allocs:
        a._check(f(a.logical, copies.query_default_stream, copies.context, a.phys))


def _native_allocators(cpp: Any, runtime: Runtime, visible: list[int], device_name: str,
                       max_parked: Callable[[], int]) -> list[NativeAllocator]:
    _declare(cpp)
    allocs = [NativeAllocator(cpp, runtime, p, i, device_name, max_parked)
              for i, p in enumerate(visible)]

    def segment_malloc(device: int, nbytes: int, out: Any) -> None:
        out[0] = runtime.malloc(visible[device], nbytes) or 0

    def segment_free(device: int, ptr: int, nbytes: int) -> None:
        runtime.free(visible[device], ptr)
        for hook in SEGMENT_FREED:
            hook(ptr, nbytes)

    def synchronize(device: int) -> None:
        runtime.synchronize(visible[device])

    def out_of_memory(device: int, requested: int) -> None:
        raise torch.OutOfMemoryError(allocs[device]._oom_message(requested))

    functions = [_SEG_MALLOC(_callback(cpp, segment_malloc)),
                 _SEG_FREE(_callback(cpp, segment_free)),
                 _ON_DEVICE(_callback(cpp, synchronize)),
                 _OOM(_callback(cpp, out_of_memory))]
    _KEEP.extend(functions)
    interpreter = [ctypes.cast(getattr(ctypes.pythonapi, n), ctypes.c_void_p).value
                   for n in _INTERPRETER]
    table = (ctypes.c_void_p * (len(functions) + len(interpreter)))(
        *(ctypes.cast(f, ctypes.c_void_p).value for f in functions), *interpreter)
    if cpp.torchport_caching_enable(table, len(table), len(visible),
                                    int(runtime.asynchronous)) != 1:
        raise RuntimeError("torchport: the C++ library's caching allocator takes other "
                           "callbacks; remove its cache directory to rebuild it")
    for a in allocs:
        a._configure()
    _set_default_stream_query(cpp, runtime, allocs)
    if hasattr(cpp, "torchport_caching_set_release"):
        release = _RELEASE(_callback(cpp, lambda device, ptr: allocs[device].release(ptr)))
        _KEEP.append(release)
        cpp.torchport_caching_set_release.argtypes = [_RELEASE]
        cpp.torchport_caching_set_release.restype = None
        cpp.torchport_caching_set_release(release)
    # from the exit on, a storage that dies keeps its block: no Python call in a
    # finalizing interpreter
    atexit.register(cpp.torchport_caching_at_exit)
    return allocs
