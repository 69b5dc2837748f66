"""Random ops on an asynchronous runtime: the numbers drawn by the host at the call.

CUDA reserves a launch's random numbers (its Philox offset) when the host launches it, so
the numbers a program gets follow the order of its calls, whatever the streams do later.
Here the host draws them at the call, from the device's generator (or the one given), in
that same order, into a host temporary; what reads them is queued on the stream. The
generator is then only ever the host's: nothing waits for the stream, and seeding or
reading its state needs no synchronisation. Only ops whose draws do not depend on a
tensor's values qualify: the in-place fills (``uniform_``, ``normal_``, ``bernoulli_(p)``,
``random_``, ``exponential_``..., also what ``rand_like`` calls) and
``native_dropout`` (its mask is a ``bernoulli_`` fill; the output is computed from it).
Each is proven once per layout against the CPU kernel (:func:`fill_trial`,
:func:`dropout_trial`); the others compute on the host after the stream (general path).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from torchport.memory import tensors
from torchport.ops import fallback, hostexec, hostviews, stats
from torchport.ops.hostkernels import outputs, trials
from torchport.ops.hostkernels.into_device import launch_call
from torchport.ops.hostkernels.layouts import LayoutCache, layout_of
from torchport.ops.hostkernels.mapping import Call
from torchport.ops.plan import plan_for
from torchport.ops.quiet import warnings_of

if TYPE_CHECKING:
    from torchport.core.contracts import DeviceBackend

Tensor = torch.Tensor
NATIVE_DROPOUT = torch.ops.aten.native_dropout.default
_copy = torch.ops.aten.copy_.default
_MUL_OUT = torch.ops.aten.mul.out
_MUL_SCALAR_ = torch.ops.aten.mul_.Scalar


def _fresh_generator(state: Tensor) -> torch.Generator:
    g = torch.Generator()
    g.set_state(state)
    return g


def fill_trial(op: torch._ops.OpOverload, t: Tensor, args: tuple, kwargs: dict) -> bool:
    """Does in-place random ``op`` (called as ``op(t, *args, **kwargs)``) write the same bits
    into a tensor laid out as ``t`` whatever its values, silently? Then the host may draw
    them into a temporary in that layout and the device copy them over."""
    n = tensors.storage_nbytes(t.shape, t.stride(), t.element_size()) // t.element_size()
    state = torch.Generator().manual_seed(0).get_state()
    got = []
    for values in (trials.stand_in_values(n, t.dtype, None), torch.zeros(n, dtype=t.dtype)):
        x = values.as_strided(t.shape, t.stride())
        try:
            if warnings_of(lambda x=x: op._op(x, *args, **kwargs,
                                              generator=_fresh_generator(state))):
                return False
        except Exception:
            return False
        got.append(x)
    return trials.same_bits(got[0], got[1])


def fill_kernel(backend: DeviceBackend, op: torch._ops.OpOverload, views: hostviews.HostViews,
                layouts: LayoutCache, general: Call, slow: Call | None,
                trace: bool = False) -> Callable[..., Any]:
    """An in-place random fill: the host draws the numbers now into a temporary laid out
    as the tensor, and the copy into it is queued on the current stream (sub-path
    ``drawn``). A tensor that is not dense, another tensor argument (``bernoulli_(p)``
    with a tensor ``p``), or a layout the trial refused: the general path."""
    fb = fallback
    name = backend.name
    rt = backend.runtime
    plan = plan_for(op)
    label = str(op)
    general = stats.noted(general, "general", trace)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if slow is not None and fb.SLOW:
            return slow(args, kwargs)
        t = args[0] if args else None
        if not isinstance(t, Tensor) or t.device.type != name or t.is_conj() or t.is_neg() \
                or not tensors.is_non_overlapping_and_dense(t) \
                or any(isinstance(v, Tensor) for v in (*args[1:], *kwargs.values())):
            return general(args, kwargs)
        given = kwargs.pop("generator", None)
        key = (layout_of(t), tuple(map(layout_of, args[1:])),
               tuple((k, layout_of(v)) for k, v in kwargs.items()))
        ok = layouts.get(key)
        if ok is None:
            ok = fill_trial(op, t, args[1:], kwargs)
            layouts.put(key, ok)
        if not ok:
            return general(args, {**kwargs, "generator": given})
        index = t.device.index
        gen = backend.generators[index] if given is None \
            else hostexec.cpu_generator_of(backend, given, plan)
        drawn = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
        op._op(drawn, *args[1:], **kwargs, generator=gen)  # the numbers, in call order
        view = views.entry(t)[0]
        launch_call(rt, backend.visible[index], backend.current_stream_handle(index), _copy,
                    (view, drawn), {}, label)
        return t

    return stats.traced(kernel, "drawn", trace)


def _dropout_parts(like: Tensor, p: float, gen: torch.Generator) -> tuple[Tensor, float]:
    """``native_dropout``'s mask as its CPU kernel draws it (a ``bernoulli_`` fill of an
    ``empty_like`` of the input, ``like`` a host tensor in its layout) and the output's
    scale."""
    p1m = 1.0 - p
    mask = torch.empty_like(like).bernoulli_(p1m, generator=gen)
    return mask, (0.0 if p1m == 0 else 1.0 / p1m)


def dropout_trial(x: Tensor, p: float, train: bool | None) -> list | None:
    """The layouts of ``native_dropout``'s two results for an input laid out as ``x``, if
    its CPU kernel's bits are the mask drawn by :func:`_dropout_parts` and the input times
    it times the scale; ``None`` otherwise. The CPU's own generator is left as it was."""
    if train is False:
        return None
    n = tensors.storage_nbytes(x.shape, x.stride(), x.element_size()) // x.element_size()
    stand_in = trials.stand_in_values(n, x.dtype, None).as_strided(x.shape, x.stride())
    cpu = torch.default_generator
    saved = cpu.get_state()
    try:
        state = torch.Generator().manual_seed(0).get_state()
        cpu.set_state(state)
        out, mask = NATIVE_DROPOUT._op(stand_in, p, train)
        drawn, scale = _dropout_parts(stand_in, p, _fresh_generator(state))
        mine = stand_in.mul(drawn).mul_(scale)
    except Exception:
        return None
    finally:
        cpu.set_state(saved)
    if not (out.stride() == mine.stride() and trials.same_bits(out, mine)
            and mask.dtype is torch.bool and trials.same_bits(mask, drawn.bool())):
        return None
    return [(tuple(out.shape), out.stride(), out.dtype), (tuple(mask.shape), mask.stride(),
                                                           mask.dtype)]


def launch_dropout(backend: DeviceBackend, views: hostviews.HostViews, specs: list,
                   x: Tensor, p: float, label: str) -> tuple[Tensor, Tensor]:
    """``native_dropout(x, p, train)`` with its mask drawn by the host now, from the
    device's generator; the output and the mask's copy queued on the current stream."""
    index = x.device.index
    outs = [outputs.new_output(backend, index, s) for s in specs]
    xv, ov, mv = views.entry(x)[0], views.entry(outs[0])[0], views.entry(outs[1])[0]
    drawn, scale = _dropout_parts(xv, p, backend.generators[index])

    # the CPU kernel's x * mask * scale, then the mask, each queued as an op of its own
    rt, phys, stream = backend.runtime, backend.visible[index], backend.current_stream_handle(index)
    launch_call(rt, phys, stream, _MUL_OUT, (xv, drawn), {"out": ov}, label)
    launch_call(rt, phys, stream, _MUL_SCALAR_, (ov, scale), {}, label)
    launch_call(rt, phys, stream, _copy, (mv, drawn), {}, label)
    return outs[0], outs[1]
