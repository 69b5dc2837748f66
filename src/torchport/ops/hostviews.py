"""The chip's views of device tensors, made once per layout of device memory.

A host-op kernel runs PyTorch's CPU kernel on a view of device memory that its
``to_cpu`` function makes (an ``as_strided`` over the chip's memory). What
such a view aliases depends only on the device address, dtype, shape and strides,
and a training step touches the same few hundred of those every step, so views are
kept by that key. Blocks are reused at the same address with the same layout, so
the result tensors of an op find their views here too.

A view stays valid while the memory under its address is the same: views into a
segment are dropped when the allocator returns it to the runtime (and the cache is
cleared when it grows past a bound). ``to_cpu`` must therefore depend on nothing but the key, which holds
for a view of a runtime's memory.

Each view also carries a small integer naming its (dtype, shape, strides): keys of
the per-op caches of output layouts are built from those.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch

from torchport.memory import allocator

Tensor = torch.Tensor
_MAX_ENTRIES = 8192
_LAYOUTS: dict[tuple, int] = {}
_ALL: list[HostViews] = []


def layout_id(dtype: torch.dtype, shape: tuple, stride: tuple) -> int:
    """A small integer per distinct (dtype, shape, strides)."""
    key = (dtype, tuple(shape), tuple(stride))
    n = _LAYOUTS.get(key)
    if n is None:
        n = _LAYOUTS[key] = len(_LAYOUTS)
    return n


class HostViews:
    """Views made by one ``to_cpu``; ``entries`` maps ``(data_ptr, dtype, shape,
    strides)`` to ``(view, layout id, device)`` (read directly by the fast path)."""

    def __init__(self, to_cpu: Callable[[Tensor], Tensor], devices: list[torch.device]) -> None:
        self.to_cpu = to_cpu
        self.devices = devices
        self.entries: dict[tuple, tuple[Tensor, int, torch.device]] = {}
        # the entries' addresses, sorted, and the keys at each: what a freed segment drops
        self._ptrs: list[int] = []
        self._keys: dict[int, list[tuple]] = {}

    def add(self, t: Tensor, key: tuple, plain: bool = True, view: Tensor | None = None
            ) -> tuple[Tensor, int, torch.device] | None:
        """Make, keep and return the entry of ``t`` under ``key``; ``None`` when ``t`` is
        not a tensor of one of ``devices``, or (``plain``) is a conjugate or negative view
        (the caller's general path decides). The device object in the entry is the one
        of ``devices``: compare with ``is``. ``view``: a CPU tensor already aliasing
        ``t``'s memory in ``t``'s layout (an adopted result), kept instead of a new one."""
        d = t.device
        devices = self.devices
        if d.index is None or d.index >= len(devices) or devices[d.index] != d \
                or (plain and (t.is_conj() or t.is_neg())):
            return None
        e = (self.to_cpu(t) if view is None else view, layout_id(key[1], key[2], key[3]),
             devices[d.index])
        if not key[0]:  # no memory: every device's empty tensors share the address 0
            return e
        entries = self.entries
        if len(entries) >= _MAX_ENTRIES:
            self.clear()
        entries[key] = e
        at = self._keys.get(key[0])
        if at is None:
            bisect.insort(self._ptrs, key[0])
            self._keys[key[0]] = [key]
        else:
            at.append(key)
        return e

    def entry(self, t: Tensor, plain: bool = True) -> tuple[Tensor, int, torch.device] | None:
        """``t``'s entry, made if missing (:meth:`add`; the fast paths inline this)."""
        key = (t.data_ptr(), t.dtype, t.shape, t.stride())
        e = self.entries.get(key)
        return self.add(t, key, plain) if e is None else e

    def clear(self) -> None:
        self.entries.clear()
        self._ptrs.clear()
        self._keys.clear()

    def forget(self, ptr: int, end: int) -> None:
        """Drop the views into device memory [ptr, end)."""
        ptrs = self._ptrs
        lo, hi = bisect.bisect_left(ptrs, ptr), bisect.bisect_left(ptrs, end)
        entries, keys = self.entries, self._keys
        for p in ptrs[lo:hi]:
            for k in keys.pop(p):
                entries.pop(k, None)
        del ptrs[lo:hi]


_BY_FN: dict[Callable[[Tensor], Tensor], HostViews] = {}


def for_to_cpu(to_cpu: Callable[[Tensor], Tensor], devices: list[torch.device]) -> HostViews:
    """The one cache of ``to_cpu``'s views of tensors on ``devices`` (host-op kernels
    sharing ``to_cpu`` share it)."""
    hv = _BY_FN.get(to_cpu)
    if hv is None:
        hv = _BY_FN[to_cpu] = HostViews(to_cpu, devices)
        _ALL.append(hv)
    return hv


def forget(ptr: int, size: int) -> None:
    """Drop every view into device memory [ptr, ptr + size) (a segment the runtime got back)."""
    for hv in _ALL:
        hv.forget(ptr, ptr + size)


def caches() -> list[HostViews]:
    """Every view cache made so far (one per ``to_cpu``), for tools and tests."""
    return list(_ALL)


def cached(ptr: int = 0, size: int | None = None) -> list[tuple]:
    """The keys ``(data_ptr, dtype, shape, strides)`` of the views kept, over every
    cache, whose address lies in device memory [ptr, ptr + size) (all without ``size``):
    what tools and tests inspect, e.g. that a freed segment left no view behind."""
    end = None if size is None else ptr + size
    return [k for hv in _ALL for k in hv.entries if ptr <= k[0] and (end is None or k[0] < end)]


def clear() -> None:
    """Drop every kept view, in every cache (the next use of each layout makes it anew)."""
    for hv in _ALL:
        hv.clear()


allocator.SEGMENT_FREED.append(forget)
