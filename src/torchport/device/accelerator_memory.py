"""``torch.accelerator``'s memory API on the device, answered by torchport's allocator.

``torch.accelerator.memory_stats()`` (and ``memory_allocated``, ``max_memory_*``,
``memory_reserved``, ``reset_*_memory_stats``, ``empty_cache``, ``get_memory_info``) asks
the ``c10::DeviceAllocator`` registered in C++ for the device type
(``c10::getDeviceAllocator``). A Python backend cannot register one, so there these
functions fail with PyTorch's "Allocator for sim is not a DeviceAllocator". torchport's C++
library (``native_allocator.cpp``) registers one over the device's caching allocator
(:mod:`torchport.memory.allocator`): with the C++ pools (:class:`~torchport.memory.allocator.NativeAllocator`)
allocations, frees and statistics are answered in C++, and the rest (or everything, with the
Python allocator) calls back into this module, which answers with the functions of
``torch.<device>``: ``torch.accelerator`` and ``torch.<device>`` report the same statistics. The same allocator serves C++ that makes a device storage itself
(``torch._C.StorageBase.__new__``, which crashed on the null allocator before): a block of
the current device's caching allocator, counted as a tensor of that size, returned when the
storage dies (the block's DataPtr deleter).

Without the library (``TORCHPORT_NATIVE=0``, no compiler) nothing is registered: the
``torch.accelerator`` memory functions raise PyTorch's error, ``torch.<device>.memory_*``
work as ever.
"""

from __future__ import annotations

import atexit
import ctypes
import sys
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from torchport.core import interrupts, native
from torchport.device import forking

if TYPE_CHECKING:
    from torchport.core.contracts import DeviceBackend

_ARRAYS = ("allocation", "segment", "active", "inactive_split", "allocated_bytes",
           "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes")
_POOLS = ("all", "small_pool", "large_pool")  # c10::CachingAllocator::StatType order
_METRICS = ("current", "peak", "allocated", "freed")
_COUNTERS = ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc",
             "num_device_free", "max_split_size")
_OVERSIZE = ("oversize_allocations", "oversize_segments")
# The values getDeviceStats reads, in native_allocator.cpp's order. The allocator never
# serves a block past max_split_size (it has none), so it reports only the oversize
# counts' current value (0); their peak and totals are 0 likewise.
STATS_LAYOUT: tuple[str, ...] = (
    *(f"{a}.{p}.{m}" for a in _ARRAYS for p in _POOLS for m in _METRICS),
    *_COUNTERS,
    *(f"{o}.{m}" for o in _OVERSIZE for m in _METRICS))
_ZERO_UNLESS_REPORTED = frozenset(f"{o}.{m}" for o in _OVERSIZE for m in _METRICS)

# The c10::Error kinds of native_allocator.h (ErrorKind), first match wins.
_KINDS: tuple[tuple[type[BaseException], int], ...] = (
    (torch.OutOfMemoryError, 1), (torch.AcceleratorError, 2), (NotImplementedError, 6),
    (ValueError, 3), (TypeError, 4), (IndexError, 5))
_PLAIN = (RuntimeError, torch.OutOfMemoryError, torch.AcceleratorError, NotImplementedError,
          ValueError, TypeError, IndexError)
_PRIVATE_USE1 = 20  # c10::DeviceType::PrivateUse1

_ALLOCATE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_uint64,
                             ctypes.POINTER(ctypes.c_uint64))
_FREE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_uint64)
_STATS = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int64),
                          ctypes.c_int)
_ON_DEVICE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)
_NO_ARGS = ctypes.CFUNCTYPE(ctypes.c_int)
_MEMORY_INFO = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_uint64),
                                ctypes.POINTER(ctypes.c_uint64))
_FLAG = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int))
_RECORD_STREAM = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_uint64, ctypes.c_int,
                                  ctypes.c_int64)
_COPY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64)
_PYTHON_API = ("PyGILState_Ensure", "PyGILState_Release", "PyErr_Fetch", "PyErr_Restore")

# The callbacks C++ holds, alive for the process (C++ calls them until the exit begins).
_KEEP: list[Any] = []
_installed = False


def installed() -> bool:
    """Does torch.accelerator's memory API answer for the device in this process?"""
    return _installed


class _Freed:
    """What :meth:`DeviceAllocator.storage_died` reads of a storage's reference: the
    address of the block it returns."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


def _report(cpp: ctypes.CDLL, e: BaseException) -> None:
    """Hand a callback's exception to C++, which raises it as the matching c10::Error."""
    kind = next((k for t, k in _KINDS if isinstance(e, t)), 0)
    msg = str(e) if type(e) in _PLAIN else f"{type(e).__name__}: {e}"
    cpp.torchport_allocator_fail(kind, msg.encode("utf-8", "replace"))


def _callback(cpp: ctypes.CDLL, fn: Callable[..., None]) -> Callable[..., int]:
    """``fn`` as a C callback: 1 when it returned, 0 after reporting its exception."""
    def call(*args: Any) -> int:
        try:
            interrupts.to_completion(fn, *args)  # (Ctrl-C: raised once back in C++)
            return 1
        except BaseException as e:  # noqa: BLE001 (every exception must reach C++ as an error)
            interrupts.redeliver(e)
            _report(cpp, e)
            return 0
    return call


def _python_api() -> list[int]:
    return [ctypes.cast(getattr(ctypes.pythonapi, name), ctypes.c_void_p).value
            for name in _PYTHON_API]


def install(backend: DeviceBackend) -> bool:
    """Register the C++ device allocator answering from ``backend``'s allocators, where the
    library loads; ``False`` where it is unavailable or another C++ allocator holds the
    device type (then ``torch.accelerator``'s memory API is that allocator's, or PyTorch's
    error)."""
    global _installed
    cpp = native.load()
    if cpp is None:
        return False
    b = backend
    mod = b.device_module
    cpp.torchport_allocator_fail.argtypes = [ctypes.c_int, ctypes.c_char_p]
    cpp.torchport_allocator_fail.restype = None
    cpp.torchport_allocator_enable.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
    cpp.torchport_allocator_detach.restype = None
    if cpp.torchport_allocator_stats_count() != len(STATS_LAYOUT):
        raise RuntimeError(f"torchport: {len(STATS_LAYOUT)} memory statistics here, "
                           f"{cpp.torchport_allocator_stats_count()} in the C++ library; "
                           f"remove {native._cache_dir()} to rebuild it")

    def allocate(device: int, nbytes: int, out: Any) -> None:
        # what Backend.empty_strided takes for a tensor of nbytes
        block = b.allocator(device).malloc(nbytes, b.current_stream_handle(device))
        out[0] = block.ptr

    def free(device: int, ptr: int) -> None:
        try:
            b.allocators[device].storage_died(_Freed(ptr))
        except BaseException as e:  # noqa: BLE001 (a deleter cannot raise: report, as for __del__)
            interrupts.redeliver(e)
            print(f"Exception ignored in torchport's {b.name} allocator returning block "
                  f"{ptr:#x} of {b.name}:{device}:", file=sys.stderr)
            traceback.print_exc()

    def stats(device: int, out: Any, count: int) -> None:
        if count != len(STATS_LAYOUT):
            raise RuntimeError(f"torchport: C++ reads {count} memory statistics, "
                               f"{len(STATS_LAYOUT)} are known here")
        st = mod.memory_stats(device)
        for i, key in enumerate(STATS_LAYOUT):
            out[i] = st.get(key, 0) if key in _ZERO_UNLESS_REPORTED else st[key]

    def memory_info(device: int, free_out: Any, total_out: Any) -> None:
        free_out[0], total_out[0] = mod.mem_get_info(device)

    def initialized(out: Any) -> None:
        out[0] = int(_initialized(b))

    def record_stream(device: int, ptr: int, stream_device: int, stream_id: int) -> None:
        # Tensor.record_stream itself, on a one-byte tensor at the block's address
        where = b.devices[b.check_index(device)]
        storage = torch._C._construct_storage_from_data_pointer(ptr, where, 1)
        t = torch.empty(0, dtype=torch.uint8, device=where).set_(storage)
        t.record_stream(torch.Stream(stream_id=stream_id, device_index=stream_device,
                                     device_type=_PRIVATE_USE1))

    def copy(dest: int, src: int, count: int) -> None:
        into, out_of = _device_of(b, dest, count), _device_of(b, src, count)
        b.host_sync(into)
        b.host_sync(out_of)
        b.runtime.copy_d2d(b.phys(into), dest, b.phys(out_of), src, count)

    functions = [
        _ALLOCATE(_callback(cpp, allocate)),
        _FREE(_callback(cpp, free)),
        _STATS(_callback(cpp, stats)),
        _ON_DEVICE(_callback(cpp, mod.reset_peak_memory_stats)),
        _ON_DEVICE(_callback(cpp, mod.reset_accumulated_memory_stats)),
        _NO_ARGS(_callback(cpp, mod.empty_cache)),
        _MEMORY_INFO(_callback(cpp, memory_info)),
        _FLAG(_callback(cpp, initialized)),
        _RECORD_STREAM(_callback(cpp, record_stream)),
        _COPY(_callback(cpp, copy)),
    ]
    _KEEP.extend(functions)
    table = (ctypes.c_void_p * (len(functions) + len(_PYTHON_API)))(
        *(ctypes.cast(f, ctypes.c_void_p).value for f in functions), *_python_api())
    done = cpp.torchport_allocator_enable(table, len(table))
    if done < 0:
        raise RuntimeError(f"torchport: the C++ library's device allocator takes other "
                           f"callbacks; remove {native._cache_dir()} to rebuild it")
    if done:
        # from the exit on, a storage that dies keeps its block: no Python call in a
        # finalizing interpreter
        atexit.register(cpp.torchport_allocator_detach)
    _installed = bool(done)
    return _installed


def _initialized(b: DeviceBackend) -> bool:
    """``DeviceAllocator::initialized``: ``torch.<device>.is_initialized()``, or some
    statistic to report (the device used, then its memory all returned), as CUDA's
    allocator stays initialized. ``torch.accelerator.memory_stats()`` is ``{}`` before."""
    if b.bad_fork:
        return False
    if forking.used(b):
        return True
    return any(v for a in b.allocators for k, v in a.memory_stats().items()
               if k != "max_split_size")


def _device_of(b: DeviceBackend, ptr: int, count: int) -> int:
    """The logical device whose allocator holds ``count`` bytes at ``ptr``."""
    for i, a in enumerate(b.allocators):
        with a.lock:
            for base, head in a.segments.items():
                if base <= ptr and ptr + count <= base + head.segment_size:
                    return i
    raise ValueError(f"torchport: {count} bytes at {ptr:#x} are not {b.name} memory of its "
                     f"allocator (copy_data copies between the allocator's blocks)")
