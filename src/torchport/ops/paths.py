"""Choosing a decomposition for an op without a kernel.

An op without a device kernel can still run on the device when PyTorch's
``torch._decomp`` decomposes it into ops that do have kernels. A decomposition
is only worth it when none of its pieces ends in the CPU fallback (otherwise the
fallback of the whole op is cheaper), so the decision is made once per overload
by tracing the decomposition on meta tensors shaped like the first call's
inputs and checking every op it dispatches: each must have a device kernel (and
not be forced to fallback), or be a metadata-only view. Tracing failures
(data-dependent decompositions) mean "no decomposition".
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from torchport.ops.plan import plan_for

_UNDECIDED = object()
_DECISIONS: dict[Any, Callable[..., Any] | None] = {}
_TABLE: dict[Any, Callable[..., Any]] | None = None
_LOCK = threading.Lock()


def full_name(op: Any) -> str:
    """``aten::add.out`` for an OpOverload."""
    s = op._schema
    return s.name + ("." + s.overload_name if s.overload_name else "")


def decomposition_table() -> dict[Any, Callable[..., Any]]:
    """``torch._decomp.decomposition_table``, imported on first need (it is slow to import)."""
    global _TABLE
    if _TABLE is None:
        with _LOCK:
            if _TABLE is None:
                import torch._decomp as d
                _TABLE = d.decomposition_table
    return _TABLE


class _Seen(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Any] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if _is_composite_implicit(func):
            # Below autograd such ops still decompose: trace what they become.
            with self:
                return func.decompose(*args, **kwargs)
        self.ops.append(func)
        return func(*args, **kwargs)


def _is_composite_implicit(op: Any) -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(full_name(op),
                                                              "CompositeImplicitAutograd")
    except (RuntimeError, AttributeError):
        return False


def _to_meta(device_type: str) -> Callable[[Any], Any]:
    def conv(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
        if isinstance(v, torch.device) and v.type == device_type:
            return torch.device("meta")
        if isinstance(v, str) and v.startswith(device_type):
            return "meta"
        return v
    return conv


def lands_on_device(op: Any, is_forced: Callable[[str], bool]) -> bool:
    """Does ``op`` run on the device without the CPU fallback?"""
    if not isinstance(op, torch._ops.OpOverload):
        return False
    if plan_for(op).is_view:
        return True
    name = full_name(op)
    try:
        has = torch._C._dispatch_has_kernel_for_dispatch_key(name, "PrivateUse1")
    except RuntimeError:
        return False
    return has and not is_forced(name.split("::", 1)[1])


def decomposition_for(op: Any, device_type: str, args: tuple, kwargs: dict,
                      is_forced: Callable[[str], bool]) -> Callable[..., Any] | None:
    """The decomposition to run ``op`` with, or ``None`` when it would fall back anyway."""
    d = _DECISIONS.get(op, _UNDECIDED)
    if d is not _UNDECIDED:
        return d  # type: ignore[return-value]
    fn = decomposition_table().get(op)
    chosen = None
    if fn is not None:
        conv = _to_meta(device_type)
        try:
            margs, mkw = tree_map(conv, args), tree_map(conv, kwargs)
            with _Seen() as seen:
                fn(*margs, **mkw)
            ok = bool(seen.ops) and all(o is not op and lands_on_device(o, is_forced)
                                        for o in seen.ops)
        except Exception:  # data-dependent or meta-less decompositions: not taken
            ok = False
        chosen = fn if ok else None
    _DECISIONS[op] = chosen
    return chosen


def forget_decisions() -> None:
    """Decide again (after kernels or forced-fallback settings changed)."""
    _DECISIONS.clear()
