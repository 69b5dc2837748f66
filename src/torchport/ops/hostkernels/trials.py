"""Trials: does an ``out=`` overload give the functional CPU kernel's bits for a layout?

Some CPU ``out=`` kernels take another path for strided inputs (``native_batch_norm.out``
leaves its saved statistics unwritten), stage a larger result in ``out``, or warn. A
host kernel therefore trusts an ``out=`` overload for a layout of its inputs only after
running it once on copies of those inputs in their exact layouts, into outputs filled
with a pattern no result has, and comparing the bytes with the functional kernel's.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torchport.memory import tensors
from torchport.ops import derive
from torchport.ops.plan import plan_for
from torchport.ops.quiet import warnings_of

Tensor = torch.Tensor


class OpsSeen(TorchDispatchMode):
    """The ATen overloads a block of code reaches."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def flat_tensors(values: Any) -> list[Tensor]:
    """The tensors of an argument list, those inside tensor lists included, in order."""
    return [t for v in values for t in (v if isinstance(v, (list, tuple)) else (v,))
            if isinstance(t, Tensor)]


# Alignment kept by :func:`layout_copy`: vectorised CPU kernels may take another path
# for data that is not aligned as the original is.
_COPY_ALIGN = 64


def layout_copy(t: Tensor) -> Tensor:
    """A copy of ``t`` in its exact layout (sizes, strides, overlaps, the storage offset's
    alignment): a CPU kernel can choose its path by layout (``clone`` makes non-dense
    inputs contiguous), so a trial must see the layout the real call sees."""
    itemsize = t.element_size()
    n = tensors.storage_nbytes(t.shape, t.stride(), itemsize) // itemsize
    pad = t.storage_offset() % max(1, _COPY_ALIGN // itemsize)
    span = t.as_strided((n,), (1,), t.storage_offset())
    base = torch.empty(pad + n, dtype=t.dtype)
    base[pad:].copy_(span)
    return base.as_strided(t.shape, t.stride(), pad)


def layout_copies(values: list) -> list:
    """:func:`layout_copy` of every tensor of an argument list (also inside tensor lists),
    a tensor passed twice copied once."""
    memo: dict[int, Tensor] = {}

    def copy(v: Any) -> Any:
        if not isinstance(v, Tensor):
            return v
        c = memo.get(id(v))
        if c is None:
            c = memo[id(v)] = layout_copy(v)
        return c
    return [type(v)(copy(x) for x in v) if isinstance(v, (list, tuple)) else copy(v)
            for v in values]


# 251 bytes (a prime: no element size divides it), none repeating within an element
_PATTERN = (torch.arange(251, dtype=torch.int32) * 97 + 0xA5).remainder_(251).to(torch.uint8)


def patterned(size: list, stride: list, dtype: torch.dtype) -> Tensor:
    """A host output laid out as ``size``/``stride``, its bytes a position-dependent
    pattern: an output a kernel leaves unwritten keeps bytes no result has."""
    nbytes = tensors.storage_nbytes(size, stride, dtype.itemsize)
    raw = _PATTERN.repeat(nbytes // _PATTERN.numel() + 1)[:nbytes]
    return raw.view(dtype).as_strided(size, stride)


def same_bits(a: Tensor, b: Tensor) -> bool:
    """Same shape, dtype and bytes (NaN payloads and signed zeros included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True

    def raw(t: Tensor) -> Tensor:
        flat = torch.empty(t.numel(), dtype=t.dtype)  # (a size-1 dimension keeps any stride)
        flat.view(t.shape).copy_(t.resolve_conj().resolve_neg())
        return flat.view(torch.uint8)
    return torch.equal(raw(a), raw(b))


# ---- asynchronous launches: specs from stand-ins ------------------------------------
class _Refused:
    """The functional CPU kernel refused the stand-ins (try other values)."""


REFUSED = _Refused()


def launch_specs(op: torch._ops.OpOverload, out: Callable[..., Any], out_names: list[str],
                 args: tuple, kwargs: dict) -> list | None:
    """(shape, strides, dtype) of each result the CPU kernel gives for inputs laid out as
    ``args`` and ``kwargs``, or ``None`` where a launch of ``out`` (``op``'s ``out=``
    overload) cannot be trusted: the meta kernel cannot say (a data-dependent shape), or
    the ``out=`` overload fails, warns, resizes its outputs, or gives other bits than the
    functional kernel (:func:`specs_on_stand_ins`). Asked without waiting for the stream,
    of stand-ins in the inputs' layouts: varied values, or zeros, or ones, the first the
    functional kernel accepts (an index, an integer division)."""
    try:
        derive.output_specs(op, args, kwargs)
    except Exception:  # no meta kernel, a data-dependent shape, a bad input
        return None
    for value in (None, 0, 1):
        specs = specs_on_stand_ins(op, out, out_names, args, kwargs, value)
        if specs is not REFUSED:
            return specs
    return None


_GOLDEN = 0.6180339887498949


def stand_in_values(n: int, dtype: torch.dtype, value: int | None,
                    index: bool = False) -> Tensor:
    """``n`` values of ``dtype``: ``value``, or (``None``) varied ones, the same each time.
    No random op makes them: a trial can run under vmap, which refuses random ops
    (gradcheck's batched gradients, ``torch.vmap(randomness="error")``). Integers are
    zeros where varied, and always for an argument that may hold indices (``index``,
    :attr:`~torchport.ops.plan.OpPlan.index_args`): some CPU kernels trust their indices
    unchecked (``nll_loss2d_backward`` writes where its target points), and 0 is the one
    index valid in every non-empty dimension; another value would have them write outside
    their outputs, into the process's heap."""
    integer = not (dtype.is_floating_point or dtype.is_complex or dtype is torch.bool)
    if integer and (index or value is None):
        return torch.zeros(n, dtype=dtype)
    if value is not None:
        return torch.full((n,), value, dtype=dtype)
    if integer:
        return torch.zeros(n, dtype=dtype)
    if dtype is torch.bool:  # a mask, never an index
        return torch.arange(n).remainder_(2).to(dtype)
    # golden-ratio steps over [-2, 2)
    spread = torch.arange(1, n + 1, dtype=torch.float64).mul_(_GOLDEN).remainder_(1.0)
    return spread.mul_(4.0).sub_(2.0).to(dtype)


def stand_ins(op: torch._ops.OpOverload, args: tuple, kwargs: dict,
              value: int | None) -> tuple[list, dict]:
    """Host stand-ins of a call's tensors (tensor lists too), in their layouts, filled as
    :func:`stand_in_values` says."""
    index_args = plan_for(op).index_args

    def stand_in(v: Any, name: str) -> Any:
        if isinstance(v, Tensor):
            n = tensors.storage_nbytes(v.shape, v.stride(), v.element_size()) // v.element_size()
            return stand_in_values(n, v.dtype, value, name in index_args).as_strided(
                v.shape, v.stride())
        if isinstance(v, (list, tuple)) and any(isinstance(x, Tensor) for x in v):
            return type(v)(stand_in(x, name) for x in v)
        return v

    names = plan_for(op).arg_names
    return ([stand_in(a, n) for a, n in zip(args, names, strict=False)],
            {k: stand_in(v, k) for k, v in kwargs.items()})


def specs_on_stand_ins(op: torch._ops.OpOverload, out: Callable[..., Any],
                       out_names: list[str], args: tuple, kwargs: dict,
                       value: int | None) -> Any:
    """:func:`launch_specs` asked of stand-ins filled as :func:`stand_in_values` says;
    :data:`REFUSED` when the functional CPU kernel raises on them. The ``out=`` overload
    runs on copies of the stand-ins into outputs filled with a pattern, and must give
    the functional kernel's bits, in the outputs and in any input either writes."""
    sargs, skw = stand_ins(op, args, kwargs, value)
    names = list(skw)
    copies = layout_copies([*sargs, *skw.values()])
    oargs, okw = copies[:len(sargs)], dict(zip(names, copies[len(sargs):], strict=True))
    got: list = []
    try:
        if warnings_of(lambda: got.append(op._op(*sargs, **skw))):
            return None
    except Exception:
        return REFUSED
    results = [got[0]] if isinstance(got[0], Tensor) else list(got[0])
    if not all(isinstance(x, Tensor) for x in results):
        return None  # an undefined output (a backward's unrequested gradient): no launch
    specs = [(tuple(x.shape), x.stride(), x.dtype) for x in results]
    outs = [patterned(list(sh), list(st), dt) for sh, st, dt in specs]
    okw.update(zip(out_names, outs, strict=True))
    try:
        if warnings_of(lambda: out(*oargs, **okw)):
            return None
    except Exception:
        return None
    if any((tuple(o.shape), o.stride()) != (sh, st)
           for o, (sh, st, _) in zip(outs, specs, strict=True)):
        return None
    if not all(same_bits(o, x) for o, x in zip(outs, results, strict=True)) or not all(
            same_bits(a, b) for a, b in zip(flat_tensors([*sargs, *skw.values()]),
                                            flat_tensors(copies), strict=True)):
        return None  # the out= overload computes other bits for this layout
    return specs


def copy_launch_specs(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list | None:
    """(shape, strides, dtype) of each result -- ``None`` for one left undefined -- of
    functional ``op`` for inputs laid out as ``args`` and ``kwargs``, where the functional
    kernel itself may be queued (an op with no ``out=`` overload, a backward leaving a
    gradient undefined, a foreach op's list): the meta kernel accepts the layouts, and
    the CPU kernel runs on stand-ins (as :func:`launch_specs` fills them) silently, with
    results that are new tensors, drawing no random number (a random op with its
    randomness off for these arguments: an attention's ``dropout_p=0``). ``None``
    otherwise."""
    if not derive.meta_accepts(op, args, kwargs):
        return None
    random = plan_for(op).random
    gen = torch.default_generator
    for value in (None, 0, 1):
        sargs, skw = stand_ins(op, args, kwargs, value)
        got: list = []
        saved = gen.get_state() if random else None
        try:
            if warnings_of(lambda a=sargs, k=skw, into=got: into.append(op._op(*a, **k))):
                return None
        except Exception:
            continue  # refused: the next stand-in values
        finally:
            drew = saved is not None and not torch.equal(gen.get_state(), saved)
            if saved is not None:
                gen.set_state(saved)  # the CPU's own random numbers stay untouched
        if drew:
            return None
        r = got[0]
        results = [r] if isinstance(r, Tensor) else list(r) if isinstance(r, (tuple, list)) \
            else None
        if not results or not all(x is None or isinstance(x, Tensor) for x in results):
            return None
        inputs = {tensors.storage_ptr(v) for v in flat_tensors([*sargs, *skw.values()])
                  if v.numel()}
        if any(x is not None and x.numel() and tensors.storage_ptr(x) in inputs
               for x in results):
            return None  # a result aliasing an input: the general path says how
        return [None if x is None else (tuple(x.shape), x.stride(), x.dtype) for x in results]
    return None


# What PyTorch's argument checks raise (TORCH_CHECK and its kin).
_CHECK_ERRORS = (RuntimeError, ValueError, TypeError, IndexError)


def raise_refused_layouts(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> None:
    """Raise the CPU's error for a call whose layouts alone refuse it (shapes that do not
    broadcast, an ``out=`` of a dtype the result cannot be cast to), without looking at
    values: what CUDA's host checks raise at the call, before any queued kernel ran.

    The meta kernel, which sees no values, decides; the CPU kernel run on stand-ins in
    the call's layouts says it in PyTorch's words (a meta kernel's own differ). Where the
    meta kernel has no answer (no meta kernel, a data-dependent shape) or the CPU accepts
    one of three fillings of stand-ins (a meta kernel's own limit), this returns and the
    host decides; so it does for an op with a device argument (a factory: no tensor to
    stand in for) or arguments that must be on the CPU (a device tensor there is CUDA's
    first error)."""
    plan = plan_for(op)
    if plan.has_device_arg or plan.host_args or sys.is_finalizing():
        return
    try:
        derive.output_specs(op, args, kwargs, quiet=True)
        return
    except NotImplementedError:
        return
    except _CHECK_ERRORS:  # noqa: S110  (decided below, in the CPU's words)
        pass
    except Exception:  # not an argument check's (an interpreter tearing down)
        return
    gen = torch.default_generator
    saved = gen.get_state() if plan.random else None
    first: Exception | None = None
    try:
        # refused whatever the values: the layouts' error, as said for ones (the values
        # least likely to be refused themselves: a negative standard deviation, a zero divisor)
        for value in (1, 0, None):
            sargs, skw = stand_ins(op, args, kwargs, value)
            try:
                warnings_of(lambda a=sargs, k=skw: op._op(*a, **k))
            except NotImplementedError:
                return
            except _CHECK_ERRORS as e:
                first = first or e
            except Exception:
                return
            else:
                return
    finally:
        if saved is not None:
            gen.set_state(saved)  # the CPU's own random numbers stay untouched
    assert first is not None
    try:
        raise first.with_traceback(None) from None
    finally:
        del first  # (no cycle through this frame: the call's tensors go with the error)


def inplace_launchable(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> bool:
    """Can in-place ``op`` called with arguments laid out as ``args``/``kwargs`` be queued
    without the host looking at values? Its meta kernel accepts the layouts, and its CPU
    kernel runs on copies of varied stand-in values in those layouts (tensor lists too)
    without an error or a warning. An op that refuses some values (an integer division
    by zero among the stand-ins) is not: its error belongs to the call."""
    try:
        derive.output_specs(op, args, kwargs, quiet=True)
    except Exception:
        return False

    sargs, skw = stand_ins(op, args, kwargs, None)
    try:
        return not warnings_of(lambda: op._op(*sargs, **skw))
    except Exception:
        return False
