"""The sim runtime: a simulated accelerator whose device memory lives in host RAM.

Two modes, chosen by ``TORCHPORT_SIM_STRICT``:

* default: device addresses are real host addresses (``host_addressable``), so the
  framework may build zero-copy host views, like a unified-memory device;
* strict: device addresses are fake (a private address range that is never
  mapped), so anything that touches device memory without going through this
  runtime's copies crashes or is caught; this proves the framework's
  device-only paths, which a discrete accelerator needs.

In both modes the sim's own kernels ("device code") reach memory through
:meth:`SimRuntime.device_tensor`, the way a real kernel reads its device's memory.
"""

from __future__ import annotations

import atexit
import bisect
import ctypes
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from torchport.backends.host_memory import HostMemoryTable
from torchport.backends.sim.ipc_events import _IpcMarks
from torchport.backends.sim.queues import MAX_QUEUED as MAX_QUEUED  # the bound tests read
from torchport.backends.sim.queues import SimAsyncError as SimAsyncError  # raised to users
from torchport.backends.sim.queues import _NativeWorker, _Worker, native_queues
from torchport.core import settings
from torchport.core.settings import parse_size  # noqa: F401  (torchport.backends.sim exports it)
from torchport.runtime import DeviceProperties, NativeCopies, Runtime

_ALIGN = 256
_FAKE_BASE = 0x7A00_0000_0000
_FAKE_STRIDE = 1 << 40  # address space reserved per device in strict mode

@dataclass
class _Segment:
    base: int  # device address
    nbytes: int
    memory: torch.Tensor | torch.UntypedStorage  # host memory backing the segment
    typed: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)  # views of buffer
    # shared memory another process can map (malloc_shareable, ipc_open): a CPU storage
    # over a shared-memory file, whose descriptor it keeps
    shared: torch.UntypedStorage | None = None
    counted: bool = True  # in the device's used bytes (an opened one is the exporter's)

    @property
    def buffer(self) -> torch.Tensor:
        """The segment's host memory as a uint8 tensor (made when first needed: an
        adopted result's storage is mostly never read through it)."""
        m = self.memory
        if not isinstance(m, torch.Tensor):
            m = self.memory = torch.empty(0, dtype=torch.uint8).set_(m)
        return m


@dataclass
class _Device:
    capacity: int
    used: int = 0
    bases: list[int] = field(default_factory=list)
    segments: dict[int, _Segment] = field(default_factory=dict)
    next_fake: int = 0


@dataclass
class SimStream:
    """A sim stream; work runs in order on it (synchronously unless the stream layer
    makes it asynchronous)."""

    index: int
    priority: int = 0
    handle_id: int = 0

    def __index__(self) -> int:
        """The stream as a C kernel gets it (``torchport_kernel.h``'s ``stream``)."""
        return self.handle_id


@dataclass
class SimEvent:
    index: int
    enable_timing: bool = False
    blocking: bool = False
    recorded: bool = False
    timestamp: float = 0.0
    worker: _Worker | _NativeWorker | None = None  # asynchronous mode: its stream's queue
    seq: int = 0  # ... and the ticket of its marker on that stream
    ipc: _IpcMarks | None = None  # an interprocess event: its marks, shared with others


class SimRuntime(Runtime):
    """Simulated devices backed by host memory with a per-device capacity."""

    def __init__(self, num_devices: int | None = None, memory: int | None = None,
                 strict: bool | None = None, unsupported_dtypes: frozenset | None = None) -> None:
        if num_devices is None:
            num_devices = settings.get("TORCHPORT_SIM_DEVICES")
        if memory is None:
            memory = settings.get("TORCHPORT_SIM_MEMORY")
        if strict is None:
            strict = settings.get("TORCHPORT_SIM_STRICT")
        if num_devices < 0:
            raise ValueError(f"TORCHPORT_SIM_DEVICES={num_devices} must be >= 0")
        self.strict = strict
        self.host_addressable = not strict
        if unsupported_dtypes is not None:
            self.unsupported_dtypes = frozenset(unsupported_dtypes)
        self._devices = [_Device(capacity=memory) for _ in range(num_devices)]
        self._lock = threading.Lock()
        self._seg_cache: dict[tuple[int, int], _Segment] = {}  # (index, block address)
        self._table: HostMemoryTable | None = None  # strict mode: its blocks, for C copies
        self._next_stream = 1
        # Asynchronous streams (opt-in until every kernel launches through launch()).
        self.asynchronous = settings.get("TORCHPORT_SIM_ASYNC") and \
            not settings.get("TORCHPORT_LAUNCH_BLOCKING")
        self._workers: dict[tuple[int, int], _Worker | _NativeWorker] = {}
        self._inline = False
        if self.asynchronous:
            atexit.register(self._drain)

    def _drain(self) -> None:
        """At exit: no worker may be inside ATen while the interpreter shuts down (a C++
        kernel running then aborts the process). Queued work finishes on a normal exit
        (at most :data:`MAX_QUEUED` launches a stream) and is abandoned after Ctrl-C, or
        at a second one during the wait; a failure no synchronising call reported is
        printed, not lost."""
        workers = list(self._workers.values())
        if isinstance(getattr(sys, "last_value", None), KeyboardInterrupt):
            for w in workers:
                w.abandon()
        for w in workers:
            while True:
                try:
                    w.wait()
                    break
                except KeyboardInterrupt:
                    for x in workers:
                        x.abandon()
        self._inline = True  # finalisers' device ops from now on: run where they are called
        for w in workers:
            w.inline = True
        for w in workers:
            if w.error is not None:
                name, exc = w.error
                print(f"torchport: sim: {name or 'work'} failed asynchronously on {w.label} "
                      f"and no synchronising call reported it before exit: "
                      f"{type(exc).__name__}: {exc}", file=sys.stderr)

    def queued(self, index: int) -> int:
        """Launches queued on ``index``'s streams and not yet run (asynchronous mode)."""
        return sum(w.queued() for (i, _), w in list(self._workers.items()) if i == index)

    # ---- devices -------------------------------------------------------------
    def device_count(self) -> int:
        return len(self._devices)

    def _dev(self, index: int) -> _Device:
        if not 0 <= index < len(self._devices):
            raise RuntimeError(f"sim: invalid device index {index}; "
                               f"there are {len(self._devices)} sim devices")
        return self._devices[index]

    def get_device_properties(self, index: int) -> DeviceProperties:
        d = self._dev(index)
        mode = "strict" if self.strict else "unified"
        return DeviceProperties(name=f"torchport sim ({mode} memory)", total_memory=d.capacity,
                                major=1, minor=0, multi_processor_count=os.cpu_count() or 1)

    def synchronize(self, index: int) -> None:
        self._dev(index)
        workers = [w for (i, _), w in list(self._workers.items()) if i == index]
        for w in workers:
            w.wait()
        for w in workers:
            w.raise_error()

    # ---- memory --------------------------------------------------------------
    def malloc(self, index: int, nbytes: int) -> int | None:
        d = self._dev(index)
        with self._lock:
            if d.used + nbytes > d.capacity:
                return None
            try:
                buf = torch.empty(nbytes + _ALIGN, dtype=torch.uint8)
            except RuntimeError:  # the host itself is out of memory
                return None
            host = buf.data_ptr()
            shift = (-host) % _ALIGN
            buf = buf[shift:shift + nbytes]
            if self.strict:
                base = _FAKE_BASE + index * _FAKE_STRIDE + d.next_fake
                d.next_fake += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN + _ALIGN
            else:
                base = buf.data_ptr()
            d.used += nbytes
            bisect.insort(d.bases, base)
            d.segments[base] = _Segment(base, nbytes, buf)
            if self._table is not None:
                self._table.add(index, base, buf.data_ptr(), nbytes)
            return base

    def adopt_host(self, index: int, buffer: torch.UntypedStorage) -> int | None:
        """Host memory becomes device memory (default mode only: strict-mode addresses
        are not host addresses)."""
        if self.strict:
            return None
        d = self._dev(index)
        nbytes = buffer.nbytes()
        with self._lock:
            if d.used + nbytes > d.capacity:
                return None
            base = buffer.data_ptr()
            d.used += nbytes
            bisect.insort(d.bases, base)
            d.segments[base] = _Segment(base, nbytes, buffer)
            return base

    def free(self, index: int, ptr: int) -> None:
        d = self._dev(index)
        with self._lock:
            seg = d.segments.pop(ptr, None)
            if seg is None:
                raise RuntimeError(f"sim: free of unknown address {ptr:#x} on device {index}")
            if self._table is not None:
                self._table.remove(index, ptr)
            self._seg_cache.clear()
            d.bases.remove(ptr)
            if seg.counted:
                d.used -= seg.nbytes

    # ---- memory shared with other processes ---------------------------------------
    # A shareable segment lives in a shared-memory file (PyTorch's own file-descriptor
    # shared CPU storages); the handle passes its descriptor to the other process, which
    # maps the same pages. The kernel frees them when the last process unmapped them.
    def _add_shared(self, index: int, memory: torch.UntypedStorage, counted: bool) -> int:
        d = self._dev(index)
        nbytes = memory.nbytes()
        with self._lock:
            if counted and d.used + nbytes > d.capacity:
                raise MemoryError
            if self.strict:
                base = _FAKE_BASE + index * _FAKE_STRIDE + d.next_fake
                d.next_fake += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN + _ALIGN
            else:
                base = memory.data_ptr()
            if counted:
                d.used += nbytes
            bisect.insort(d.bases, base)
            d.segments[base] = _Segment(base, nbytes, memory, shared=memory, counted=counted)
            if self._table is not None:
                self._table.add(index, base, memory.data_ptr(), nbytes)
            return base

    def malloc_shareable(self, index: int, nbytes: int) -> int | None:
        d = self._dev(index)
        if d.used + nbytes > d.capacity:
            return None
        try:
            memory = torch.UntypedStorage._new_using_fd_cpu(nbytes)
            return self._add_shared(index, memory, counted=True)
        except (RuntimeError, MemoryError):  # the host (or the device) has no room
            return None

    def ipc_export(self, index: int, ptr: int) -> Any:
        from multiprocessing.reduction import DupFd

        seg = self._dev(index).segments.get(ptr)
        if seg is None or seg.shared is None:
            raise RuntimeError(f"sim: the memory at {ptr:#x} on sim:{index} is not shareable "
                               f"(allocate it with malloc_shareable)")
        fd, size = seg.shared._share_fd_cpu_()
        return DupFd(fd), size

    def ipc_open(self, index: int, handle: Any, nbytes: int) -> int:
        df, size = handle
        fd = df.detach()
        try:
            if size != nbytes:
                raise RuntimeError(f"sim: a shared allocation of {size} bytes opened as "
                                   f"{nbytes} bytes")
            memory = torch.UntypedStorage._new_shared_fd_cpu(fd, size)
        finally:
            os.close(fd)
        return self._add_shared(index, memory, counted=False)

    def mem_get_info(self, index: int) -> tuple[int, int]:
        d = self._dev(index)
        return d.capacity - d.used, d.capacity

    def _locate(self, index: int, ptr: int, nbytes: int) -> tuple[_Segment, int]:
        d = self._dev(index)
        i = bisect.bisect_right(d.bases, ptr) - 1
        if i >= 0:
            seg = d.segments[d.bases[i]]
            off = ptr - seg.base
            if off + nbytes <= seg.nbytes:
                return seg, off
        raise RuntimeError(f"sim: illegal memory access at {ptr:#x} (+{nbytes} bytes) on sim:{index}")

    def _host_ptr(self, index: int, ptr: int, nbytes: int) -> int:
        seg = self._seg_cache.get((index, ptr))
        if seg is not None and nbytes <= seg.base + seg.nbytes - ptr:
            return seg.memory.data_ptr() + (ptr - seg.base)
        seg, off = self._locate(index, ptr, nbytes)
        if len(self._seg_cache) > 8192:
            self._seg_cache.clear()
        self._seg_cache[(index, ptr)] = seg
        return seg.memory.data_ptr() + off

    def host_address(self, ptr: int) -> int:
        if self.strict:
            raise RuntimeError("sim (strict): device memory is not host-addressable")
        return ptr

    def typed_memory(self, index: int, ptr: int, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
        """``(host tensor of dtype over ptr's segment, storage offset of ptr in elements)``.

        The kernels' view of device memory, cached per (segment, dtype) and per block
        address: every op maps its arguments through here."""
        key = (index, ptr)
        seg = self._seg_cache.get(key)
        if seg is None:
            seg = self._locate(index, ptr, 0)[0]
            if len(self._seg_cache) > 8192:
                self._seg_cache.clear()
            self._seg_cache[key] = seg
        typed = seg.typed.get(dtype)
        if typed is None:
            n = seg.nbytes - seg.nbytes % dtype.itemsize
            typed = seg.typed[dtype] = seg.buffer[:n].view(dtype)
        off = ptr - seg.base
        if off % dtype.itemsize:
            raise RuntimeError(f"sim: misaligned {dtype} access at {ptr:#x} on sim:{index}")
        return typed, off // dtype.itemsize + typed.storage_offset()

    def device_tensor(self, index: int, ptr: int, nbytes: int) -> torch.Tensor:
        """The uint8 host tensor holding ``nbytes`` of device memory at ``ptr``.

        Only the sim's own kernels use this: it is the simulated chip reading its memory."""
        seg, off = self._locate(index, ptr, nbytes)
        return seg.buffer[off:off + nbytes]

    # ---- copies --------------------------------------------------------------
    def native_copies(self) -> NativeCopies | None:
        """Strict synchronous mode: the blocking copies in C, over a table of the segments
        (a driver's copies are C; these Python ones would cost the CPU fallback a Python
        call per span). Asynchronous mode: ``None`` (a copy waits for the default queue)."""
        if not self.strict or self.asynchronous:
            return None
        with self._lock:
            if self._table is None:
                table = HostMemoryTable(len(self._devices))
                for index, d in enumerate(self._devices):
                    for base, seg in d.segments.items():
                        table.add(index, base, seg.memory.data_ptr(), seg.nbytes)
                self._table = table
        return self._table.native_copies()

    def _blocking_or_launch(self, index: int, stream: SimStream | None,
                            fn: Callable[[], Any], name: str) -> None:
        """``stream=None``: after the work queued on the default stream, complete on
        return (the runtime contract: the default stream is a stream); otherwise queued on
        ``stream``."""
        if stream is None:
            if self.asynchronous:
                w = self._worker(index, None)
                if not w.done():
                    w.wait()
                w.raise_error()
            fn()
        else:
            self.launch(index, stream, fn, name)

    def copy_h2d(self, index, dst, src_host, nbytes, stream=None) -> None:
        # ``None``: at once, without waiting for the default queue. The sim departs from the
        # stream rule here, for its asynchronous host-drawn random numbers (``torch.rand`` on
        # the device draws at the call, as CUDA's launch reserves its numbers, and must not
        # wait for the stream): torchport writes a ``None`` copy only into a fresh block (no
        # queued work uses it) or after synchronising the stream (``Backend.write_tensor``).
        if nbytes and stream is None:
            _copy_bytes(self._host_ptr(index, dst, nbytes), src_host, nbytes)
        elif nbytes:
            self._blocking_or_launch(index, stream, lambda: _copy_bytes(
                self._host_ptr(index, dst, nbytes), src_host, nbytes), "copy_h2d")

    def copy_d2h(self, index, dst_host, src, nbytes, stream=None) -> None:
        if nbytes:
            self._blocking_or_launch(index, stream, lambda: _copy_bytes(
                dst_host, self._host_ptr(index, src, nbytes), nbytes), "copy_d2h")

    def copy_d2d(self, dst_index, dst, src_index, src, nbytes, stream=None) -> None:
        if nbytes:
            if stream is None and src_index != dst_index and self.asynchronous:
                self._blocking_or_launch(src_index, None, lambda: None, "copy_d2d")
            self._blocking_or_launch(dst_index, stream, lambda: _copy_bytes(
                self._host_ptr(dst_index, dst, nbytes),
                self._host_ptr(src_index, src, nbytes), nbytes), "copy_d2d")

    def memset(self, index, ptr, value, nbytes, stream=None) -> None:
        if nbytes:
            self._blocking_or_launch(index, stream, lambda: ctypes.memset(
                self._host_ptr(index, ptr, nbytes), value, nbytes), "memset")

    # ---- streams ----------------------------------------------------------------
    def _worker(self, index: int, stream: SimStream | None) -> _Worker | _NativeWorker:
        key = (index, 0 if stream is None else stream.handle_id)
        w = self._workers.get(key)
        if w is None:
            with self._lock:
                w = self._workers.get(key)
                if w is None:
                    label = f"sim:{index} stream {key[1]}"
                    lib = native_queues()
                    w = self._workers[key] = _Worker(label, inline=self._inline) if lib is None \
                        else _NativeWorker(label, lib, inline=self._inline)
        return w

    def native_queue(self, index: int) -> int | None:
        """The C++ queue of device ``index``'s default stream (asynchronous mode with the
        native library), where C++ host-op kernels queue their CPU kernels; else ``None``."""
        if not self.asynchronous:
            return None
        w = self._worker(index, None)
        return w.handle if isinstance(w, _NativeWorker) else None

    def launch(self, index: int, stream: SimStream | None, fn: Callable[[], Any],
               name: str = "") -> None:
        """Run ``fn`` in order on ``stream``: now, or on the stream's worker thread."""
        if not self.asynchronous:
            fn()
            return
        self._dev(index)
        self._worker(index, stream).submit(fn, name, bounded=True)

    def launch_op(self, index: int, stream: SimStream | None, op: Any, args: tuple,
                  kwargs: dict, name: str = "") -> bool:
        """Queue ATen operator ``op``'s CPU kernel on ``(args, kwargs)`` (host views of
        device memory) on ``stream``, where the worker runs it without Python (C++
        queues); ``False``: not queued so (synchronous, or Python queues), left to
        :meth:`launch`, as are arguments its schema does not take as they are."""
        if not self.asynchronous or self._inline:
            return False
        self._dev(index)
        w = self._worker(index, stream)
        if not isinstance(w, _NativeWorker):
            return False
        return w.submit_op(op, args, kwargs, name) > 0

    def create_stream(self, index: int, priority: int = 0) -> SimStream:
        self._dev(index)
        with self._lock:
            sid = self._next_stream
            self._next_stream += 1
        return SimStream(index=index, priority=priority, handle_id=sid)

    def destroy_stream(self, index: int, stream: SimStream) -> None:
        self.synchronize_stream(index, stream)

    def synchronize_stream(self, index: int, stream: SimStream | None) -> None:
        self._dev(index)
        if self.asynchronous:
            w = self._worker(index, stream)
            w.wait()
            w.raise_error()

    def query_stream(self, index: int, stream: SimStream | None) -> bool:
        if not self.asynchronous:
            return True
        return self._worker(index, stream).done()

    # ---- events ----------------------------------------------------------------
    def create_event(self, index: int, enable_timing: bool = False, blocking: bool = False) -> SimEvent:
        self._dev(index)
        return SimEvent(index=index, enable_timing=enable_timing, blocking=blocking)

    def destroy_event(self, index: int, event: SimEvent) -> None:
        pass

    def record_event(self, index: int, event: SimEvent, stream: SimStream | None) -> None:
        marks = event.ipc
        gen = 0 if marks is None else marks.record()
        if not self.asynchronous:
            _stamp(event)
            if marks is not None:
                marks.done(gen)
            return

        def reached() -> None:
            _stamp(event)
            if marks is not None:
                marks.done(gen)

        w = self._worker(index, stream)
        if marks is None and not event.enable_timing and isinstance(w, _NativeWorker):
            event.recorded = True  # nothing to stamp: a marker, no Python on the worker
            event.worker, event.seq = w, w.marker()
            return
        event.worker, event.seq = w, w.submit(reached, "record_event")

    def stream_wait_event(self, index: int, stream: SimStream | None, event: SimEvent) -> None:
        self._dev(index)
        marks = event.ipc
        if marks is not None:
            gen = marks.pending()
            if not gen:
                return
            if not self.asynchronous:  # another process's queue: this device waits for it
                marks.wait(gen)
                return
            target = self._worker(index, stream)
            target.submit(lambda: marks.wait(gen, lambda: target.abandoned),
                          "stream_wait_event")
            return
        src, seq = event.worker, event.seq
        if not self.asynchronous or src is None:
            return
        target = self._worker(index, stream)
        if target is src:
            return
        if isinstance(target, _NativeWorker) and isinstance(src, _NativeWorker):
            target.wait_for(src, seq)
        else:
            target.submit(lambda: src.wait(seq), "stream_wait_event")

    def synchronize_event(self, index: int, event: SimEvent) -> None:
        gen = 0 if event.ipc is None else event.ipc.pending()
        if event.worker is not None:
            event.worker.wait(event.seq)
            event.worker.raise_error()
        if gen and event.ipc is not None:
            event.ipc.wait(gen)

    def query_event(self, index: int, event: SimEvent) -> bool:
        if event.ipc is not None:
            return not event.ipc.pending()
        return event.worker is None or event.worker.done(event.seq)

    # ---- events shared with other processes ---------------------------------------
    _IPC_PREFIX = b"torchport-sim-event:"

    def create_ipc_event(self, index: int) -> SimEvent:
        self._dev(index)
        return SimEvent(index=index, ipc=_IpcMarks.new())

    def ipc_event_export(self, index: int, event: SimEvent) -> bytes:
        if event.ipc is None:
            raise RuntimeError("sim: this event was not created for sharing between "
                               "processes (torch.sim.Event(interprocess=True))")
        return self._IPC_PREFIX + os.fsencode(event.ipc.path)

    def ipc_event_open(self, index: int, handle: bytes) -> SimEvent:
        self._dev(index)
        if not isinstance(handle, bytes) or not handle.startswith(self._IPC_PREFIX):
            raise ValueError(f"sim: {handle!r} is not a sim event's IPC handle (one "
                             f"torch.sim.Event.ipc_handle() returned)")
        path = os.fsdecode(handle[len(self._IPC_PREFIX):])
        return SimEvent(index=index, ipc=_IpcMarks(path, create=False))

    def event_elapsed_time(self, index: int, start: SimEvent, end: SimEvent) -> float:
        for e in (start, end):
            if not e.enable_timing:
                raise RuntimeError("Both events must be created with enable_timing=True "
                                   "to measure elapsed time")
            if not e.recorded:
                raise RuntimeError("Both events must be recorded before calculating elapsed time")
        return (end.timestamp - start.timestamp) * 1000.0


_PARALLEL_COPY = 1 << 16
_CPU = torch.device("cpu")


def _copy_bytes(dst: int, src: int, nbytes: int) -> None:
    """The sim's DMA engine: ``memmove`` for small copies; ATen's copy (which uses every
    intra-op thread, as a device's copy engines would) for large ones."""
    if nbytes < _PARALLEL_COPY:
        ctypes.memmove(dst, src, nbytes)
        return
    make = torch._C._construct_storage_from_data_pointer
    d = torch.empty(0, dtype=torch.uint8).set_(make(dst, _CPU, nbytes))
    d.copy_(torch.empty(0, dtype=torch.uint8).set_(make(src, _CPU, nbytes)))


def _stamp(event: SimEvent) -> None:
    event.timestamp = time.perf_counter()
    event.recorded = True
