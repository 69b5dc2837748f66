"""Choosing a decomposition for an op without a kernel.

An op without a device kernel can still run on the device when PyTorch's
``torch._decomp`` decomposes it into ops that do have kernels. A decomposition
is only worth it when none of its pieces ends in the CPU fallback (otherwise the
fallback of the whole op is cheaper), so the decision is made once per overload
by tracing the decomposition on meta tensors shaped like the first call's
inputs and checking every op it dispatches: each must have a device kernel (and
not be forced to fallback), or be a metadata-only view. Tracing failures
(data-dependent decompositions) mean "no decomposition".

A decomposition must also mean what the kernel means. Those that accept what ATen's
kernels refuse would make the device compute where CUDA raises: a call whose dtypes the
CPU kernel refuses (``logaddexp`` of integers, ``hardshrink`` of complex numbers) gets the
CPU's error (:func:`cpu_refusal`, learnt once per dtype signature on 1-element stand-ins),
and decompositions with other semantics than the kernel (:data:`NOT_EQUIVALENT`) are
never taken.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from torchport.ops import quiet, teardown
from torchport.ops.plan import plan_for

# Decompositions whose results differ from ATen's kernels for valid input (CUDA's and the
# CPU's agree there): name -> why. Their ops take the device kernel or the CPU fallback.
NOT_EQUIVALENT = {
    "aten::index_fill": "negative indices: the kernels count them from the end, the "
                        "decomposition (through index_copy) refuses them",
    "aten::index_fill_": "as index_fill",
    "aten::threshold": "the kernels convert the threshold to the input's dtype before they "
                       "compare (-0.5 is 0 for int32), the decomposition compares in the "
                       "promoted type",
    "aten::threshold_": "as threshold",
}

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


teardown.on_start(decomposition_table)  # a finaliser during the teardown cannot import


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
    if sys.is_finalizing():
        # the trial would meet ops (and torch._dynamo's lazy import on torch 2.14) that
        # PyTorch finds with an import, which fails during the teardown: the CPU fallback
        return None
    fn = decomposition_table().get(op)
    if op._schema.name in NOT_EQUIVALENT:
        fn = None
    chosen = None
    if fn is not None:
        conv = _to_meta(device_type)
        try:
            margs, mkw = tree_map(conv, args), tree_map(conv, kwargs)
            def trial() -> _Seen:
                with _Seen() as seen:
                    fn(*margs, **mkw)
                return seen
            seen = quiet.silently(trial)  # its warnings are not the user's: the call warns
            ok = bool(seen.ops) and all(o is not op and lands_on_device(o, is_forced)
                                        for o in seen.ops)
        except Exception:  # data-dependent or meta-less decompositions: not taken
            ok = False
        chosen = _scalars_beside_out(fn) if ok else None
    _DECISIONS[op] = chosen
    return chosen


def _scalars_beside_out(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` taking a 0-dim CPU tensor as its first operand beside a device ``out=``.

    PyTorch's decompositions wrap ``out=`` with a check that the first argument is on the
    output's device, stricter than the kernels: TensorIterator takes a 0-dim CPU tensor as
    a scalar operand anywhere (``heaviside(cpu_scalar, x)`` runs on CUDA). The same tensor
    on the output's device promotes and computes alike, so the decomposition gets that."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        out, first = kwargs.get("out"), args[0] if args else None
        if isinstance(out, torch.Tensor) and isinstance(first, torch.Tensor) \
                and first.dim() == 0 and first.device.type == "cpu" \
                and out.device.type != "cpu":
            args = (first.to(out.device), *args[1:])
        return fn(*args, **kwargs)
    return run


def takes_cpu(op: Any) -> bool:
    """Has ``op``'s path been decided as the CPU fallback for all its calls (no
    decomposition)?"""
    return _DECISIONS.get(op, _UNDECIDED) is None


_FORGET_LISTENERS: list[Callable[[], None]] = []


def on_forget(fn: Callable[[], None]) -> None:
    """Call ``fn()`` whenever the decisions are forgotten (what was learnt from them too)."""
    _FORGET_LISTENERS.append(fn)


def forget_decisions() -> None:
    """Decide again (after kernels or forced-fallback settings changed)."""
    _DECISIONS.clear()
    for fn in _FORGET_LISTENERS:
        fn()


_REFUSALS: dict[tuple, BaseException | None] = {}


def cpu_refusal(op: Any, args: tuple, kwargs: dict) -> BaseException | None:
    """The error ATen's CPU kernel raises for the dtypes of this call, where it refuses
    them but takes the same call in float32 (so the refusal is the dtype's, not the
    shape's or a value's); ``None`` where it accepts them. Learnt once per overload and
    dtype signature by running the CPU kernel on 1-element stand-ins, zeros and ones (no
    random ops: they would draw from the CPU's generator)."""
    flat = _flat(args, kwargs)
    tensors = [v for v in flat if isinstance(v, torch.Tensor)]
    # Python numbers by type and value: they promote by their type (``bool // True`` is
    # refused, ``bool // 1`` not), and the kernels check some values (``int8 // 0``, a
    # threshold of ``inf`` for int8), which is no refusal of another value
    key = (op, *(v.dtype if isinstance(v, torch.Tensor) else (type(v), v) for v in flat
                 if isinstance(v, torch.Tensor | bool | int | float | complex)))
    if key in _REFUSALS:
        return _REFUSALS[key]
    if len(_REFUSALS) > 4096:  # numbers that change every call
        _REFUSALS.clear()
    found = None
    if tensors and not plan_for(op).random:
        err = _probe(op, args, kwargs, None)
        # an error on zeros but not on ones is the values' (an integer division by zero);
        # then float32 for every tensor but masks, then for the bools too (an op of bool
        # operands, not masks: logaddexp of two bool tensors)
        if err is not None and _probe(op, args, kwargs, None, fill=1) is not None \
                and (_probe(op, args, kwargs, torch.float32) is None
                                or _probe(op, args, kwargs, torch.float32, bools=True) is None):
            found = err
    _REFUSALS[key] = found
    return found


def _flat(args: tuple, kwargs: dict) -> list[Any]:
    out: list[Any] = []
    for v in (*args, *kwargs.values()):
        out.extend(v if isinstance(v, (list, tuple)) else (v,))
    return out


def _probe(op: Any, args: tuple, kwargs: dict, dtype: torch.dtype | None,
           bools: bool = False, fill: int = 0) -> BaseException | None:
    """The CPU kernel's error on CPU stand-ins of ``args`` (the same dims, each size 1,
    filled with ``fill``, or 0 where the argument may hold indices; every non-bool tensor,
    and with ``bools`` every bool one, in ``dtype`` when given), or ``None``."""
    index_args = plan_for(op).index_args

    def stand_in(v: Any, name: str = "") -> Any:
        if isinstance(v, torch.Tensor):
            keep = dtype is None or (v.dtype is torch.bool and not bools)
            dt = v.dtype if keep else dtype
            return torch.full([min(n, 1) for n in v.shape],
                              0 if name in index_args else fill, dtype=dt)
        if isinstance(v, torch.device):
            return torch.device("cpu")
        return v
    names = plan_for(op).arg_names
    sargs = [tree_map(lambda x, n=n: stand_in(x, n), a)
             for a, n in zip(args, names, strict=False)]
    skw = {k: tree_map(lambda x, k=k: stand_in(x, k), v) for k, v in kwargs.items()}
    try:
        with torch.no_grad():
            quiet.warnings_of(lambda: op(*sargs, **skw))
    except Exception as e:  # noqa: BLE001 (the CPU kernel's own error is the answer)
        # kept for the overload's later calls: without its traceback, whose frames hold
        # the caller's arguments (device tensors, their memory never freed)
        e.__context__ = e.__cause__ = None
        return e.with_traceback(None)
    return None

