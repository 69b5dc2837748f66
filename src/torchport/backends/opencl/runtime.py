"""The OpenCL runtime: torchport's :class:`~torchport.runtime.Runtime` over pyopencl.

A device with memory the host cannot read: each device has one OpenCL context, its
streams are in-order command queues, events are markers in them (queues profile, so
``elapsed_time`` is the device's own clock), and memory is OpenCL buffers behind integer
addresses. torchport needs addresses (a storage offset is an address plus bytes), and
OpenCL gives opaque buffer handles: :meth:`OpenCLRuntime.malloc` hands out addresses from
a per-device range and a segment table maps any address inside a block back to
``(buffer, byte offset)`` (:meth:`OpenCLRuntime.locate`), which is what a kernel gets as
arguments -- no sub-buffers, whose offsets OpenCL restricts to the device's alignment.

Device-side errors: a kernel that finds a bad index (``index_select``, ``gather``,
``scatter_add``, embedding's backward) neither reads nor writes there; it records the first
one in its device's error word (:meth:`OpenCLRuntime.error_word`: which op, which index,
the valid range) and goes on, as CUDA's device-side assert stops a kernel without stopping
the host. The host learns of it at the next synchronisation -- a stream, device or event
synchronisation, a blocking copy to the host (``.cpu()``, ``.item()``, printing) -- which
raises :class:`DeviceIndexError` (an ``IndexError`` too where the CPU raises one) and
clears the word, so the device stays usable.

Memory shared between processes: none. OpenCL has no IPC handles for buffers, so the
runtime keeps :class:`~torchport.runtime.Runtime`'s ``malloc_shareable``/``ipc_export``/
``ipc_open`` defaults, and an ``ocl`` tensor sent to another process (``torch.multiprocessing``)
raises ``torchport.device.sharing.DeviceSharingError``, naming the backend and saying to move it
to the CPU first.
"""

from __future__ import annotations

import bisect
import ctypes
import threading
import warnings
from typing import Any

import numpy as np
import pyopencl as cl
import torch

from torchport.core import settings
from torchport.kernel_api import current_backend
from torchport.runtime import DeviceProperties, Runtime

_ALIGN = 256
_SPAN = 1 << 44  # address range of one device
_LOCATED = 1 << 16  # locate's remembered answers per device before it starts again
# the error word: int flag (its first 4 bytes), then op code, bad index, extent, dimension
_WORD = 5
# OpenCL C of the kernels that check indices: the first bad index wins the flag
REPORT_INDEX = """inline void report_index(__global long* err, long op, long dim, long bad, long ext) {
  if (atomic_cmpxchg((volatile __global int*)err, 0, 1) == 0) {
    err[1] = op; err[2] = bad; err[3] = ext; err[4] = dim;
  }
}
"""


class DeviceIndexError(torch.AcceleratorError):
    """An index a kernel found out of range, reported at the next synchronisation (a
    ``RuntimeError``, as CUDA's device-side assert)."""


class DeviceIndexLookupError(DeviceIndexError, IndexError):
    """:class:`DeviceIndexError` of an op whose CPU kernel raises ``IndexError``
    (``index_select``, so ``embedding``), so that code catching the CPU's error catches it."""


class Queue:
    """A stream: an in-order command queue, the first error of work launched on it, and
    whether a kernel queued there since its last synchronisation checks indices."""

    __slots__ = ("armed", "error", "queue")

    def __init__(self, queue: cl.CommandQueue) -> None:
        self.queue = queue
        self.error: BaseException | None = None
        self.armed = False


class Marker:
    """An event: the marker last recorded on a queue (``None`` until recorded)."""

    __slots__ = ("enable_timing", "index", "marker")

    def __init__(self, index: int, enable_timing: bool) -> None:
        self.index, self.enable_timing = index, enable_timing
        self.marker: cl.Event | None = None


def build_program(context: cl.Context, source: str, options: list[str]) -> cl.Program:
    """``source`` compiled for ``context``. The driver's diagnostics of a build that
    succeeded (pyopencl's ``CompilerWarning``: "Non-empty compiler output encountered") are
    the backend's, not the user's: they are not warned; a failed build still raises."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cl.CompilerWarning)
        return cl.Program(context, source).build(options)


def select_devices() -> list[cl.Device]:
    """The OpenCL devices ``TORCHPORT_OPENCL_PLATFORM`` / ``TORCHPORT_OPENCL_DEVICES`` pick
    (default: every device of the first platform that has one)."""
    try:
        platforms = cl.get_platforms()
    except cl.Error:  # the ICD loader found no platform at all
        platforms = []
    want = settings.get("TORCHPORT_OPENCL_PLATFORM")
    if want is not None:
        chosen = [p for i, p in enumerate(platforms)
                  if want.strip() == str(i) or want.lower() in p.name.lower()][:1]
    else:
        chosen = [p for p in platforms if _devices_of(p)][:1]
    devices = _devices_of(chosen[0]) if chosen else []
    picked = settings.get("TORCHPORT_OPENCL_DEVICES")
    if picked is not None:
        devices = [devices[int(i)] for i in picked if i.isdigit() and int(i) < len(devices)]
    return devices


def _devices_of(platform: cl.Platform) -> list[cl.Device]:
    try:
        return platform.get_devices()
    except cl.Error:  # CL_DEVICE_NOT_FOUND
        return []


class OpenCLRuntime(Runtime):
    """Every selected OpenCL device as a torchport device (asynchronous, device-only memory)."""

    host_addressable = False
    asynchronous = True

    def __init__(self, devices: list[cl.Device] | None = None) -> None:
        self.devices = select_devices() if devices is None else devices
        self.contexts = [cl.Context([d]) for d in self.devices]
        self.default = [self._new_queue(i) for i in range(len(self.devices))]
        self.created: list[list[Queue]] = [[] for _ in self.devices]  # streams
        self.blocks: list[dict[int, cl.Buffer]] = [{} for _ in self.devices]
        self.bases: list[list[int]] = [[] for _ in self.devices]
        self.sizes: list[dict[int, int]] = [{} for _ in self.devices]
        # locate's answers per address: (buffer, offset, bytes to the block's end), forgotten
        # when a block is freed (addresses are never handed out twice)
        self.located: list[dict[int, tuple[cl.Buffer, int, int]]] = [{} for _ in self.devices]
        self.next = [(i + 1) * _SPAN for i in range(len(self.devices))]
        self.used = [0 for _ in self.devices]
        self.lock = threading.RLock()  # autograd's threads allocate and launch too
        self.fp64 = [_has(d, "cl_khr_fp64") for d in self.devices]
        self.fp16 = [_has(d, "cl_khr_fp16") for d in self.devices]
        # the error words (created on first use) and a queue of their own to read them
        self.words: list[cl.Buffer | None] = [None for _ in self.devices]
        self.checkers: list[cl.CommandQueue | None] = [None for _ in self.devices]
        self.error_ops: list[tuple[str, bool]] = []  # (op, the CPU raises IndexError)

    def _new_queue(self, index: int) -> Queue:
        props = cl.command_queue_properties.PROFILING_ENABLE
        return Queue(cl.CommandQueue(self.contexts[index], self.devices[index], properties=props))

    # ---- devices ----
    def device_count(self) -> int:
        return len(self.devices)

    def get_device_properties(self, index: int) -> DeviceProperties:
        d = self.devices[index]
        # CUDA's thread model in OpenCL's terms: a compute unit holds at least one work-group
        # of max_work_group_size work-items; a warp is the vendor's (NVIDIA's warp, AMD's
        # wavefront) or else the float lanes the device prefers (a CPU driver's SIMD width)
        return DeviceProperties(name=d.name.strip(), total_memory=d.global_mem_size,
                                multi_processor_count=d.max_compute_units,
                                max_threads_per_block=d.max_work_group_size,
                                max_threads_per_multi_processor=d.max_work_group_size,
                                warp_size=_warp_size(d),
                                is_integrated=int(bool(_query(d, "host_unified_memory", 0))),
                                L2_cache_size=d.global_mem_cache_size,
                                clock_rate=d.max_clock_frequency * 1000,  # kHz, as CUDA's
                                shared_memory_per_block=d.local_mem_size,
                                shared_memory_per_multiprocessor=d.local_mem_size,
                                extra={"platform": d.platform.name, "opencl": d.version})

    # ---- memory ----
    def malloc(self, index: int, nbytes: int) -> int | None:
        d = self.devices[index]
        if nbytes > d.max_mem_alloc_size or self.used[index] + nbytes > d.global_mem_size:
            return None
        try:
            buf = cl.Buffer(self.contexts[index], cl.mem_flags.READ_WRITE, nbytes)
        except cl.MemoryError:
            return None
        with self.lock:
            ptr = self.next[index]
            self.next[index] += -(-nbytes // _ALIGN) * _ALIGN
            self.blocks[index][ptr] = buf
            self.sizes[index][ptr] = nbytes
            bisect.insort(self.bases[index], ptr)
            self.used[index] += nbytes
        return ptr

    def free(self, index: int, ptr: int) -> None:
        with self.lock:
            buf = self.blocks[index].pop(ptr)
            self.bases[index].remove(ptr)
            self.used[index] -= self.sizes[index].pop(ptr)
            self.located[index].clear()
        buf.release()

    def mem_get_info(self, index: int) -> tuple[int, int]:
        total = self.devices[index].global_mem_size
        return total - self.used[index], total

    def locate(self, index: int, ptr: int, nbytes: int = 1) -> tuple[cl.Buffer, int]:
        """The buffer holding device address ``ptr`` and the byte offset in it; raises for
        an address no live block covers (``nbytes`` from it). Answers are remembered per
        address until a block is freed: every kernel launch asks, for each of its tensors."""
        hit = self.located[index].get(ptr)
        if hit is not None and nbytes <= hit[2]:
            return hit[0], hit[1]
        bases = self.bases[index]
        with self.lock:
            i = bisect.bisect_right(bases, ptr) - 1
            base = bases[i] if i >= 0 else None
            if base is None or ptr - base + nbytes > self.sizes[index][base]:
                raise RuntimeError(f"ocl: illegal address {ptr:#x} (+{nbytes} bytes) on device "
                                   f"{index}: no live block holds it")
            buf, off = self.blocks[index][base], ptr - base
            located = self.located[index]
            if len(located) >= _LOCATED:
                located.clear()
            located[ptr] = (buf, off, self.sizes[index][base] - off)
            return buf, off

    def queue(self, index: int, stream: Queue | None) -> cl.CommandQueue:
        return (self.default[index] if stream is None else stream).queue

    # ---- copies ----
    def copy_h2d(self, index: int, dst: int, src_host: int, nbytes: int,
                 stream: Queue | None = None) -> None:
        buf, off = self.locate(index, dst, nbytes)
        cl.enqueue_copy(self.queue(index, stream), buf, _host(src_host, nbytes),
                        dst_offset=off, is_blocking=stream is None)

    def copy_d2h(self, index: int, dst_host: int, src: int, nbytes: int,
                 stream: Queue | None = None) -> None:
        buf, off = self.locate(index, src, nbytes)
        cl.enqueue_copy(self.queue(index, stream), _host(dst_host, nbytes), buf,
                        src_offset=off, is_blocking=stream is None)
        if stream is None:  # the host reads device results: report a bad index first
            self.check_errors(index, ())

    def copy_d2d(self, dst_index: int, dst: int, src_index: int, src: int, nbytes: int,
                 stream: Queue | None = None) -> None:
        dbuf, doff = self.locate(dst_index, dst, nbytes)
        sbuf, soff = self.locate(src_index, src, nbytes)
        q = self.queue(dst_index, stream)
        if dst_index == src_index:
            cl.enqueue_copy(q, dbuf, sbuf, byte_count=nbytes, src_offset=soff, dst_offset=doff)
            if stream is None:
                q.finish()
            return
        # two contexts: through the host (the source's queued work first)
        staging = np.empty(nbytes, np.uint8)
        cl.enqueue_copy(self.default[src_index].queue, staging, sbuf, src_offset=soff)
        cl.enqueue_copy(q, dbuf, staging, dst_offset=doff, is_blocking=True)

    def memset(self, index: int, ptr: int, value: int, nbytes: int,
               stream: Queue | None = None) -> None:
        buf, off = self.locate(index, ptr, nbytes)
        q = self.queue(index, stream)
        cl.enqueue_fill_buffer(q, buf, np.uint8(value), off, nbytes)
        if stream is None:
            q.finish()

    # ---- streams ----
    def launch(self, index: int, stream: Queue | None, fn: Any, name: str = "") -> None:
        """Host-side work in queue order (a Python kernel): the queue drains, then ``fn``
        runs; its error is reported at the stream's next synchronisation."""
        q = self.default[index] if stream is None else stream
        q.queue.finish()
        try:
            fn()
        except Exception as e:  # reported at the next synchronising call
            e.add_note(f"in {name or 'work'} launched on ocl:{index}")
            q.error = q.error or e

    def synchronize(self, index: int) -> None:
        for q in [self.default[index], *self.created[index]]:
            self.synchronize_stream(index, q)

    def create_stream(self, index: int, priority: int = 0) -> Queue:
        q = self._new_queue(index)
        with self.lock:
            self.created[index].append(q)
        return q

    def destroy_stream(self, index: int, stream: Queue) -> None:
        self.synchronize_stream(index, stream)
        with self.lock:
            self.created[index].remove(stream)

    def synchronize_stream(self, index: int, stream: Queue | None) -> None:
        q = self.default[index] if stream is None else stream
        q.queue.finish()
        error, q.error = q.error, None
        if error is not None:
            raise RuntimeError(f"ocl: work queued on device {index} failed: {error}") from error
        self.check_errors(index, (q,))

    def query_stream(self, index: int, stream: Queue | None) -> bool:
        q = self.queue(index, stream)
        marker = cl.enqueue_marker(q)
        q.flush()
        return marker.command_execution_status == cl.command_execution_status.COMPLETE

    # ---- events ----
    def create_event(self, index: int, enable_timing: bool = False,
                     blocking: bool = False) -> Marker:
        return Marker(index, enable_timing)

    def record_event(self, index: int, event: Marker, stream: Queue | None) -> None:
        q = self.queue(index, stream)
        event.index, event.marker = index, cl.enqueue_marker(q)
        q.flush()

    def stream_wait_event(self, index: int, stream: Queue | None, event: Marker) -> None:
        if event.marker is None:
            return
        if event.index == index:  # one context: the queue waits, not the host
            cl.enqueue_barrier(self.queue(index, stream), wait_for=[event.marker])
        else:
            event.marker.wait()

    def synchronize_event(self, index: int, event: Marker) -> None:
        if event.marker is not None:
            event.marker.wait()
        self.check_errors(index, ())

    def query_event(self, index: int, event: Marker) -> bool:
        return event.marker is None or \
            event.marker.command_execution_status == cl.command_execution_status.COMPLETE

    def event_elapsed_time(self, index: int, start: Marker, end: Marker) -> float:
        if not (start.enable_timing and end.enable_timing):
            raise RuntimeError("Both events must be created with enable_timing=True to "
                               "measure elapsed time")
        if start.marker is None or end.marker is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time")
        end.marker.wait()
        return (end.marker.profile.end - start.marker.profile.end) / 1e6


    # ---- device-side errors ----
    def error_word(self, index: int, stream: Queue | None, op: str,
                   lookup: bool = False) -> tuple[cl.Buffer, int]:
        """The error word of device ``index`` and ``op``'s code, for a kernel about to be
        queued on ``stream`` that checks its indices (:data:`REPORT_INDEX`); the stream's
        next synchronisation reads the word. ``lookup``: the CPU raises ``IndexError`` for
        ``op`` (:class:`DeviceIndexLookupError`)."""
        with self.lock:
            if self.words[index] is None:
                self.checkers[index] = cl.CommandQueue(self.contexts[index], self.devices[index])
                word = cl.Buffer(self.contexts[index], cl.mem_flags.READ_WRITE, _WORD * 8)
                cl.enqueue_fill_buffer(self.checkers[index], word, np.uint8(0), 0, _WORD * 8)
                self.checkers[index].finish()
                self.words[index] = word
            if (op, lookup) not in self.error_ops:
                self.error_ops.append((op, lookup))
            (self.default[index] if stream is None else stream).armed = True
            return self.words[index], self.error_ops.index((op, lookup))

    def check_errors(self, index: int, finished: tuple[Queue, ...]) -> None:
        """Raise :class:`DeviceIndexError` for the first bad index a kernel of device ``index``
        recorded, and clear it. Costs nothing until a kernel that checks indices was queued;
        ``finished``: queues whose work has all run (none of theirs can report later)."""
        queues = (self.default[index], *self.created[index])
        if not any(q.armed for q in queues):
            return
        word = np.zeros(_WORD, np.int64)
        with self.lock:
            checker = self.checkers[index]
            cl.enqueue_copy(checker, word, self.words[index], is_blocking=True)
            for q in finished:
                q.armed = False
            if not word[0]:
                return
            cl.enqueue_fill_buffer(checker, self.words[index], np.uint8(0), 0, _WORD * 8)
            checker.finish()
        code, bad, ext, dim = (int(v) for v in word[1:])
        op, lookup = self.error_ops[code]
        valid = f"valid: 0 to {ext - 1}" if ext > 0 else "no valid index"
        raise (DeviceIndexLookupError if lookup else DeviceIndexError)(
            f"{self._name(index)}: {op}: index {bad} is out of bounds for "
            f"dimension {dim} with size {ext} ({valid}); found on the device by the op's kernel "
            f"and reported at the next synchronisation, as CUDA's device-side assert (nothing "
            f"was read or written there): fix the index, or set TORCHPORT_LAUNCH_BLOCKING=1 to "
            f"raise at the op")

    def _name(self, index: int) -> str:
        """``ocl:N`` of physical device ``index`` (``TORCHPORT_VISIBLE_DEVICES`` applied)."""
        b = current_backend()
        visible = getattr(b, "visible", None) if b is not None and b.runtime is self else None
        return f"ocl:{visible.index(index) if visible and index in visible else index}"


def _has(device: cl.Device, extension: str) -> bool:
    return extension in device.extensions.split()


def _host(address: int, nbytes: int) -> np.ndarray:
    """Host memory at ``address`` as the numpy buffer pyopencl copies to or from."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))


def _query(device: Any, name: str, default: Any) -> Any:
    """A device query a driver may not answer (a vendor extension's, or one OpenCL 3.0 made
    optional), or ``default``."""
    try:
        return getattr(device, name)
    except (cl.Error, AttributeError):
        return default


def _warp_size(device: Any) -> int:
    """The device's lock-step width: an NVIDIA warp or an AMD wavefront where the driver
    reports one, else its preferred float vector width (at least 1)."""
    width = (_query(device, "warp_size_nv", 0) or _query(device, "wavefront_width_amd", 0)
             or device.preferred_vector_width_float)
    return max(1, int(width))
