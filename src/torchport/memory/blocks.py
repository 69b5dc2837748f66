"""Sizes, pools, blocks and segments of the caching allocator: CUDA's rules.

Memory is taken from the runtime in segments and carved into blocks; free blocks wait in
a pool ordered for best-fit search. Sizes, pools and split rules follow CUDA's
CUDACachingAllocator (512-byte rounding; a small pool of 2 MiB segments for requests up to
1 MiB; 20 MiB segments for requests up to 10 MiB; larger ones rounded to 2 MiB). Kept apart
from :mod:`torchport.memory.allocator` as the bookkeeping that the Python allocator, its
statistics and the glue to the C++ allocator (which applies the same rules) all share.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

K_MIN_BLOCK = 512
K_SMALL_SIZE = 1 << 20
K_SMALL_BUFFER = 2 << 20
K_LARGE_BUFFER = 20 << 20
K_MIN_LARGE_ALLOC = 10 << 20
K_ROUND_LARGE = 2 << 20

# Called with (address, size) after a segment goes back to the runtime: caches of host
# views of device memory (torchport.ops.hostviews) drop what points into it.
SEGMENT_FREED: list[Callable[[int, int], None]] = []


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

