"""The discrete-memory recipe of docs/vendor-guide.md: device "recipe", the shortest correct
backend whose memory the host cannot address, with asynchronous queues (one worker thread
per stream, the default stream too) and three kernels. Importing it registers the device:
    python -m torchport.tools.conformance --backend examples.discrete_recipe.backend --subset
"""

from __future__ import annotations

import atexit
import bisect
import ctypes
import queue
import threading
import time

import torch

import torchport
from torchport.ops import Decline, KernelSet

GiB = 1 << 30


class Stream:  # an in-order queue, run by its own worker thread
    def __init__(self) -> None:
        self.q, self.error, self.inline = queue.Queue(), None, False
        threading.Thread(target=self._work, daemon=True).start()

    def _work(self) -> None:
        while (fn := self.q.get()) is not None:
            self._run(fn)
            self.q.task_done()

    def _run(self, fn) -> None:
        try:
            fn()
        except Exception as e:  # reported at the next synchronising call, as CUDA does
            self.error = self.error or e

    def submit(self, fn) -> None:
        self._run(fn) if self.inline else self.q.put(fn)  # inline: at exit, no workers run

    def sync(self) -> None:
        self.q.join()
        error, self.error = self.error, None
        if error is not None:
            raise RuntimeError(f"recipe: queued work failed: {error}") from error


class Event:
    def __init__(self) -> None:
        self.done, self.stream, self.time = threading.Event(), None, None
        self.done.set()


class RecipeRuntime(torchport.Runtime):
    host_addressable = False
    asynchronous = True

    def __init__(self) -> None:
        self.blocks, self.bases, self.next = {}, [], 1 << 40  # address -> uint8 CPU tensor
        self.streams, self.lock = [Stream()], threading.Lock()  # [0]: the default stream
        atexit.register(self._drain)

    def device_count(self):
        return 1

    def get_device_properties(self, index):
        return torchport.DeviceProperties(name="recipe device", total_memory=GiB)

    def malloc(self, index, nbytes):
        with self.lock:
            if self.mem_get_info(index)[0] < nbytes:
                return None  # full: torchport's caching allocator frees its cache, retries
            ptr, self.next = self.next, self.next + -(-nbytes // 256) * 256
            self.blocks[ptr] = torch.empty(nbytes, dtype=torch.uint8)
            bisect.insort(self.bases, ptr)
            return ptr

    def free(self, index, ptr):
        with self.lock:
            del self.blocks[ptr]
            self.bases.remove(ptr)

    def mem_get_info(self, index):
        return GiB - sum(b.numel() for b in self.blocks.values()), GiB

    def view(self, ptr, shape, stride, dtype):  # the device reaching its own memory
        with self.lock:
            base = self.bases[bisect.bisect_right(self.bases, ptr) - 1]
            block = self.blocks[base]
        return torch.empty(0, dtype=dtype).set_(block.untyped_storage(),
                                                (ptr - base) // dtype.itemsize, shape, stride)

    def _host(self, ptr):  # the host address of a device byte, for the device's own work
        return self.view(ptr, (1,), (1,), torch.uint8).data_ptr()

    def _do(self, stream, nbytes, work):
        if nbytes and stream is None:  # after the default queue's work, complete on return
            self.synchronize_stream(0, None)
            work()
        elif nbytes:
            stream.submit(work)

    def copy_h2d(self, index, dst, src_host, nbytes, stream=None):
        self._do(stream, nbytes, lambda: ctypes.memmove(self._host(dst), src_host, nbytes))

    def copy_d2h(self, index, dst_host, src, nbytes, stream=None):
        self._do(stream, nbytes, lambda: ctypes.memmove(dst_host, self._host(src), nbytes))

    def copy_d2d(self, dst_index, dst, src_index, src, nbytes, stream=None):
        self._do(stream, nbytes, lambda: ctypes.memmove(self._host(dst), self._host(src), nbytes))

    def memset(self, index, ptr, value, nbytes, stream=None):
        self._do(stream, nbytes, lambda: ctypes.memset(self._host(ptr), value, nbytes))

    # ---- streams and events ----
    def _q(self, stream):
        return self.streams[0] if stream is None else stream

    def launch(self, index, stream, fn, name=""):
        self._q(stream).submit(fn)

    def synchronize_stream(self, index, stream):
        self._q(stream).sync()

    def synchronize(self, index):
        for s in list(self.streams):
            s.sync()

    def query_stream(self, index, stream):
        return self._q(stream).q.unfinished_tasks == 0

    def create_stream(self, index, priority=0):
        with self.lock:
            self.streams.append(Stream())
            return self.streams[-1]

    def destroy_stream(self, index, stream):
        stream.sync()
        stream.q.put(None)  # its worker ends
        with self.lock:
            self.streams.remove(stream)

    def create_event(self, index, enable_timing=False, blocking=False):
        return Event()

    def record_event(self, index, event, stream):
        done = event.done = threading.Event()  # a new marker: the old one's waiters keep theirs
        event.stream = self._q(stream)
        event.stream.submit(lambda: (setattr(event, "time", time.perf_counter()), done.set()))

    def stream_wait_event(self, index, stream, event):
        if event.stream is not None and event.stream is not self._q(stream):
            self._q(stream).submit(event.done.wait)

    def synchronize_event(self, index, event):
        if event.stream is not None:
            event.stream.sync()

    def query_event(self, index, event):
        return event.done.is_set()

    def event_elapsed_time(self, index, start, end):
        return (end.time - start.time) * 1000.0

    def _drain(self):  # at exit: finish the queues, then run later work in the caller
        for s in self.streams:
            s.q.join()
            s.inline = True


# ---- kernels: read addresses and layouts now, compute on the device's memory later ----
runtime = RecipeRuntime()
kernels = KernelSet("recipe")
DTYPES = [torch.float32, torch.float64, torch.int64]


def _at_launch(t):
    """What the queued work reads for ``t``: the device's memory where it lies; a CPU
    number's value now (the host may change it before the queue gets there)."""
    if not isinstance(t, torch.Tensor) or t.device.type == "cpu":
        value = t.clone() if isinstance(t, torch.Tensor) else t
        return lambda: value
    if t.numel() == 0:
        return lambda: torch.empty(t.shape, dtype=t.dtype)
    where = torchport.device_address(t), t.shape, t.stride(), t.dtype
    return lambda: runtime.view(*where)


def _launch(out, compute, *inputs, **kw):
    reads, target = [_at_launch(t) for t in inputs], _at_launch(out)
    torchport.launch(out, lambda: compute(*[r() for r in reads], **kw, out=target()), "recipe")
    return out


@kernels.out_kernel("add.out", dtypes=DTYPES)
def add_out(self, other, *, alpha=1, out):
    return _launch(out, torch.add, self, other, alpha=alpha)


@kernels.out_kernel("mul.out", dtypes=DTYPES)
def mul_out(self, other, *, out):
    return _launch(out, torch.mul, self, other)


@kernels.kernel("copy_")
def copy_(self, src, non_blocking=False):  # every same-device copy: layouts, dtypes
    if src.device != self.device:
        raise Decline("to or from another device: torchport's copies")
    return _launch(self, lambda s, out: out.copy_(s), src)


if torchport.current_backend() is None:  # importing twice registers once
    torchport.Backend("recipe", runtime, [kernels]).register()
