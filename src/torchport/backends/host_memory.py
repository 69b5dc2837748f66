"""Device memory kept in host memory behind a runtime's own addresses, copied in C.

A runtime that models a discrete device over host memory (the sim's strict mode) has its
copies only in Python, where a driver has them in C. :class:`HostMemoryTable` mirrors the
runtime's blocks in a C table (``csrc/native_host_memory.cpp``) whose copies are the
runtime's :meth:`~torchport.runtime.Runtime.native_copies`: the CPU fallback's staged calls
then move their bytes without entering Python. A copy outside every block the table holds
returns to the runtime's Python method, which raises its own error; so does every copy of a
device marked :meth:`~HostMemoryTable.busy` (an asynchronous runtime's default queue with
work left or an error to report: the Python method waits and raises) and every copy while
the table is :meth:`~HostMemoryTable.declined` (a runtime injecting faults). A runtime whose
``busy`` marks follow its default queues exactly (``tracks_queues``) also gets the table's
C default-stream query (``NativeCopies.query_default_stream``): the caching allocator then
learns that a freed block's queue is settled without a Python call.
"""

from __future__ import annotations

import ctypes
from typing import Any

from torchport.runtime import NativeCopies


class HostMemoryTable:
    """The blocks of ``devices`` devices: device address -> host address and size.

    The runtime calls :meth:`add` for each block it hands out and :meth:`remove` before its
    host memory goes; :meth:`native_copies` gives the C copies over the table, or ``None``
    where the C++ library is not loaded (the Python copies then serve). ``tracks_queues``:
    the runtime marks a device :meth:`busy` exactly while its default queue has work left
    or an error to report, so that a device not busy has a settled default stream."""

    def __init__(self, devices: int, tracks_queues: bool = False) -> None:
        from torchport.core import native

        self._tracks_queues = tracks_queues

        cpp = native.loaded() if native.wanted() else None
        self._cpp: Any = cpp
        self._table: int | None = None
        if cpp is None or not hasattr(cpp, "torchport_host_memory_new"):
            self._cpp = None
            return
        cpp.torchport_host_memory_new.restype = ctypes.c_void_p
        cpp.torchport_host_memory_new.argtypes = [ctypes.c_int32]
        cpp.torchport_host_memory_add.argtypes = [ctypes.c_void_p, ctypes.c_int32] + \
            [ctypes.c_uint64] * 3
        cpp.torchport_host_memory_remove.argtypes = [ctypes.c_void_p, ctypes.c_int32,
                                                     ctypes.c_uint64]
        # (through PyDLL, keeping the GIL: the runtime marks its queue from its own Python
        # code, and a call that let the GIL go would hand it to another thread each time)
        self._busy = ctypes.PyDLL(cpp._name).torchport_host_memory_busy
        self._busy.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32]
        # one table for the process's life: C++ may hold its copies' context
        self._table = cpp.torchport_host_memory_new(devices)

    def add(self, index: int, base: int, host: int, nbytes: int) -> None:
        """Device ``index``'s block of ``nbytes`` at device address ``base`` lies at ``host``."""
        if self._table is not None:
            self._cpp.torchport_host_memory_add(self._table, index, base, host, nbytes)

    def remove(self, index: int, base: int) -> None:
        """The block at ``base`` is no longer device ``index``'s."""
        if self._table is not None:
            self._cpp.torchport_host_memory_remove(self._table, index, base)

    def busy(self, index: int, busy: bool) -> None:
        """Device ``index``'s copies go to the runtime's Python methods while ``busy``."""
        if self._table is not None:
            self._busy(self._table, index, int(busy))

    def declined(self, declined: bool) -> None:
        """Every device's copies go to the runtime's Python methods while ``declined``."""
        self.busy(-1, declined)

    def native_copies(self) -> NativeCopies | None:
        """The table's blocking copies as :class:`~torchport.runtime.NativeCopies`."""
        if self._table is None:
            return None
        cpp = self._cpp

        def address(fn: Any) -> int:
            return ctypes.cast(fn, ctypes.c_void_p).value or 0

        query = address(cpp.torchport_host_memory_settled) if self._tracks_queues else 0
        return NativeCopies(copy_d2h=address(cpp.torchport_host_memory_d2h),
                            copy_h2d=address(cpp.torchport_host_memory_h2d),
                            context=self._table, keep=cpp, query_default_stream=query,
                            copy_d2d=address(cpp.torchport_host_memory_d2d))
