"""The per-op cache of result layouts, and what of an argument can decide one.

A host kernel learns, on the first call with each layout of its inputs, the layouts
of its results (from the meta kernel, checked by a trial), and reuses them for every
later call with the same key: a training step repeats the same few hundred keys. Keys
hold what can decide a result's layout: the tensors' layouts and dtypes, the other
arguments -- floats by type only (an optimizer's step sizes change every step).
"""

from __future__ import annotations

from typing import Any

import torch

Tensor = torch.Tensor

# Keys kept per op before the cache starts over: a shape-varying workload (generation
# with a growing sequence) must not grow it without bound.
MAX_KEYS = 4096


class LayoutCache(dict):
    """Key -> what a kernel learned for calls with that key (read with ``get``).

    Bounded: a :meth:`put` into a full cache first clears it (a rebuilt entry costs one
    first call)."""

    __slots__ = ()

    def put(self, key: Any, value: Any) -> None:
        if len(self) >= MAX_KEYS and key not in self:
            self.clear()
        self[key] = value


def layout_of(v: Any) -> Any:
    """What of an argument can decide a result's layout: a float's value never does; a
    tensor list's (``cat``, ``index``) is its tensors' layouts."""
    if isinstance(v, Tensor):
        return (v.dtype, v.shape, v.stride())
    t = type(v)
    if t is list or t is tuple:
        if any(isinstance(x, Tensor) for x in v):
            return (t, tuple(map(layout_of, v)))
        return (t, tuple(v))
    return t if t is float else (t, v)


def exact_layout_of(v: Any) -> Any:
    """:func:`layout_of` with a float by its value: the key of a random op, whose floats
    (a ``dropout_p``) decide whether it draws."""
    if type(v) is float:
        return (float, v)
    if type(v) is list or type(v) is tuple:
        return (type(v), tuple(map(exact_layout_of, v)))
    return layout_of(v)


def argument_key(a: Any) -> Any:
    """:func:`layout_of` for a non-tensor argument."""
    t = type(a)
    return t if t is float else (t, tuple(a) if t is list else a)
