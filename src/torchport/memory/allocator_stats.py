"""The CUDA-named statistics of the Python caching allocator, its snapshot, its OOM message.

:class:`AllocatorStatistics` is a mixin of :class:`torchport.memory.allocator.DeviceAllocator`:
the counters under the key names of ``torch.cuda.memory_stats()`` (with the deferred counts
of the allocator's hot path and their flush), ``memory_snapshot()``'s segments and blocks,
and the out-of-memory message (which the C++ allocator's glue uses too). Kept apart from
the allocator's malloc and free paths: these only count and report; the pools, blocks,
parking and lock they read are the allocator's.
"""

from __future__ import annotations

import threading
from typing import Any

from torchport.memory.blocks import Block, _Pool
from torchport.runtime import Runtime

_ALLOC_STATS = ("allocation", "active", "allocated_bytes", "active_bytes", "requested_bytes")

_STAT_NAMES = ("allocation", "segment", "active", "inactive_split")
_BYTE_STAT_NAMES = ("allocated_bytes", "reserved_bytes", "active_bytes",
                    "inactive_split_bytes", "requested_bytes")
_POOLS = ("all", "small_pool", "large_pool")


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


def format_size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.2f} {unit}" if unit != "bytes" else f"{int(n)} bytes"
        n /= 1024
    return f"{n:.2f} GiB"


class AllocatorStatistics:
    """Statistics, snapshot and out-of-memory message of a
    :class:`~torchport.memory.allocator.DeviceAllocator` (a mixin: the pools, blocks, lock
    and ``_unpark_all`` are the allocator's)."""

    runtime: Runtime
    phys: int
    logical: int
    device_name: str
    lock: threading.RLock
    small: _Pool
    large: _Pool
    active: dict[int, Block]
    segments: dict[int, Block]
    fraction: float | None

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
