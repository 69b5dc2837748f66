"""Caching allocator over a runtime's malloc/free, with CUDA's statistics.

Device mallocs are slow and synchronising on real hardware, so -- like PyTorch's
CUDACachingAllocator -- memory is taken from the runtime in segments, carved
into blocks, and freed blocks are kept for reuse. Sizes, pools and split rules
follow CUDA's (512-byte rounding; a small pool of 2 MiB segments for requests up
to 1 MiB; 20 MiB segments for requests up to 10 MiB; larger ones rounded to
2 MiB). Statistics use the key names of ``torch.cuda.memory_stats()``.

This module holds :class:`DeviceAllocator`, the Python allocator (its malloc, stream-aware
freeing and parking of blocks), and :func:`make_allocators`, which chooses it or the C++
one; the names other layers import from here stay here. The rest is beside it:
:mod:`~torchport.memory.blocks` (sizes, pools, blocks, segments),
:mod:`~torchport.memory.allocator_stats` (statistics, snapshots, the out-of-memory
message) and :mod:`~torchport.memory.native_allocator` (the glue to the C++ allocator).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from torchport.core import native
from torchport.memory.allocator_stats import AllocatorStatistics, format_size
from torchport.memory.blocks import (
    K_LARGE_BUFFER,
    K_MIN_BLOCK,
    K_MIN_LARGE_ALLOC,
    K_ROUND_LARGE,
    K_SMALL_BUFFER,
    K_SMALL_SIZE,
    SEGMENT_FREED,
    Block,
    _Pool,
    _segment_size,
    round_size,
)
from torchport.memory.native_allocator import (
    BlockInfo,
    NativeAllocator,
    NativeBlock,
    SegmentInfo,
    _native_allocators,
)
from torchport.runtime import Runtime

__all__ = [
    "ADOPT_MIN_BYTES",
    "K_LARGE_BUFFER",
    "K_MIN_BLOCK",
    "K_MIN_LARGE_ALLOC",
    "K_ROUND_LARGE",
    "K_SMALL_BUFFER",
    "K_SMALL_SIZE",
    "SEGMENT_FREED",
    "Block",
    "BlockInfo",
    "DeviceAllocator",
    "NativeAllocator",
    "NativeBlock",
    "SegmentInfo",
    "format_size",
    "make_allocators",
    "round_size",
]

# The most blocks parked at once, for both allocators (the C++ one reads it at each
# configure: :func:`_max_parked`).
_MAX_PARKED = 256
# Parked blocks may hold up to the peak of the bytes allocated, or this much on a device
# with little allocated: a training step's transient tensors fit, random sizes cannot
# make the cache grow without bound.
_PARK_FLOOR = 8 << 20
# Host-computed results at least this large are adopted as device memory where the
# runtime can (:meth:`DeviceAllocator.adopt`; below, copying costs less than a segment of
# its own).
ADOPT_MIN_BYTES = 1 << 20


class DeviceAllocator(AllocatorStatistics):
    """The caching allocator of one device (physical index ``phys``)."""

    def __init__(self, runtime: Runtime, phys: int, logical: int, device_name: str) -> None:
        self.runtime = runtime
        self.phys = phys
        self.logical = logical
        self.device_name = device_name
        self.lock = threading.RLock()
        self.small = _Pool()
        self.large = _Pool()
        self.active: dict[int, Block] = {}
        self.segments: dict[int, Block] = {}
        self.fraction: float | None = None
        # Freed blocks that queued work may still read or write, with the events that
        # complete when it has run: one queue per allocation stream (its events complete
        # in order, so each queue is released from its head).
        self.pending_free: dict[int, deque[tuple[Block, list[Any]]]] = {}
        # Recently freed small blocks by (stream, size): a model allocates the same
        # sizes every step, so most requests are served here in O(1) without the
        # split/merge work; any other need (best-fit miss, empty_cache, statistics,
        # snapshots) first returns them to the pool, so the allocator's behaviour
        # towards the runtime is CUDA's.
        self.parked: dict[tuple[int, int], list[Block]] = {}
        self.num_parked = 0
        self.parked_bytes = [0, 0]  # large, small
        # Set when the device had no room for a segment, until ``empty_cache``: large
        # blocks then merge when freed, as CUDA's do (parked ones would fragment a full
        # device into OOMs), and small requests unpark before they take a new segment.
        self.full = False
        # Stream-aware freeing (set by torchport.device.streams): events on every stream that
        # may still use a freed block (its allocation stream while that has queued work
        # on an asynchronous runtime, and the streams of ``record_stream``); the block is
        # handed out again once they completed, whichever path asks for memory, because
        # the host writes device memory without queueing (results it computed, copies
        # without a stream, another thread's work).
        self.free_events: Callable[[Block], list[Any]] | None = None
        self.event_query: Callable[[Any], bool] | None = None
        self.event_release: Callable[[Any], None] | None = None
        self._hot_small = True  # the pool the deferred counts below belong to
        self.reset_stats()

    # ---- allocation ------------------------------------------------------------
    def malloc(self, nbytes: int, stream: Any = None) -> Block:
        """A block of at least ``nbytes``; raises ``torch.OutOfMemoryError``."""
        size = K_MIN_BLOCK if nbytes < K_MIN_BLOCK else \
            (nbytes + K_MIN_BLOCK - 1) // K_MIN_BLOCK * K_MIN_BLOCK
        if self.num_parked:  # the hot path: an exact-size reuse
            with self.lock:
                ready = self.parked.get((id(stream), size))
                if ready:
                    block = ready.pop()
                    if block.small is not self._hot_small:
                        self._switch_hot(block.small)
                    block.parked = False
                    block.allocated = True
                    block.requested = nbytes
                    self.num_parked -= 1
                    self.parked_bytes[block.small] -= size
                    self.active[block.ptr] = block
                    self._hm = hm = self._hm + 1
                    if hm - self._hf > self._pn:
                        self._pn = hm - self._hf
                    self._hbm = hb = self._hbm + size
                    if hb - self._hbf > self._pb:
                        self._pb = hb - self._hbf
                    self._hrm = hr = self._hrm + nbytes
                    if hr - self._hrf > self._pr:
                        self._pr = hr - self._hrf
                    return block
        return self._malloc(nbytes, size, stream)

    def _malloc(self, nbytes: int, size: int, stream: Any) -> Block:
        small = size <= K_SMALL_SIZE
        pool = self.small if small else self.large
        with self.lock:
            self._flush_hot()
            if self.pending_free:
                self._process_pending_frees()
            if self.num_parked:
                ready = self.parked.get((id(stream), size))
                if ready:
                    block = ready.pop()
                    block.parked = False
                    self.num_parked -= 1
                    self.parked_bytes[block.small] -= block.size
                    return self._hand_out(block, nbytes)
            block = pool.best_fit(stream, size)
            fresh = None
            if block is None and self.num_parked:
                if small and not self.full:
                    # A new 2 MiB segment while the device has room: the parked blocks are
                    # sizes the step asks for again, and taking them apart would make them
                    # miss next time, a churn of slow allocations every step.
                    fresh = self._new_segment(size, small, stream, nbytes, retry=False)
                if fresh is None:
                    block = self._unpark_for(small, stream, size)
            if block is not None and self._oversize(block, size):
                block = None  # do not carve a small request out of a huge cached block
            if block is None:
                block = fresh or self._new_segment(size, small, stream, nbytes, retry=False) \
                    or self._from_cache(pool, stream, size, oversize=False) \
                    or self._new_segment(size, small, stream, nbytes) \
                    or self._from_cache(pool, stream, size, oversize=True)
                if block is None:
                    self.num_ooms += 1
                    raise torch.OutOfMemoryError(self._oom_message(nbytes))
            else:
                pool.remove(block)
            self._maybe_split(block, size, pool)
            return self._hand_out(block, nbytes)

    def _from_cache(self, pool: _Pool, stream: Any, size: int, oversize: bool) -> Block | None:
        """The device has no room for a new segment: a free block of ``size`` from what
        the cache holds with the parked blocks merged (one much larger than ``size``
        only if ``oversize``), or ``None``."""
        self._unpark_all()
        block = pool.best_fit(stream, size)
        if block is not None and not oversize and self._oversize(block, size):
            return None
        if block is not None:
            pool.remove(block)
        return block

    @staticmethod
    def _oversize(block: Block, size: int) -> bool:
        """Would a ``size`` request carve a huge cached block (kept for large ones)?"""
        return not block.small and block.size >= size + K_LARGE_BUFFER \
            and block.size > 2 * size

    def adopt(self, buffer: torch.UntypedStorage, stream: Any = None) -> Block | None:
        """A block over ``buffer`` (CPU memory the caller gives up) made device memory
        by the runtime (:meth:`Runtime.adopt_host`), or ``None``. It is its own segment,
        returned to the runtime when freed: results the host computed become device
        tensors without a copy."""
        nbytes = buffer.nbytes()
        with self.lock:
            self._flush_hot()
            if not self._within_fraction(nbytes):
                return None
            ptr = self.runtime.adopt_host(self.phys, buffer)
            if ptr is None:
                return None
            return self.adopt_segment(ptr, nbytes, stream)

    def adopt_segment(self, ptr: int, nbytes: int, stream: Any = None) -> Block:
        """An allocated block over ``nbytes`` at ``ptr``, memory the runtime gave outside
        the caching pools (adopted host memory, shareable or opened shared memory): its
        own segment, returned to the runtime with ``free`` when its storage dies."""
        with self.lock:
            self._flush_hot()
            self.num_device_alloc += 1
            block = Block(ptr=ptr, size=nbytes, segment_size=nbytes, small=False,
                          stream=stream, is_segment_head=True, adopted=True)
            self.segments[ptr] = block
            self._stat(False, ("segment", 1), ("reserved_bytes", nbytes))
            return self._hand_out(block, nbytes)

    def _hand_out(self, block: Block, nbytes: int) -> Block:
        small = block.small
        block.allocated = True
        block.requested = nbytes
        self.active[block.ptr] = block
        size = block.size
        for st, n in zip(self._on_alloc[small], (1, 1, 1, 1, size, size, size, size,
                                                 nbytes, nbytes), strict=True):
            st.current += n
            st.allocated += n
            if st.current > st.peak:
                st.peak = st.current
        return block

    def _maybe_split(self, block: Block, size: int, pool: _Pool) -> None:
        remaining = block.size - size
        threshold = K_MIN_BLOCK if block.small else K_SMALL_SIZE
        if remaining < threshold:
            return
        rest = Block(ptr=block.ptr + size, size=remaining, segment_size=block.segment_size,
                     small=block.small, stream=block.stream, prev=block, next=block.next)
        if block.next is not None:
            block.next.prev = rest
        block.next = rest
        block.size = size
        pool.insert(rest)

    def _within_fraction(self, nbytes: int) -> bool:
        """May ``nbytes`` more be reserved under ``set_per_process_memory_fraction``?"""
        if self.fraction is None:
            return True
        total = self.runtime.get_device_properties(self.phys).total_memory
        return self.reserved() + nbytes <= self.fraction * total

    def _device_malloc(self, seg_size: int) -> int | None:
        if not self._within_fraction(seg_size):
            return None
        return self.runtime.malloc(self.phys, seg_size)

    def _new_segment(self, size: int, small: bool, stream: Any, requested: int,
                     retry: bool = True) -> Block | None:
        """A new segment for a ``size`` request, or ``None``; without room, ``retry``
        first waits for the device, releases the blocks its work held and returns every
        free segment (``empty_cache``)."""
        seg_size = _segment_size(size)
        ptr = self._device_malloc(seg_size)
        if ptr is None:
            self.full = True
        if ptr is None and retry:
            self.num_alloc_retries += 1
            self.runtime.synchronize(self.phys)
            self._process_pending_frees(force=True)
            self._release_free_segments()
            ptr = self._device_malloc(seg_size)
        if ptr is None:
            return None
        self.num_device_alloc += 1
        block = Block(ptr=ptr, size=seg_size, segment_size=seg_size, small=small,
                      stream=stream, is_segment_head=True)
        self.segments[ptr] = block
        self._stat(small, ("segment", 1), ("reserved_bytes", seg_size))
        return block

    # ---- freeing ---------------------------------------------------------------
    def storage_died(self, ref: Any) -> None:
        """Weakref callback of a device storage (``torchport.memory.tensors.watch``): its block is
        free. Runs once per device tensor, so the common case is handled right here."""
        ptr = ref.ptr
        if ptr is None:
            return
        with self.lock:
            if self.pending_free:  # each free releases what became reusable
                self._process_pending_frees()
            block = self.active.pop(ptr)
            events = self.free_events(block) if self.free_events is not None and (
                block.stream_uses or self.runtime.asynchronous) else None
            if not events and not block.adopted and self._may_park(block):
                # the hot path: park it for an exact-size reuse (statistics deferred)
                if block.small is not self._hot_small:
                    self._switch_hot(block.small)
                block.allocated = False
                self._hf += 1
                self._hbf += block.size
                self._hrf += block.requested
                self._park(block)
                return
            self._flush_hot()
            small = block.small
            self._stat(small, ("allocation", -1), ("allocated_bytes", -block.size),
                       ("requested_bytes", -block.requested))
            if events:
                q = self.pending_free.get(id(block.stream))
                if q is None:
                    q = self.pending_free[id(block.stream)] = deque()
                q.append((block, events))
                return
            self._release_block(block)

    def _may_park(self, block: Block) -> bool:
        """Is there room among the parked blocks of ``block``'s pool for it? Up to twice
        the peak of the pool's allocated bytes (a step's transient tensors of every size
        it uses), at least :data:`_PARK_FLOOR`; on a full device only that floor, and
        no large block."""
        small = block.small
        if self.num_parked >= _MAX_PARKED or self.full and not small:
            return False
        held = self.parked_bytes[small] + block.size
        if held <= _PARK_FLOOR:
            return True
        if self.full:
            return False
        alloc = self._allocated_pool[small]  # its peak, with the hot path's pending counts
        pending = self._pb if self._hot_small is small else 0
        return held <= 2 * max(alloc.peak, alloc.current + pending)

    def _park(self, block: Block) -> None:
        """Hold a free block, unmerged, for a request of its exact size (a training step
        asks for the same sizes every step: O(1), and the same addresses, whose host views
        are cached). Parked large blocks are merged back before the large pool would grow;
        small ones only when the device has no room for a new 2 MiB segment."""
        block.parked = True
        key = (id(block.stream), block.size)
        lst = self.parked.get(key)
        if lst is None:
            self.parked[key] = [block]
        else:
            lst.append(block)
        self.num_parked += 1
        self.parked_bytes[block.small] += block.size

    def _unpark_all(self) -> None:
        """Return every parked block to its pool (merging with free neighbours)."""
        if not self.num_parked:
            return
        blocks = [b for lst in self.parked.values() for b in lst]
        self.parked.clear()
        self.num_parked = 0
        self.parked_bytes = [0, 0]
        for b in blocks:  # one at a time: a parked neighbour merges when its turn comes
            b.parked = False
            self._return_to_pool(b)

    def _unpark_for(self, small: bool, stream: Any, size: int) -> Block | None:
        """Return parked blocks of one pool and stream to it, one at a time (merging),
        until a free block of ``size`` bytes exists; that block, or ``None``. The other
        parked blocks stay parked: the sizes a step repeats keep their O(1) reuse."""
        sid = id(stream)
        for key in [k for k in self.parked if k[0] == sid]:
            lst = self.parked[key]
            while lst:
                b = lst[-1]
                if b.small is not small:
                    break  # a list holds one size: one pool
                lst.pop()
                self.num_parked -= 1
                self.parked_bytes[b.small] -= b.size
                b.parked = False
                self._return_to_pool(b)  # b grows by the free neighbours it merged
                if b.size >= size:
                    if not lst:
                        del self.parked[key]
                    return (self.small if small else self.large).best_fit(stream, size)
            if not lst:
                del self.parked[key]
        return None

    def pending_blocks(self) -> list[Block]:
        """The freed blocks waiting for queued work (oldest first per stream)."""
        with self.lock:
            return [b for q in self.pending_free.values() for b, _ in q]

    def _process_pending_frees(self, force: bool = False) -> None:
        """Release the pending blocks whose events completed (all of them: ``force``,
        after the device was synchronised)."""
        query, release = self.event_query, self.event_release
        for key, q in list(self.pending_free.items()):
            while q and (force or all(query(e) for e in q[0][1])):
                block, events = q.popleft()
                if release is not None:
                    for e in events:
                        release(e)
                self._release_block(block)
            if not q:
                del self.pending_free[key]

    def _release_block(self, block: Block) -> None:
        small = block.small
        self._stat(small, ("active", -1), ("active_bytes", -block.size))
        block.allocated = False
        if block.adopted:  # not cached: the memory goes back to the host's allocator
            del self.segments[block.ptr]
            self._release_segment(block)
            return
        if self._may_park(block):
            self._park(block)
            return
        self._return_to_pool(block)

    def _release_segment(self, head: Block) -> None:
        self.runtime.free(self.phys, head.ptr)
        for hook in SEGMENT_FREED:
            hook(head.ptr, head.size)
        self.num_device_free += 1
        self._stat(head.small, ("segment", -1), ("reserved_bytes", -head.size))

    def _return_to_pool(self, block: Block) -> None:
        pool = self.small if block.small else self.large
        for nb in (block.prev, block.next):
            # (a pending block is still ``allocated`` until its events completed)
            if nb is not None and not nb.allocated and not nb.parked \
                    and nb.ptr not in self.active:
                self._merge(block, nb, pool)
        pool.insert(block)

    @staticmethod
    def _merge(dst: Block, src: Block, pool: _Pool) -> None:
        pool.remove(src)
        if src is dst.prev:
            dst.ptr = src.ptr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
            dst.is_segment_head = src.is_segment_head
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size

    def empty_cache(self) -> None:
        """Return every fully free segment to the runtime (``torch.<device>.empty_cache``:
        the device has room again, so large blocks are parked again)."""
        self._release_free_segments()
        self.full = False

    def _release_free_segments(self) -> None:
        if self.runtime.asynchronous:
            self.runtime.synchronize(self.phys)  # queued kernels may still use cached blocks
        with self.lock:
            self._flush_hot()
            self._process_pending_frees()
            self._unpark_all()
            for pool in (self.small, self.large):
                for b in pool:
                    if b.prev is None and b.next is None and b.size == b.segment_size:
                        pool.remove(b)
                        del self.segments[b.ptr]
                        self._release_segment(b)
            self._recount_inactive_split()


def _max_parked() -> int:
    """The cap on parked blocks, which the C++ allocator reads at each configure."""
    return _MAX_PARKED


_NATIVE_IN_USE: list[str] = []  # the device whose allocators are the C++ ones


def make_allocators(runtime: Runtime, visible: list[int],
                    device_name: str) -> list[DeviceAllocator] | list[NativeAllocator]:
    """One caching allocator per visible device: the C++ one where torchport's library
    loads, else the Python one (the one switch between them). The C++ pools serve one
    backend per process (the registered one; PyTorch has one PrivateUse1)."""
    cpp = native.load()
    if cpp is not None and hasattr(cpp, "torchport_caching_enable") and not _NATIVE_IN_USE:
        _NATIVE_IN_USE.append(device_name)
        native.enabled("caching allocator")
        return _native_allocators(cpp, runtime, visible, device_name, _max_parked)
    return [DeviceAllocator(runtime, p, i, device_name) for i, p in enumerate(visible)]
