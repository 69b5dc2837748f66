"""The reference backend's runtime: a discrete, asynchronous device modelled in Python.

Device memory is one numpy ``uint8`` array per block behind fake addresses
(``host_addressable = False``: every byte the host sees moves through the copies). Each
stream -- the default one included -- is an in-order queue run by its own worker thread;
an event is the last ticket of a queue when recorded (a timing event queues a marker, which
stamps the time). The stream contract (``docs/vendor-guide.md``):

* a copy or memset given ``stream=None`` first lets the device's default queue finish (and
  reports its failure), then copies: it is complete on return, as ``cudaMemcpy``;
* a copy given a stream, a launch and an event record are appended to that stream's queue;
* work that raises on a queue is kept and reported (:class:`RefDeviceError`) at the next
  synchronising call on that stream; the work after it still runs.

Device work (what ``launch`` runs) reads and writes memory directly (:meth:`RefRuntime.view`);
calling a host copy from it raises, as it would wait for its own queue.

:class:`Faults` makes the runtime fail on purpose, for tests: ``malloc`` out of memory or
raising, a copy or a kernel raising, a queue's worker thread dying.
"""

from __future__ import annotations

import atexit
import bisect
import collections
import ctypes
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from torchport.backends.host_memory import HostMemoryTable
from torchport.core import settings
from torchport.runtime import DeviceProperties, NativeCopies, Runtime

GiB = 1 << 30
_ALIGN = 256
_SPAN = 1 << 40  # address range of one device
_VIEWS_KEPT = 4096  # numpy views of device memory kept for device work to reuse


class RefDeviceError(torch.AcceleratorError):
    """Device work on a ``ref`` stream failed (a kernel, a copy, a queue whose worker died),
    or a copy failed; raised at the next synchronising call on that stream (a
    ``RuntimeError``, as CUDA's asynchronous errors)."""


@dataclass
class Faults:
    """Failures to inject (tests). Each is ``None`` (off) or how many more calls succeed
    before it fires: ``malloc_none_after`` then fails every ``malloc`` (out of memory) until
    reset; the others fire once and reset themselves.

    * ``malloc_none_after``: ``malloc`` returns ``None`` (the device is full).
    * ``malloc_raise_after``: ``malloc`` raises :class:`RefDeviceError`.
    * ``copy_raise_after``: a copy or memset raises (at the call for ``stream=None``, on its
      queue otherwise), before it moved a byte.
    * ``kernel_raise_after``: a launched kernel raises on its queue before it runs.
    * ``worker_dies_after``: the worker thread reaching that queued item ends: the item and
      everything queued after it never run (reported at the next synchronisation, after
      which the stream gets a new worker).
    """

    malloc_none_after: int | None = None
    malloc_raise_after: int | None = None
    copy_raise_after: int | None = None
    kernel_raise_after: int | None = None
    worker_dies_after: int | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        owner = self.__dict__.get("owner")  # (the runtime, told when a fault is armed)
        if owner is not None:
            owner._faults_changed()

    def armed(self) -> bool:
        return any(getattr(self, n) is not None for n in self.__dataclass_fields__)


class _Item:
    __slots__ = ("dies", "fn", "name", "ticket")

    def __init__(self, ticket: int, fn: Callable[[], Any], name: str, dies: bool) -> None:
        self.ticket, self.fn, self.name, self.dies = ticket, fn, name, dies


class RefStream:
    """A stream: an in-order queue run by one worker thread (started on first use).

    Tickets number the queued items; ``completed`` is the last one done (run, failed, or
    dropped with a dead worker), ``ran`` the last one that actually ran. The first failure
    is kept, with its item's name, until a synchronising call reports it."""

    def __init__(self, runtime: RefRuntime, index: int, sid: int, priority: int = 0) -> None:
        self.runtime, self.index, self.sid, self.priority = runtime, index, sid, priority
        self.label = f"ref:{index} " + ("default stream" if sid == 0 else f"stream {sid}")
        self.cv = threading.Condition()
        self.items: collections.deque[_Item] = collections.deque()
        self.submitted = self.completed = self.ran = 0
        self.error: tuple[str, BaseException] | None = None
        self.thread: threading.Thread | None = None
        self.died = False  # the worker ended with work queued
        self.busy = False  # what the C copies were last told (the default stream's)
        self.closed = False
        self.inline = False  # at exit: work runs in the caller

    def __repr__(self) -> str:
        return f"RefStream({self.label})"

    def __index__(self) -> int:  # (C kernels take the handle as an integer)
        return self.sid

    # ---- the host's side ---------------------------------------------------------------
    def submit(self, fn: Callable[[], Any], name: str) -> int:
        """Append ``fn`` to the queue; its ticket."""
        dies = self.runtime._fire("worker_dies_after")
        with self.cv:
            self.submitted += 1
            item = _Item(self.submitted, fn, name, dies)
            self.tell_copies()
            if not self.inline:
                self.items.append(item)
                if self.thread is None:
                    self.thread = threading.Thread(target=self._loop, daemon=True,
                                                   name=f"torchport-{self.label}")
                    self.runtime._workers.add(self.thread)
                    self.thread.start()
                self.cv.notify_all()
                return item.ticket
        self._run(item)  # inline: the caller is the device
        return item.ticket

    def settled(self) -> bool:
        """Nothing queued is left to run and no failure waits to be reported. Read without
        the lock: a stale read only sends the caller to :meth:`wait`, which takes it."""
        return self.completed >= self.submitted and self.error is None and not self.died

    def tell_copies(self) -> None:
        """(``cv`` held.) The default stream tells the C copies (:meth:`RefRuntime.native_
        copies`) whether they must leave a blocking copy to the Python one, which waits for
        this queue and reports its failure: while it is not :meth:`settled`."""
        table = self.runtime._table
        if table is not None and self.sid == 0 and self.busy == self.settled():
            self.busy = not self.busy
            table.busy(self.index, self.busy)

    def done(self, ticket: int | None = None) -> bool:
        with self.cv:
            self._recover_if_dead()
            return self.completed >= (self.submitted if ticket is None else ticket)

    def wait(self, ticket: int | None = None) -> None:
        """Block until ``ticket`` (default: everything queued) is done; a dead worker's
        queue is dropped (:meth:`_recover_if_dead`)."""
        with self.cv:
            target = self.submitted if ticket is None else ticket
            while self.completed < target:
                if self._recover_if_dead():
                    break
                self.cv.wait(0.05)  # in slices: Ctrl-C reaches the waiting thread

    def raise_error(self) -> None:
        """Report (and clear) the first failure of work that ran on this queue."""
        with self.cv:
            err, self.error = self.error, None
            self.tell_copies()
        if err is not None:
            name, exc = err
            if isinstance(exc, RefDeviceError) and name == "":
                raise exc
            raise RefDeviceError(
                f"ref: {name or 'work'} failed asynchronously on {self.label}: "
                f"{type(exc).__name__}: {exc} (the work queued after it ran; set "
                f"TORCHPORT_LAUNCH_BLOCKING=1 to get the error at the op)") from exc

    def close(self) -> None:
        """Stop the worker once the queue is empty (a destroyed stream)."""
        with self.cv:
            self.closed = True
            self.cv.notify_all()

    # ---- the device's side -------------------------------------------------------------
    def _recover_if_dead(self) -> bool:
        """(``cv`` held.) The worker died with work queued: drop that work, keep an error
        for the next synchronising call, let a new worker start with the next submission."""
        if not self.died:
            return False
        lost = len(self.items)
        self.items.clear()
        self.completed = self.submitted
        self.died, self.thread = False, None
        if self.error is None:
            self.error = ("", RefDeviceError(
                f"ref: the worker of {self.label} died; {lost} queued item(s) did not run "
                f"and the tensors they write hold undefined values (the stream restarts "
                f"with the next work)"))
        self.cv.notify_all()
        return True

    def _loop(self) -> None:
        while True:
            with self.cv:
                while not self.items:
                    if self.closed:
                        self.runtime._workers.discard(threading.current_thread())
                        return
                    self.cv.wait()
                item = self.items[0]
                if item.dies:  # the injected crash: this thread ends, the item stays queued
                    self.died = True
                    self.runtime._workers.discard(threading.current_thread())
                    self.cv.notify_all()
                    return
                self.items.popleft()
            self._run(item)

    def _run(self, item: _Item) -> None:
        try:
            item.fn()
        except BaseException as exc:  # reported at the next synchronising call
            with self.cv:
                if self.error is None:
                    self.error = (item.name, exc)
        with self.cv:
            self.completed = max(self.completed, item.ticket)
            self.ran = max(self.ran, item.ticket)
            self.tell_copies()
            self.cv.notify_all()


class RefEvent:
    """An event: the marker last recorded on a queue (``stream`` and ``ticket``), and the
    time the queue reached it. Only a timing event queues a marker (which stamps the time);
    another's ticket is the last work queued when it was recorded."""

    __slots__ = ("enable_timing", "index", "mark", "stream", "ticket", "time")

    def __init__(self, index: int, enable_timing: bool) -> None:
        self.index, self.enable_timing = index, enable_timing
        self.stream: RefStream | None = None
        self.ticket = 0
        self.time: float | None = None
        self.mark = object()  # the latest record's (an earlier marker still queued stamps nothing)


class RefRuntime(Runtime):
    """``devices`` devices of ``memory`` bytes each: device-only memory, one worker thread
    per stream. ``faults`` injects failures (:class:`Faults`)."""

    host_addressable = False
    asynchronous = True

    def __init__(self, devices: int = 2, memory: int = 4 * GiB) -> None:
        self.capacity = memory
        self.blocks: list[dict[int, np.ndarray]] = [{} for _ in range(devices)]
        # each block's host address, where the copy engine reaches it
        self.addresses: list[dict[int, int]] = [{} for _ in range(devices)]
        self.bases: list[list[int]] = [[] for _ in range(devices)]
        self.used = [0] * devices
        self.next = [(i + 1) * _SPAN for i in range(devices)]
        self.lock = threading.RLock()  # autograd's threads allocate and launch too
        self.streams: list[list[RefStream]] = [[RefStream(self, i, 0)] for i in range(devices)]
        self._next_sid = 1
        self._workers: set[threading.Thread] = set()
        self._views: dict[tuple, np.ndarray] = {}  # view()'s, by their arguments
        self._table: HostMemoryTable | None = None  # the blocks, for the C copies
        self.faults = Faults()
        atexit.register(self._drain)

    @property
    def faults(self) -> Faults:
        return self._faults

    @faults.setter
    def faults(self, faults: Faults) -> None:
        self._faults = faults
        faults.owner = self
        self._faults_changed()

    def _faults_changed(self) -> None:
        """While a fault is armed every copy is the Python one, which fires it."""
        if self._table is not None:
            self._table.declined(self._faults.armed())

    # ---- faults -------------------------------------------------------------------------
    def _fire(self, name: str) -> bool:
        """Count one call against fault ``name``; does it fail?"""
        if getattr(self.faults, name) is None:  # (set by tests between calls)
            return False
        with self.lock:
            left = getattr(self.faults, name)
            if left is None:
                return False
            if left > 0:
                setattr(self.faults, name, left - 1)
                return False
            if name != "malloc_none_after":  # one shot
                setattr(self.faults, name, None)
            return True

    def _check_host_call(self, what: str) -> None:
        if threading.current_thread() in self._workers:
            raise RuntimeError(f"ref: {what} with stream=None called from device work on a "
                               f"stream's queue; it would wait for that queue. Device work "
                               f"reads and writes memory directly (RefRuntime.view)")

    # ---- devices ------------------------------------------------------------------------
    def device_count(self) -> int:
        return len(self.blocks)

    def get_device_properties(self, index: int) -> DeviceProperties:
        self._device(index)
        return DeviceProperties(name="torchport reference device", total_memory=self.capacity,
                                multi_processor_count=4)

    def _device(self, index: int) -> None:
        if not 0 <= index < len(self.blocks):
            raise RuntimeError(f"ref: invalid device index {index} (the runtime has "
                               f"{len(self.blocks)} devices)")

    # ---- memory -------------------------------------------------------------------------
    def malloc(self, index: int, nbytes: int) -> int | None:
        self._device(index)
        if self._fire("malloc_raise_after"):
            raise RefDeviceError(f"ref:{index}: the driver failed to allocate {nbytes} bytes "
                                 f"(fault injected by RefRuntime.faults.malloc_raise_after)")
        if self._fire("malloc_none_after"):
            return None
        size = -(-nbytes // _ALIGN) * _ALIGN
        with self.lock:
            if self.used[index] + size > self.capacity:
                return None
            block = np.empty(nbytes, dtype=np.uint8)
            ptr, self.next[index] = self.next[index], self.next[index] + size
            self.blocks[index][ptr] = block
            self.addresses[index][ptr] = block.ctypes.data
            if self._table is not None:
                self._table.add(index, ptr, block.ctypes.data, nbytes)
            bisect.insort(self.bases[index], ptr)
            self.used[index] += size
            return ptr

    def free(self, index: int, ptr: int) -> None:
        with self.lock:
            block = self.blocks[index].pop(ptr, None)
            self.addresses[index].pop(ptr, None)
            if block is None:
                raise RuntimeError(f"ref:{index}: free of {ptr:#x}, which malloc did not return "
                                   f"(or was freed already)")
            if self._table is not None:
                self._table.remove(index, ptr)
            self.bases[index].remove(ptr)
            self.used[index] -= -(-block.nbytes // _ALIGN) * _ALIGN
            end = ptr + block.nbytes
            self._views = {k: v for k, v in self._views.items()
                           if not (k[0] == index and ptr <= k[1] < end)}

    def mem_get_info(self, index: int) -> tuple[int, int]:
        self._device(index)
        return self.capacity - self.used[index], self.capacity

    def _block_at(self, index: int, ptr: int, nbytes: int) -> tuple[int, int]:
        """The base of the block holding the ``nbytes`` at ``ptr``, and ``ptr``'s offset
        in it; an illegal address raises."""
        with self.lock:
            bases = self.bases[index]
            i = bisect.bisect_right(bases, ptr) - 1
            block = self.blocks[index][bases[i]] if i >= 0 else None
            off = ptr - bases[i] if i >= 0 else 0
        if block is None or off + nbytes > block.nbytes:
            raise RuntimeError(f"ref:{index}: illegal address {ptr:#x} (+{nbytes} bytes)")
        return bases[i], off

    def bytes_at(self, index: int, ptr: int, nbytes: int) -> np.ndarray:
        """The device reaching its own memory: the ``nbytes`` at ``ptr`` (inside one block),
        as a writable ``uint8`` array."""
        base, off = self._block_at(index, ptr, nbytes)
        return self.blocks[index][base][off:off + nbytes]

    def _dma_address(self, index: int, ptr: int, nbytes: int) -> int:
        """The host address the copy engine moves the ``nbytes`` at ``ptr`` through."""
        base, off = self._block_at(index, ptr, nbytes)
        return self.addresses[index][base] + off

    def view(self, index: int, ptr: int, shape: tuple[int, ...], strides: tuple[int, ...],
             dtype: np.dtype) -> np.ndarray:
        """A numpy view of device memory: element ``i`` of dimension ``d`` is ``strides[d]``
        elements after ``ptr`` (for device work: kernels read and write through it). Kept
        until its block is freed (the caching allocator hands the same blocks out again)."""
        key = (index, ptr, shape, strides, dtype)
        got = self._views.get(key)
        if got is None:
            got = self._new_view(index, ptr, shape, strides, dtype)
            with self.lock:
                if len(self._views) >= _VIEWS_KEPT:
                    self._views.clear()
                self._views[key] = got
        return got

    def _new_view(self, index: int, ptr: int, shape: tuple[int, ...],
                  strides: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        if any(s == 0 for s in shape):
            return np.empty(shape, dtype)
        span = (sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) + 1) * dtype.itemsize
        raw = self.bytes_at(index, ptr, span)
        return np.ndarray(shape, dtype, buffer=raw,
                          strides=tuple(s * dtype.itemsize for s in strides))

    # ---- copies -------------------------------------------------------------------------
    def native_copies(self) -> NativeCopies | None:
        """The blocking copies in C, as a driver has them: over a table of the blocks, taken
        while the device's default queue is settled and no fault is armed (the Python copy
        serves the others: it waits, reports and fires them)."""
        with self.lock:
            if self._table is None:
                table = HostMemoryTable(len(self.blocks), tracks_queues=True)
                for index, blocks in enumerate(self.blocks):
                    for base, block in blocks.items():
                        table.add(index, base, block.ctypes.data, block.nbytes)
                self._table = table
                for queues in self.streams:
                    with queues[0].cv:
                        queues[0].busy = False
                        queues[0].tell_copies()
                self._faults_changed()
        return self._table.native_copies()

    def _copy(self, index: int, stream: RefStream | None, name: str,
              fn: Callable[[], None]) -> None:
        """A copy's device work: ``stream=None``: after the default queue, complete on
        return (its failure and the default queue's raise here); else queued."""
        fails = self._fire("copy_raise_after")

        def work() -> None:
            if fails:
                raise RefDeviceError(f"ref:{index}: DMA error in {name} (fault injected by "
                                     f"RefRuntime.faults.copy_raise_after)")
            fn()
        if stream is None:
            self._check_host_call(name)
            default = self.streams[index][0]
            if not default.settled():
                default.wait()
                default.raise_error()
            work()
        else:
            stream.submit(work, name)

    def copy_h2d(self, index: int, dst: int, src_host: int, nbytes: int,
                 stream: RefStream | None = None) -> None:
        if nbytes:
            self._copy(index, stream, "copy_h2d", lambda: ctypes.memmove(
                self._dma_address(index, dst, nbytes), src_host, nbytes))

    def copy_d2h(self, index: int, dst_host: int, src: int, nbytes: int,
                 stream: RefStream | None = None) -> None:
        if nbytes:
            self._copy(index, stream, "copy_d2h", lambda: ctypes.memmove(
                dst_host, self._dma_address(index, src, nbytes), nbytes))

    def copy_d2d(self, dst_index: int, dst: int, src_index: int, src: int, nbytes: int,
                 stream: RefStream | None = None) -> None:
        if nbytes:
            if stream is None and src_index != dst_index:  # the source's queue too
                self._check_host_call("copy_d2d")
                self.streams[src_index][0].wait()
                self.streams[src_index][0].raise_error()

            def move() -> None:  # (numpy copies overlapping spans as memmove does)
                self.bytes_at(dst_index, dst, nbytes)[:] = self.bytes_at(src_index, src, nbytes)
            self._copy(dst_index, stream, "copy_d2d", move)

    def memset(self, index: int, ptr: int, value: int, nbytes: int,
               stream: RefStream | None = None) -> None:
        if nbytes:
            self._copy(index, stream, "memset", lambda: self.bytes_at(index, ptr, nbytes)
                       .fill(value & 0xFF))

    # ---- streams ------------------------------------------------------------------------
    def _q(self, index: int, stream: RefStream | None) -> RefStream:
        if stream is None:
            self._device(index)
            return self.streams[index][0]
        return stream

    def launch(self, index: int, stream: RefStream | None, fn: Callable[[], Any],
               name: str = "") -> None:
        q = self._q(index, stream)
        if self._fire("kernel_raise_after"):
            def fn() -> None:  # noqa: F811  (the injected failure replaces the kernel)
                raise RefDeviceError(f"ref:{index}: kernel fault (injected by "
                                     f"RefRuntime.faults.kernel_raise_after)")
        ticket = q.submit(fn, name)
        if settings.get("TORCHPORT_LAUNCH_BLOCKING"):  # the error at the op
            q.wait(ticket)
            q.raise_error()

    def create_stream(self, index: int, priority: int = 0) -> RefStream:
        self._device(index)
        with self.lock:
            sid, self._next_sid = self._next_sid, self._next_sid + 1
            s = RefStream(self, index, sid, priority)
            self.streams[index].append(s)
            return s

    def destroy_stream(self, index: int, stream: RefStream) -> None:
        stream.wait()
        stream.close()
        with self.lock:
            if stream in self.streams[index]:
                self.streams[index].remove(stream)

    def synchronize_stream(self, index: int, stream: RefStream | None) -> None:
        q = self._q(index, stream)
        q.wait()
        q.raise_error()

    def synchronize(self, index: int) -> None:
        with self.lock:
            queues = list(self.streams[index])
        for q in queues:
            q.wait()
        for q in queues:
            q.raise_error()

    def query_stream(self, index: int, stream: RefStream | None) -> bool:
        return self._q(index, stream).done()

    # ---- events -------------------------------------------------------------------------
    def create_event(self, index: int, enable_timing: bool = False,
                     blocking: bool = False) -> RefEvent:
        self._device(index)
        return RefEvent(index, enable_timing)

    def record_event(self, index: int, event: RefEvent, stream: RefStream | None) -> None:
        q = self._q(index, stream)
        if not event.enable_timing:  # the work queued so far: no marker of its own to run
            with q.cv:
                event.stream, event.ticket, event.time = q, q.submitted, None
            return
        mark = object()
        event.time, event.mark = None, mark

        def reached() -> None:
            if event.mark is mark:
                event.time = time.perf_counter()
        event.stream, event.ticket = q, q.submit(reached, "record_event")

    def stream_wait_event(self, index: int, stream: RefStream | None, event: RefEvent) -> None:
        src, ticket = event.stream, event.ticket
        q = self._q(index, stream)
        if src is None or src is q:
            return  # never recorded, or the same queue: issue order already holds

        def wait() -> None:
            src.wait(ticket)
            if src.ran < ticket:
                raise RefDeviceError(f"ref: {q.label} waited for an event on {src.label}, "
                                     f"whose worker died before reaching it")
        q.submit(wait, "stream_wait_event")

    def synchronize_event(self, index: int, event: RefEvent) -> None:
        if event.stream is not None:
            event.stream.wait(event.ticket)
            event.stream.raise_error()

    def query_event(self, index: int, event: RefEvent) -> bool:
        return event.stream is None or event.stream.done(event.ticket)

    def event_elapsed_time(self, index: int, start: RefEvent, end: RefEvent) -> float:
        for e in (start, end):
            if not e.enable_timing:
                raise RuntimeError("Both events must be created with enable_timing=True to "
                                   "measure elapsed time")
            if e.stream is None:
                raise RuntimeError("Both events must be recorded before calculating elapsed "
                                   "time")
            if not e.stream.done(e.ticket):
                raise RuntimeError("ref: an event has not completed yet: synchronize it "
                                   "before measuring elapsed time (CUDA's cudaErrorNotReady)")
            if e.time is None:
                raise RefDeviceError("ref: an event's marker never ran (its stream's worker "
                                     "died); record it again")
        return (end.time - start.time) * 1000.0

    # ---- exit ---------------------------------------------------------------------------
    def _drain(self) -> None:
        """At exit: let the queues finish (dropped after Ctrl-C), then run any later work in
        the caller -- a finalising interpreter no longer schedules the workers -- and print
        failures no synchronising call reported."""
        queues = [q for qs in self.streams for q in qs]
        if not isinstance(getattr(sys, "last_value", None), KeyboardInterrupt):
            try:
                for q in queues:
                    q.wait()
            except KeyboardInterrupt:
                pass
        for q in queues:
            with q.cv:
                q.inline = True
                q.items.clear()
                q.completed = q.submitted
                q.cv.notify_all()
            if q.error is not None:
                name, exc = q.error
                print(f"torchport: ref: {name or 'work'} failed asynchronously on {q.label} and "
                      f"no synchronising call reported it before exit: "
                      f"{type(exc).__name__}: {exc}", file=sys.stderr)
