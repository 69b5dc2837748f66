"""Caching allocator over a runtime's malloc/free, with CUDA's statistics.

Device mallocs are slow and synchronising on real hardware, so -- like PyTorch's
CUDACachingAllocator -- memory is taken from the runtime in segments, carved
into blocks, and freed blocks are kept for reuse. Sizes, pools and split rules
follow CUDA's (512-byte rounding; a small pool of 2 MiB segments for requests up
to 1 MiB; 20 MiB segments for requests up to 10 MiB; larger ones rounded to
2 MiB). Statistics use the key names of ``torch.cuda.memory_stats()``.
"""

from __future__ import annotations

import atexit
import bisect
import ctypes
import threading
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from torchport.core import interrupts, native
from torchport.runtime import Runtime

K_MIN_BLOCK = 512
K_SMALL_SIZE = 1 << 20
K_SMALL_BUFFER = 2 << 20
K_LARGE_BUFFER = 20 << 20
K_MIN_LARGE_ALLOC = 10 << 20
K_ROUND_LARGE = 2 << 20
_MAX_PARKED = 256
# Parked blocks may hold up to the peak of the bytes allocated, or this much on a device
# with little allocated: a training step's transient tensors fit, random sizes cannot
# make the cache grow without bound.
_PARK_FLOOR = 8 << 20
# Host-computed results at least this large are adopted as device memory where the
# runtime can (:meth:`DeviceAllocator.adopt`; below, copying costs less than a segment of
# its own).
ADOPT_MIN_BYTES = 1 << 20
_ALLOC_STATS = ("allocation", "active", "allocated_bytes", "active_bytes", "requested_bytes")

_STAT_NAMES = ("allocation", "segment", "active", "inactive_split")
_BYTE_STAT_NAMES = ("allocated_bytes", "reserved_bytes", "active_bytes",
                    "inactive_split_bytes", "requested_bytes")
_POOLS = ("all", "small_pool", "large_pool")

# Called with (address, size) after a segment goes back to the runtime: caches of host
# views of device memory (torchport.ops.hostviews) drop what points into it.
SEGMENT_FREED: list[Callable[[int, int], None]] = []


class _Stat:
    __slots__ = ("current", "peak", "allocated", "freed")

    def __init__(self) -> None:
        self.current = self.peak = self.allocated = self.freed = 0

    def add(self, n: int) -> None:
        self.current += n
        if n > 0:
            self.allocated += n
        else:
            self.freed -= n
        if self.current > self.peak:
            self.peak = self.current


@dataclass(eq=False)
class Block:
    """A range of a segment; ``allocated`` blocks belong to a live storage."""

    ptr: int
    size: int
    segment_size: int
    small: bool
    stream: Any = None
    allocated: bool = False
    requested: int = 0
    prev: Block | None = None
    next: Block | None = None
    is_segment_head: bool = False
    parked: bool = False  # free, held for an exact-size reuse, not merged yet
    stream_uses: set = field(default_factory=set)
    owner: Any = None  # what returns the block when its storage dies (torchport.memory.tensors)
    adopted: bool = False  # a whole segment of host memory the runtime adopted

    def key(self) -> tuple[int, int]:
        return (self.size, self.ptr)


class _Pool:
    """Free blocks ordered by (size, address) for best-fit search."""

    def __init__(self) -> None:
        self.keys: list[tuple[Any, int, int]] = []
        self.blocks: dict[tuple[Any, int, int], Block] = {}

    @staticmethod
    def _k(b: Block) -> tuple[Any, int, int]:
        return (id(b.stream), b.size, b.ptr)

    def insert(self, b: Block) -> None:
        k = self._k(b)
        bisect.insort(self.keys, k)
        self.blocks[k] = b

    def remove(self, b: Block) -> None:
        k = self._k(b)
        i = bisect.bisect_left(self.keys, k)
        if i < len(self.keys) and self.keys[i] == k:
            del self.keys[i]
            del self.blocks[k]

    def best_fit(self, stream: Any, size: int) -> Block | None:
        i = bisect.bisect_left(self.keys, (id(stream), size, -1))
        if i < len(self.keys) and self.keys[i][0] == id(stream):
            return self.blocks[self.keys[i]]
        return None

    def __iter__(self):
        return iter(list(self.blocks.values()))


def round_size(nbytes: int) -> int:
    if nbytes < K_MIN_BLOCK:
        return K_MIN_BLOCK
    return (nbytes + K_MIN_BLOCK - 1) // K_MIN_BLOCK * K_MIN_BLOCK


def _segment_size(size: int) -> int:
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return (size + K_ROUND_LARGE - 1) // K_ROUND_LARGE * K_ROUND_LARGE


def format_size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.2f} {unit}" if unit != "bytes" else f"{int(n)} bytes"
        n /= 1024
    return f"{n:.2f} GiB"


class DeviceAllocator:
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

    # ---- statistics ------------------------------------------------------------
    def reset_stats(self) -> None:
        self.stats = {(n, p): _Stat() for n in _STAT_NAMES + _BYTE_STAT_NAMES for p in _POOLS}
        self._pairs = {(n, small): (self.stats[(n, "all")],
                                    self.stats[(n, "small_pool" if small else "large_pool")])
                       for n in _STAT_NAMES + _BYTE_STAT_NAMES for small in (True, False)}
        # The statistics every malloc/free moves, all pools at once (the hot path).
        self._on_alloc = {small: [s for n in _ALLOC_STATS for s in self._pairs[(n, small)]]
                          for small in (True, False)}
        self._allocated_pool = [self.stats[("allocated_bytes", "large_pool")],
                                self.stats[("allocated_bytes", "small_pool")]]
        self.num_alloc_retries = 0
        self.num_ooms = 0
        self.num_sync_all_streams = 0
        self.num_device_alloc = 0
        self.num_device_free = 0
        self._reset_hot()

    # The hot path (a parked block handed out or parked again) only counts, in the
    # fields below, what its mallocs and frees add up to since the last flush, and the
    # highest net count/bytes/requested bytes reached; every other path and every
    # reader flushes first, so the statistics stay exact (peaks included: within a
    # window only the hot path moves them, so a window's peak is its start plus the
    # highest net it reached). A window holds one pool's blocks (``_hot_small``): a block
    # of the other pool flushes it first, so that each pool's peak is exact too.
    def _reset_hot(self) -> None:
        self._hm = self._hbm = self._hrm = 0  # mallocs: count, bytes, requested bytes
        self._hf = self._hbf = self._hrf = 0  # frees
        self._pn = self._pb = self._pr = 0  # highest net count, bytes, requested bytes

    def _flush_hot(self) -> None:
        if not (self._hm or self._hf):
            return
        moves = ((("allocation", "active"), self._hm, self._hf, self._pn),
                 (("allocated_bytes", "active_bytes"), self._hbm, self._hbf, self._pb),
                 (("requested_bytes",), self._hrm, self._hrf, self._pr))
        for names, up, down, peak in moves:
            for name in names:
                for pool in ("all", "small_pool" if self._hot_small else "large_pool"):
                    st = self.stats[(name, pool)]
                    st.peak = max(st.peak, st.current + peak)
                    st.current += up - down
                    st.allocated += up
                    st.freed += down
        self._reset_hot()

    def _switch_hot(self, small: bool) -> None:
        """Start a window of the other pool's blocks (flushing the current one)."""
        self._flush_hot()
        self._hot_small = small

    def stat(self, name: str, pool: str = "all") -> _Stat:
        """One statistic (``torch.cuda.memory_stats`` naming), up to date."""
        with self.lock:
            self._flush_hot()
            return self.stats[(name, pool)]

    def _stat(self, small: bool, *changes: tuple[str, int]) -> None:
        """Apply ``(statistic name, change)`` pairs to the pool's and the total statistics."""
        self._flush_hot()
        pairs = self._pairs
        for name, n in changes:
            a, b = pairs[(name, small)]
            a.add(n)
            b.add(n)

    def reset_peak(self) -> None:
        with self.lock:
            self._flush_hot()
            for s in self.stats.values():
                s.peak = s.current

    def reset_accumulated(self) -> None:
        with self.lock:
            self._flush_hot()
            for s in self.stats.values():
                s.allocated = s.freed = 0
        self.num_alloc_retries = self.num_ooms = self.num_sync_all_streams = 0
        self.num_device_alloc = self.num_device_free = 0

    def memory_stats(self) -> dict[str, int]:
        with self.lock:
            self._flush_hot()
            self._unpark_all()
            self._recount_inactive_split()  # computed on demand: O(free blocks)
        out: dict[str, int] = {}
        for (name, pool), s in sorted(self.stats.items()):
            for metric in ("current", "peak", "allocated", "freed"):
                out[f"{name}.{pool}.{metric}"] = getattr(s, metric)
        out["num_alloc_retries"] = self.num_alloc_retries
        out["num_ooms"] = self.num_ooms
        out["num_sync_all_streams"] = self.num_sync_all_streams
        out["num_device_alloc"] = self.num_device_alloc
        out["num_device_free"] = self.num_device_free
        out["max_split_size"] = -1
        out["oversize_allocations.current"] = 0
        out["oversize_segments.current"] = 0
        return out

    def allocated(self) -> int:
        return self.stat("allocated_bytes").current

    def reserved(self) -> int:
        return self.stat("reserved_bytes").current

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

    def _oom_message(self, requested: int) -> str:
        free, total = self.runtime.mem_get_info(self.phys)
        alloc, reserved = self.allocated(), self.reserved()
        limit = ""
        if self.fraction is not None:
            limit = (f" The process is limited to {self.fraction:.2f} of the device "
                     f"({format_size(self.fraction * total)}) by set_per_process_memory_fraction.")
        return (
            f"{self.device_name.upper()} out of memory. Tried to allocate {format_size(requested)}. "
            f"{self.device_name}:{self.logical} has a total capacity of {format_size(total)} of which "
            f"{format_size(free)} is free. Of the allocated memory {format_size(alloc)} is allocated "
            f"by PyTorch, and {format_size(reserved - alloc)} is reserved by PyTorch but unallocated."
            f"{limit} Free tensors you no longer need, reduce the batch size, or call "
            f"torch.{self.device_name}.empty_cache()."
        )

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

    def _recount_inactive_split(self) -> None:
        """Free blocks that are part of a split segment, counted now; the change since the
        last count goes through the statistics as one step (allocated - freed == current)."""
        now = {(name, p): 0 for name in ("inactive_split", "inactive_split_bytes")
               for p in _POOLS}
        for pool in (self.small, self.large):
            for b in pool:
                if b.prev is not None or b.next is not None:
                    for p in ("all", "small_pool" if b.small else "large_pool"):
                        now[("inactive_split", p)] += 1
                        now[("inactive_split_bytes", p)] += b.size
        for key, n in now.items():
            stat = self.stats[key]
            if n != stat.current:
                stat.add(n - stat.current)

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

    # ---- introspection -----------------------------------------------------------
    def snapshot(self) -> list[dict[str, Any]]:
        """Segments and their blocks, in the shape of ``torch.cuda.memory_snapshot()``."""
        out = []
        with self.lock:
            self._flush_hot()
            self._unpark_all()
            for ptr, head in sorted(self.segments.items()):
                blocks = []
                b: Block | None = self._segment_first(head, ptr)
                total = 0
                while b is not None and total < head.segment_size:
                    state = "active_allocated" if b.allocated else "inactive"
                    blocks.append({"address": b.ptr, "size": b.size, "state": state,
                                   "requested_size": b.requested if b.allocated else 0})
                    total += b.size
                    b = b.next
                out.append({"device": self.logical, "address": ptr,
                            "total_size": head.segment_size,
                            "allocated_size": sum(x["size"] for x in blocks
                                                  if x["state"] == "active_allocated"),
                            "segment_type": "small" if head.small else "large",
                            "blocks": blocks})
        return out

    def _segment_first(self, head: Block, ptr: int) -> Block | None:
        candidates = [b for b in list(self.active.values()) + list(self.small) + list(self.large)
                      if b.ptr == ptr]
        return candidates[0] if candidates else None


# ---- the caching allocator in C++ -------------------------------------------------------
# With torchport's C++ library the pools live in C++ (``native_allocator.cpp``, the rules
# above): a storage made there returns its block from its DataPtr's deleter, and Python is
# entered only for a segment, an out-of-memory message, a device synchronize and the events
# of stream-aware freeing. :func:`make_allocators` is the one switch; without the library
# the :class:`DeviceAllocator` above serves.
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
                 device_name: str) -> None:
        self.cpp = cpp
        self.runtime = runtime
        self.phys = phys
        self.logical = logical
        self.device_name = device_name
        self.lock = threading.RLock()  # (callers' own; the pools are locked in C++)
        self._fraction: float | None = None
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
        self._check(self.cpp.torchport_caching_configure(self.logical, limit, _MAX_PARKED))

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

    _oom_message = DeviceAllocator._oom_message

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


def _native_allocators(cpp: Any, runtime: Runtime, visible: list[int],
                       device_name: str) -> list[NativeAllocator]:
    _declare(cpp)
    allocs = [NativeAllocator(cpp, runtime, p, i, device_name) for i, p in enumerate(visible)]

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
        return _native_allocators(cpp, runtime, visible, device_name)
    return [DeviceAllocator(runtime, p, i, device_name) for i, p in enumerate(visible)]
