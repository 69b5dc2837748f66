"""Host kernels: PyTorch's CPU kernels run on the chip's views of device memory.

A backend declares an op ``host`` (:class:`torchport.ops.KernelSet`) when its device
memory can be viewed from the host (the sim; a vendor's unified-memory device). Its
kernel is chosen once per op, by the first row of :data:`KINDS` whose test the op's
schema passes; each kind maps the common call shape itself and hands anything else
to the general path, :func:`torchport.ops.hostexec.run_on_host`, which handles the
whole schema. ``torchport.ops.record()`` counts, per op, the sub-path each call took
(``native:out``, ``native:trial``, ``native:cpu-result``, ``native:general``...).

=============== ================================ ===================================== ==========================
kind            applies to                       does                                  falls back to
=============== ================================ ===================================== ==========================
view            view ops                         PyTorch's CPU view kernel on the      (its errors are the CPU's)
                                                 device tensor; composite views cached
                                                 as one ``as_strided`` (view-cached)
in-place        ``add_``, ``index_put_``...      the CPU kernel writes the chip's view general: another device, a
                                                 (in-place); asynchronous runtime:     conj view; async: an op
                                                 elementwise and foreach ops queued    that can fail on values
                                                 on the stream (launch)
lists-in-place  fused optimizers                 the same, tensor lists and keyword    general
                                                 tensors mapped (in-place)
factory         ``zeros_like``, ``full``...      PyTorch's composite on the device     general: pinned memory
                                                 (composite); fills learnt, then one
                                                 allocation and one fill (fill)
random          ``native_dropout``...            the CPU kernel on the views drawing   general
                (synchronous runtime)            from the device generator (random)
lists           ``cat``, ``index``, foreach      ``out=`` into new device tensors      general
                (synchronous runtime)            (out, trial), foreach twins, or CPU
                                                 results moved (cpu-result)
launch          functional ops, ``cat``,         the ``out=`` call queued on the       general: the host computes
                ``index``, ``native_dropout``    current stream (launch); else the     after the stream
                (asynchronous runtime)           functional kernel, results copied;
                                                 dropout's mask drawn at the call
functional      functional ops                   ``out=`` into new device tensors      general
                (synchronous runtime)            (out; trial on a new layout) or a CPU
                                                 result moved (cpu-result)
out-call        ``add.out``... (asynchronous     the ``out=`` kernel queued on the     general: an output to
                runtime)                         stream into the outputs as they are   resize, or sharing memory
                                                 (launch)                              with an input
drawn           ``uniform_``, ``normal_``...     the host draws the numbers now into   general: values the draws
                (asynchronous runtime)           a temporary; their copy is queued     depend on, not dense
general         everything else                  the whole schema, on host views or    (the CPU's errors)
                                                 copies (general)
=============== ================================ ===================================== ==========================
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from torchport.ops import fallback, hostexec, hostviews, stats
from torchport.ops.hostkernels import schema, trials
from torchport.ops.hostkernels.drawing import fill_kernel
from torchport.ops.hostkernels.factories import factory_kernel
from torchport.ops.hostkernels.functional import functional_kernel, random_kernel
from torchport.ops.hostkernels.inplace import inplace_kernel, lists_inplace_kernel
from torchport.ops.hostkernels.into_device import IntoDevice
from torchport.ops.hostkernels.launching import launching_kernel
from torchport.ops.hostkernels.layouts import LayoutCache
from torchport.ops.hostkernels.lists import list_kernel
from torchport.ops.hostkernels.mapping import Call, plain_device, sync_devices
from torchport.ops.hostkernels.out_calls import out_call_kernel
from torchport.ops.hostkernels.views import view_kernel
from torchport.ops.plan import plan_for

if TYPE_CHECKING:
    from torchport.core.contracts import DeviceBackend

Tensor = torch.Tensor


class OpState:
    """What an op's kernels share: the backend's view cache for its ``to_cpu``, the
    op's one :class:`LayoutCache`, and (made when a kind needs it) its
    :class:`IntoDevice`. The kernel run normally and the one run while recording
    (``trace``) share it, so recording sees the caches the program built."""

    def __init__(self, backend: DeviceBackend, op: torch._ops.OpOverload,
                 to_cpu: Callable[[Tensor], Tensor]) -> None:
        self.backend = backend
        self.op = op
        self.to_cpu = to_cpu
        self.views = hostviews.for_to_cpu(to_cpu, backend.devices)
        self.layouts = LayoutCache()
        self._into: IntoDevice | None = None

    @property
    def into(self) -> IntoDevice:
        if self._into is None:
            self._into = IntoDevice(self.backend, self.op, self.views, self.to_cpu,
                                    self.layouts)
        return self._into


Make = Callable[[OpState, Call, "Call | None", bool], Callable[..., Any]]


@dataclass(frozen=True)
class Kind:
    """A row of :data:`KINDS`: ``applies(op, asynchronous)`` selects it, ``make(state,
    general, slow, trace)`` builds the kernel."""

    name: str
    applies: Callable[[torch._ops.OpOverload, bool], bool]
    make: Make
    does: str


def _lists(op: torch._ops.OpOverload, asynchronous: bool) -> bool:
    return not asynchronous and schema.takes_tensor_lists(op) and not schema.qualifies(op) \
        and schema.qualifies(op, lists=True)


def _list_into(s: OpState) -> IntoDevice | None:
    return s.into if schema.foreach_twin(s.op) is None else None


KINDS: tuple[Kind, ...] = (
    Kind("view", lambda op, a: plan_for(op).is_view,
         lambda s, g, slow, t: view_kernel(s.op, s.layouts, slow, t),
         "PyTorch's CPU view kernel on the device tensor"),
    Kind("in-place", lambda op, a: schema.in_place(op),
         lambda s, g, slow, t: inplace_kernel(s.backend, s.op, s.views, s.layouts, g, slow, t),
         "the CPU kernel writes the chip's view of its first argument"),
    Kind("lists-in-place", lambda op, a: schema.writes_lists_in_place(op),
         lambda s, g, slow, t: lists_inplace_kernel(s.backend, s.op, s.views, g, slow, t),
         "the CPU kernel updates the chip's views of its tensor lists"),
    Kind("factory", lambda op, a: schema.factory(op),
         lambda s, g, slow, t: factory_kernel(s.backend, s.op, s.views, s.layouts, g, slow, t),
         "PyTorch's composite on the device; fills as one allocation and one fill"),
    Kind("random", lambda op, a: not a and schema.random_functional(op),
         lambda s, g, slow, t: random_kernel(s.backend, s.into, g, slow, t),
         "the CPU kernel on the chip's views, drawing from the device generator"),
    Kind("lists", _lists,
         lambda s, g, slow, t: list_kernel(s.backend, s.op, s.views, _list_into(s), g, slow, t),
         "out= into new device tensors, foreach twins, or CPU results moved"),
    Kind("launch", lambda op, a: a and (schema.qualifies(op, lists=True)
                                        or schema.random_functional(op)),
         lambda s, g, slow, t: launching_kernel(s.backend, s.into, g, slow, t),
         "the out= call queued on the current stream"),
    Kind("functional", lambda op, a: not a and schema.qualifies(op),
         lambda s, g, slow, t: functional_kernel(s.backend, s.into, g, slow, t),
         "out= into new device tensors, or a CPU result moved"),
    Kind("out-call", lambda op, a: a and schema.out_call(op),
         lambda s, g, slow, t: out_call_kernel(s.backend, s.op, s.views, s.layouts, g, slow, t),
         "the out= kernel queued into outputs of the result's shape"),
    Kind("drawn", lambda op, a: a and schema.random_fill(op),
         lambda s, g, slow, t: fill_kernel(s.backend, s.op, s.views, s.layouts, g, slow, t),
         "the host draws the numbers now; their copy is queued"),
    Kind("general", lambda op, a: True,
         lambda s, g, slow, t: stats.traced(lambda *args, **kw: g(args, kw), "general", t),
         "the whole schema on host views or copies (hostexec.run_on_host)"),
)


def kind_of(op: torch._ops.OpOverload, asynchronous: bool = False) -> Kind:
    """The :data:`KINDS` row whose kernel ``op`` gets on a (a)synchronous runtime."""
    return next(k for k in KINDS if k.applies(op, asynchronous))


def _general(state: OpState, slow: Call | None) -> Call:
    """The general path of ``state.op``'s kernels (``slow`` first while it is set)."""
    backend, op, to_cpu = state.backend, state.op, state.to_cpu
    run = hostexec.run_on_host
    fb = fallback
    asynchronous = backend.runtime.asynchronous
    name = backend.name

    def general(args: tuple, kwargs: dict) -> Any:
        if slow is not None and fb.SLOW:
            return slow(args, kwargs)
        if asynchronous:  # computed by the host right now: queued kernels first, unless
            if plain_device(name, args, kwargs) is not None:  # (devices are checked first)
                trials.raise_refused_layouts(op, args, kwargs)  # the layouts refuse it
            sync_devices(backend, args, kwargs)
        return run(backend, op, args, kwargs, to_cpu, True)

    return general


def host_kernels(backend: DeviceBackend, op: torch._ops.OpOverload,
                 to_cpu: Callable[[Tensor], Tensor], slow: Call | None = None
                 ) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``op``'s host kernel and its twin for recording, sharing one :class:`OpState`.

    The kernel hands its calls to ``slow(args, kwargs)`` while ``fallback.SLOW`` is set
    (ops forced to the CPU, statistics, debug hooks); the twin, called there, notes the
    sub-path each call takes (:func:`torchport.ops.stats.note_subpath`)."""
    state = OpState(backend, op, to_cpu)
    kind = kind_of(op, backend.runtime.asynchronous)
    kernel = kind.make(state, _general(state, slow), slow, False)
    traced = kind.make(state, _general(state, None), None, True)
    return kernel, traced


def host_kernel(backend: DeviceBackend, op: torch._ops.OpOverload,
                to_cpu: Callable[[Tensor], Tensor], slow: Call | None = None) -> Callable[..., Any]:
    """``op``'s host kernel alone (:func:`host_kernels`)."""
    state = OpState(backend, op, to_cpu)
    kind = kind_of(op, backend.runtime.asynchronous)
    return kind.make(state, _general(state, slow), slow, False)


__all__ = ["KINDS", "IntoDevice", "Kind", "OpState", "host_kernel", "host_kernels", "kind_of"]
