"""Asynchronous runtimes: results allocated now, the computation queued on the stream."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from torchport.ops import fallback, stats, switch
from torchport.ops.hostkernels import drawing, outputs, trials
from torchport.ops.hostkernels.into_device import IntoDevice
from torchport.ops.hostkernels.layouts import exact_layout_of, layout_of
from torchport.ops.hostkernels.mapping import Call, plain_device

if TYPE_CHECKING:
    from torchport.core.contracts import DeviceBackend

Tensor = torch.Tensor


class Copied(NamedTuple):
    """A layout whose calls queue the functional kernel, its results then copied into
    new device tensors laid out as ``specs`` say (``None``: a result left undefined)."""

    specs: list


class Dropped(NamedTuple):
    """A layout whose ``native_dropout`` calls draw their mask on the host now
    (:func:`.drawing.launch_dropout`), results laid out as ``specs`` say."""

    specs: list


def _dropout_args(args: tuple, kwargs: dict) -> tuple[float, bool | None]:
    """``native_dropout``'s ``p`` and ``train``."""
    p = args[1] if len(args) > 1 else kwargs["p"]
    return p, args[2] if len(args) > 2 else kwargs.get("train")


def launching_kernel(backend: DeviceBackend, into: IntoDevice, general: Call,
                     slow: Call | None, trace: bool = False) -> Callable[..., Any]:
    """Allocate the results now, queue the computation on the current stream, return
    before it ran (sub-path ``launch``). Tensor lists (``cat``, ``index``) too: their
    tensors are all of the one device, or the call is the general path's.

    The results' layouts are the CPU kernel's, and the ``out=`` overload is trusted only
    where it computes into them as they are: the first call with each layout of the
    inputs tries both on stand-ins (:meth:`IntoDevice.launch_specs`; a meta kernel's
    strides for dimensions of size 1, or its dtypes, can differ from the CPU's). An op
    with no such ``out=`` overload for the layout (none at all, a result left undefined,
    a list of results) queues its functional kernel, the results copied into the new
    tensors (:class:`Copied`, :meth:`IntoDevice.launch_copy`). A random op is queued
    that way only where its arguments turn its randomness off (its floats, then, are in
    the key by value); ``native_dropout`` draws its mask on the host at the call
    (:class:`Dropped`). Where neither can be trusted, the host computes the op now
    (``general``)."""
    fb = fallback
    name = backend.name
    rt = backend.runtime
    label = str(into.op)
    layouts = into.layouts  # inputs' layout key -> results' OutputSpecs, Copied, or None
    general = stats.noted(general, "general", trace)
    random = into.plan.random
    key_of = exact_layout_of if random else layout_of
    # may C++ queue a copied launch itself? A foreach op's list of results (an optimizer's
    # ``_foreach_sqrt``), whose layouts no float decides (C++'s key holds a float's type)
    copies_from_cpp = into.list_result and not random and \
        into.op._schema.name.startswith("aten::_foreach_")

    def plan(args: tuple, kwargs: dict) -> list | Copied | Dropped | None:
        if into.out is not None and not random:
            specs = into.launch_specs(args, kwargs)
            if specs is not None:
                return specs
        copied = trials.copy_launch_specs(into.op, args, kwargs)
        if copied is None and into.op is drawing.NATIVE_DROPOUT and isinstance(args[0], Tensor):
            p, train = _dropout_args(args, kwargs)
            dropped = drawing.dropout_trial(args[0], p, train)
            return None if dropped is None else \
                Dropped([outputs.spec_for(backend, *c) for c in dropped])
        if copied is None:
            return None
        return Copied([None if c is None else outputs.spec_for(backend, *c) for c in copied])

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if slow is not None and fb.SLOW:
            return slow(args, kwargs)
        device = plain_device(name, args, kwargs)
        if device is None:
            return general(args, kwargs)
        key = (tuple(map(key_of, args)), tuple((k, key_of(v)) for k, v in kwargs.items()))
        try:
            specs = layouts[key]
        except KeyError:
            specs = plan(args, kwargs)
            layouts.put(key, specs)
        except TypeError:  # an unhashable argument
            specs = plan(args, kwargs)
        if specs is None:
            return general(args, kwargs)
        index = device.index
        if type(specs) is Dropped:
            return drawing.launch_dropout(backend, into.views, specs.specs, args[0],
                                          _dropout_args(args, kwargs)[0], label)
        if type(specs) is Copied:
            r = into.launch_copy(index, specs.specs, args, kwargs, rt, backend.visible[index],
                                 backend.current_stream_handle(index), label)
            teach = switch.QUEUED_TEACH
            if teach is not None and copies_from_cpp and None not in specs.specs:
                teach(into.op, None, specs.specs, copied=True)  # C++ queues it from now on
            return r
        r = into.launch(index, specs, args, kwargs, rt, backend.visible[index],
                        backend.current_stream_handle(index), label)
        teach = switch.QUEUED_TEACH
        if teach is not None and into.queues_from_cpp:  # C++ queues this layout from now on
            teach(into.op, into.out, specs)
        return r

    return stats.traced(kernel, "launch", trace)

