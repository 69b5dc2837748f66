"""A backend written from docs/vendor-guide.md alone: device "walk".

Device-only memory (fake addresses over ctypes blocks: every byte moves through the
runtime's copies), streams as in-order queues run when the host synchronises (the default
stream is one of them: a ``stream=None`` copy runs after its queued work), and four out=
kernels launched on the current stream. Importing this module registers the device:
    python -m torchport.tools.conformance --backend examples.vendor_walkthrough.backend --subset
"""

from __future__ import annotations

import bisect
import ctypes
import threading
import time

import torch

import torchport
from torchport.ops import KernelSet

GiB = 1 << 30


class Queue:  # a stream: work appended by the host, run in order when it synchronises
    def __init__(self) -> None:
        self.work, self.error = [], None


class Event:
    def __init__(self, enable_timing: bool) -> None:
        self.enable_timing, self.queue, self.timestamp = enable_timing, None, None


class WalkRuntime(torchport.Runtime):
    host_addressable = False
    asynchronous = True

    def __init__(self, devices: int = 2) -> None:
        self.blocks = [{} for _ in range(devices)]  # address -> ctypes buffer
        self.bases = [[] for _ in range(devices)]
        self.next = [(i + 1) << 40 for i in range(devices)]
        self.queues = [[Queue()] for _ in range(devices)]  # [0]: the default stream
        self.lock = threading.RLock()  # autograd's threads launch too

    def device_count(self) -> int:
        return len(self.blocks)

    def get_device_properties(self, index):
        return torchport.DeviceProperties(name="walkthrough device", total_memory=GiB)

    def malloc(self, index, nbytes):
        with self.lock:
            ptr, self.next[index] = self.next[index], self.next[index] + -(-nbytes // 256) * 256
            self.blocks[index][ptr] = (ctypes.c_char * nbytes)()
            bisect.insort(self.bases[index], ptr)
            return ptr

    def free(self, index, ptr):
        with self.lock:
            del self.blocks[index][ptr]
            self.bases[index].remove(ptr)

    def mem_get_info(self, index):
        return GiB - sum(map(ctypes.sizeof, self.blocks[index].values())), GiB

    def _at(self, index, ptr, nbytes):  # the device reaching its own memory
        base = self.bases[index][bisect.bisect_right(self.bases[index], ptr) - 1]
        if ptr - base + nbytes > ctypes.sizeof(self.blocks[index][base]):
            raise RuntimeError(f"walk: illegal address {ptr:#x} (+{nbytes}) on device {index}")
        return ctypes.addressof(self.blocks[index][base]) + ptr - base

    def read(self, index, dst_host, src, nbytes):  # the device's own access (kernels)
        ctypes.memmove(dst_host, self._at(index, src, nbytes), nbytes)

    def write(self, index, dst, src_host, nbytes):
        ctypes.memmove(self._at(index, dst, nbytes), src_host, nbytes)

    def _do(self, index, stream, fn):
        """A copy or memset: on a stream, queued; with ``None``, after the default queue's
        work (the default stream is a stream) and complete on return."""
        if stream is None:
            self.synchronize_stream(index, None)
            fn()
        else:
            self.launch(index, stream, fn)

    def copy_h2d(self, index, dst, src_host, nbytes, stream=None):
        self._do(index, stream, lambda: self.write(index, dst, src_host, nbytes))

    def copy_d2h(self, index, dst_host, src, nbytes, stream=None):
        self._do(index, stream, lambda: self.read(index, dst_host, src, nbytes))

    def copy_d2d(self, dst_index, dst, src_index, src, nbytes, stream=None):
        self._do(dst_index, stream, lambda: ctypes.memmove(
            self._at(dst_index, dst, nbytes), self._at(src_index, src, nbytes), nbytes))

    def memset(self, index, ptr, value, nbytes, stream=None):
        self._do(index, stream, lambda: ctypes.memset(self._at(index, ptr, nbytes), value, nbytes))

    # ---- streams and events: in-order queues ----
    def _q(self, index, stream):
        return self.queues[index][0] if stream is None else stream

    def launch(self, index, stream, fn, name=""):
        with self.lock:
            self._q(index, stream).work.append(fn)

    def _run(self, q):
        with self.lock:
            work, q.work = q.work, []
            for fn in work:
                try:
                    fn()
                except Exception as e:  # reported at the next synchronising call
                    q.error = q.error or e

    def synchronize_stream(self, index, stream):
        q = self._q(index, stream)
        self._run(q)
        error, q.error = q.error, None
        if error is not None:
            raise RuntimeError(f"walk: queued work failed on device {index}: {error}") from error

    def synchronize(self, index):
        for q in list(self.queues[index]):
            self.synchronize_stream(index, q)

    def query_stream(self, index, stream):
        self._run(self._q(index, stream))
        return True

    def create_stream(self, index, priority=0):
        with self.lock:
            self.queues[index].append(Queue())
            return self.queues[index][-1]

    def destroy_stream(self, index, stream):
        self.synchronize_stream(index, stream)
        with self.lock:
            self.queues[index].remove(stream)

    def create_event(self, index, enable_timing=False, blocking=False):
        return Event(enable_timing)

    def record_event(self, index, event, stream):
        event.queue, event.timestamp = self._q(index, stream), None
        self.launch(index, stream, lambda: setattr(event, "timestamp", time.perf_counter()))

    def query_event(self, index, event):  # run the marker's queue: it has completed
        if event.queue is not None:
            self._run(event.queue)
        return True

    def stream_wait_event(self, index, stream, event):  # the marker's work runs now: first
        if event.queue is not None:
            self._run(event.queue)

    def synchronize_event(self, index, event):
        if event.queue is not None:
            self.synchronize_stream(index, event.queue)

    def event_elapsed_time(self, index, start, end):
        if not (start.enable_timing and end.enable_timing):
            raise RuntimeError("Both events must be created with enable_timing=True")
        return (end.timestamp - start.timestamp) * 1000.0


# ---- kernels: device work on the current stream, reading and writing through copies ----
runtime = WalkRuntime()
kernels = KernelSet("walk")
DTYPES = [torch.float32, torch.float64, torch.int64]


def _reader(t):
    """At launch: what the queued work needs to read ``t`` (Python and CPU numbers too)."""
    if not isinstance(t, torch.Tensor) or t.device.type == "cpu":
        value = t.clone() if isinstance(t, torch.Tensor) else t
        return lambda: value
    index, addr, shape, stride, dtype = (torchport.device_index(t), torchport.device_address(t),
                                         t.shape, t.stride(), t.dtype)
    n = (sum((k - 1) * s for k, s in zip(shape, stride, strict=True)) + 1) * t.element_size() \
        if t.numel() else 0

    def read():
        buf = torch.empty(n, dtype=torch.uint8)
        if n:
            runtime.read(index, buf.data_ptr(), addr, n)  # the device reading its memory
        return buf.view(dtype).as_strided(shape, stride) if n else torch.empty(shape, dtype=dtype)
    read.write = lambda host: n and runtime.write(index, addr, host.data_ptr(), n)
    return read


def _launch(out, compute, *inputs):
    reads, target = [_reader(t) for t in inputs], _reader(out)

    def work():
        host = target()  # read-modify-write: the bytes between strided elements stay
        host.copy_(compute(*[r() for r in reads]))
        target.write(host.untyped_storage())
    torchport.launch(out, work, "walk kernel")


@kernels.out_kernel("add.out", dtypes=DTYPES)
def add_out(self, other, *, alpha=1, out):
    _launch(out, lambda a, b: torch.add(a, b, alpha=alpha), self, other)


@kernels.out_kernel("mul.out", dtypes=DTYPES)
def mul_out(self, other, *, out):
    _launch(out, torch.mul, self, other)


@kernels.out_kernel("mm.out", dtypes=DTYPES)
def mm_out(self, mat2, *, out):
    _launch(out, torch.mm, self, mat2)


@kernels.out_kernel("sum.IntList_out", dtypes=DTYPES)
def sum_out(self, dim, keepdim=False, *, dtype=None, out):
    _launch(out, lambda a: torch.sum(a, dim, keepdim, dtype=dtype), self)


if torchport.current_backend() is None:  # importing twice registers once
    torchport.Backend("walk", runtime, [kernels]).register()
