"""How a functional op's results are made on the device (:class:`IntoDevice`).

For each layout of its inputs, a functional op learns once (the first call) whether
its ``out=`` overload can compute straight into new device tensors -- the layouts from
the meta kernel, the bits proven by a trial (:mod:`.trials`) -- and otherwise computes
a CPU result that is then moved to the device (:mod:`.outputs`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from torchport.memory.allocator import ADOPT_MIN_BYTES
from torchport.memory.tensors import storage_ptr
from torchport.ops import derive, hostviews, quiet
from torchport.ops.hostkernels import outputs, schema, trials
from torchport.ops.hostkernels.layouts import LayoutCache
from torchport.ops.hostkernels.mapping import CPU_KS, host_arguments
from torchport.ops.plan import numbers_as_tensors, plan_for

if TYPE_CHECKING:
    from torchport.core.contracts import DeviceBackend

Tensor = torch.Tensor
_CLONE = torch.ops.aten.clone.default
# Functional ops whose CPU kernel is another op with fixed trailing arguments, that op
# having a real out= kernel where theirs is generated (a copy): computed through it, into
# the device tensors, with the same bits. ATen's Activation.cpp: relu is clamp_min(x, 0)
# after refusing bool, which the trial against relu's own kernel keeps.
_SAME_AS = {torch.ops.aten.relu.default: (torch.ops.aten.clamp_min.out, (0,))}
_copy_boxed = torch.ops.aten.copy_.default._handle.redispatch_boxed


def _copy_into(ks: Any, src: Tensor, memory_format: Any = None, *, out: Tensor) -> Tensor:
    """``clone`` into ``out``, laid out already as ``memory_format`` asks."""
    return _copy_boxed(ks, out, src)


def call_out(call: Callable[..., Any], fast: Callable[..., Any] | None, cargs: list,
             kwargs: dict) -> Any:
    """The ``out=`` call: through its Python binding ``fast`` where the trial allowed it and
    no TorchFunctionMode or TorchDispatchMode could see it, else the boxed ``call``."""
    if fast is not None and not torch._C._is_torch_function_mode_enabled() \
            and not torch._C._len_torch_dispatch_stack():
        return fast(*cargs, **kwargs)
    return call(CPU_KS, *cargs, **kwargs)


def device_side(out: Callable[..., Any], cargs: list, ckw: dict) -> None:
    """A queued call (an ``out=`` overload, an in-place op). Device work knows no autograd: on a runtime's own thread
    it runs in inference mode, where it may write host views made inside the caller's
    ``torch.inference_mode()`` (inference tensors)."""
    with torch._C._InferenceMode(True):
        out(*cargs, **ckw)


def launch_call(rt: Any, phys: int, stream: Any, op: Any, cargs: Sequence[Any], ckw: dict,
                label: str) -> None:
    """Queue ``op(*cargs, **ckw)`` (device work on host views) on ``stream``: an ATen
    ``OpOverload`` goes to a runtime that queues its CPU kernel itself (``launch_op``: the
    sim's C++ queues, whose worker then runs it without Python), anything else as a
    closure (:func:`device_side`)."""
    launch_op = getattr(rt, "launch_op", None)
    if launch_op is not None and isinstance(op, torch._ops.OpOverload) \
            and launch_op(phys, stream, op, tuple(cargs), ckw, label):
        return
    rt.launch(phys, stream, lambda: device_side(op, list(cargs), ckw), label)


class IntoDevice:
    """A functional op's results on the device: the layouts its meta kernel gives (in
    ``layouts``, keyed by the inputs' layouts), the ``out=`` overload computing into
    device tensors, and, where that cannot be used, a CPU result moved to the device.

    ``layouts`` maps a layout key to ``(out= call, [OutputSpec], Python binding or
    None)``, or to ``False``: compute on the CPU and move the result (no meta kernel, a
    data-dependent shape, a failed trial)."""

    def __init__(self, backend: DeviceBackend, op: torch._ops.OpOverload,
                 views: hostviews.HostViews, to_cpu: Callable[[Tensor], Tensor],
                 layouts: LayoutCache) -> None:
        self.backend = backend
        self.op = op
        self.to_cpu = to_cpu
        self.views = views
        self.layouts = layouts
        returns = op._schema.returns
        plain = all(isinstance(r.type, torch.TensorType) for r in returns)
        self.out = schema.out_overload(op) if plain else None  # Tensor[] results: CPU, then copy
        self.single = len(returns) == 1 and isinstance(returns[0].type, torch.TensorType)
        self.list_result = len(returns) == 1 and isinstance(returns[0].type, torch.ListType)
        self.out_names: list[str] = []
        self.out_call: Callable[..., Any] | None = None
        if self.out is not None:
            self.out_names = schema.out_names(self.out)
            self.out_call = self.out._handle.redispatch_boxed
        # may C++ queue a launch itself (native_queued_ops.cpp: the functional's arguments,
        # then the outputs, are the out= overload's)?
        self.queues_from_cpp = self.out is not None and \
            [a.name for a in self.out._schema.arguments] == \
            [a.name for a in op._schema.arguments] + self.out_names
        # An out= overload with no CPU kernel of its own (generated: the functional kernel,
        # then a copy into ``out``) costs a copy; clone's is replaced by one copy.
        self.out_copies = self.out is not None and not torch._C._dispatch_has_kernel_for_dispatch_key(
            self.out.name(), "CPU")
        if op is _CLONE:
            self.out_call = _copy_into
            self.out_copies = False
        self.cpu_call = op._op
        self.plan = plan_for(op)
        # Used where a trial shows it reaches ``self.computes_with`` and no mode could see it.
        self.computes_with = self.out
        self.binding = schema.python_binding(self.out) \
            if self.out is not None and op is not _CLONE else None
        same = _SAME_AS.get(op)
        if same is not None and self.out_copies:
            self._compute_with(*same)

    def _compute_with(self, out_op: torch._ops.OpOverload, extra: tuple) -> None:
        """Compute through ``out_op`` (a real ``out=`` kernel) with ``extra`` trailing
        arguments: what the CPU's functional kernel itself calls (:data:`_SAME_AS`)."""
        boxed = out_op._handle.redispatch_boxed
        binding = schema.python_binding(out_op)
        self.out_call = lambda ks, *a, **k: boxed(ks, *a, *extra, **k)
        self.binding = None if binding is None else lambda *a, **k: binding(*a, *extra, **k)
        self.computes_with = out_op
        self.out_copies = False

    def first_call(self, key: tuple, index: int, args: tuple, cargs: list,
                   kwargs: dict) -> Any:
        """The first call with a layout ``key``: the outputs' layouts from the meta kernel,
        then a trial proving that the ``out=`` overload gives the functional CPU kernel's
        bits for inputs laid out so. The ``out=`` overload runs on copies of the inputs
        in their exact layouts, into host outputs filled with a pattern (an unwritten
        output cannot match by chance); the functional kernel runs on the inputs
        themselves and is this call's result (its side effects happen once:
        ``native_batch_norm`` writes its running statistics although its schema does not
        say so). Only if every output and every input the calls wrote are the same
        bytes, with the same layouts, and the ``out=`` call neither fails, warns nor
        resizes its outputs do later calls with this key compute through ``out=``; if
        the meta kernel cannot say, or the trial fails, they compute a CPU result."""
        layouts = self.layouts
        if self.out is None:
            layouts.put(key, False)
            return self.compute(index, args, cargs, kwargs)
        try:
            backend = self.backend
            specs = [outputs.spec_for(backend, shape, stride, dtype)
                     for shape, stride, dtype in derive.output_specs(self.op, args, kwargs)]
        except Exception:  # no meta kernel, a data-dependent shape, a bad input
            layouts.put(key, False)
            return self.compute(index, args, cargs, kwargs)
        if self.out_copies and backend.adopts_host \
                and any(spec.nbytes >= ADOPT_MIN_BYTES for spec in specs):
            # the out= overload computes into a temporary and copies it over; a large
            # CPU result is better adopted as it is
            layouts.put(key, False)
            return self.compute(index, args, cargs, kwargs)
        call = self.out_call
        if schema.number_in_tensor_slot(args, self.plan.number_slots):
            boxed, plan = self.out_call, self.plan
            call = lambda ks, *a, **k: boxed(ks, *numbers_as_tensors(plan, a), **k)  # noqa: E731
        layouts.put(key, False)  # until the trial below has passed (the functional may raise)
        trial = trials.layout_copies(cargs)
        scratch = [trials.patterned(s.size, s.stride, s.dtype) for s in specs]
        ckw = dict(kwargs)
        ckw.update(zip(self.out_names, scratch, strict=True))
        try:
            ok = not quiet.warnings_of(lambda: call(CPU_KS, *trial, **ckw))
        except Exception:
            ok = False
        ok = ok and all((list(x.shape), list(x.stride())) == (s.size, s.stride)
                        for x, s in zip(scratch, specs, strict=True))
        fast = None
        if ok and self.binding is not None:
            fast = self.binding if self._binding_agrees(cargs, kwargs, scratch) else None
        r = self.cpu_call(*cargs, **kwargs)  # this call's result; the CPU's errors are its own
        results: list = []
        if ok:
            results = [r] if isinstance(r, Tensor) else list(r) \
                if isinstance(r, (tuple, list)) else []
            inputs = {storage_ptr(v) for v in trials.flat_tensors(cargs) if v.numel()}
            ok = len(results) == len(scratch) and all(
                isinstance(x, Tensor) and (x.shape, x.stride(), x.dtype)
                == (s.shape, s.stride(), s.dtype) and trials.same_bits(x, s)
                and not (x.numel() and storage_ptr(x) in inputs)
                for x, s in zip(results, scratch, strict=False)) and all(
                trials.same_bits(c, t) for c, t in zip(trials.flat_tensors(cargs),
                                                       trials.flat_tensors(trial), strict=True))
        if not ok:
            return self._moved(r, index, args, cargs)
        layouts.put(key, (call, specs, fast))
        # the results in new device tensors, as the out= route will make them from now on
        outs = [outputs.new_output(backend, index, s) for s in specs]
        outputs.copy_into_views(self.views, outs, results)
        return outs[0] if self.single else tuple(outs)

    def _binding_agrees(self, cargs: list, kwargs: dict, outs: list) -> bool:
        """Does the ``out=`` overload's Python binding (faster than a boxed call), given
        these arguments, reach that same overload, silently, and compute the same bits
        as the trial did into ``outs``? (Its argument parser could pick another overload.)"""
        mine = [trials.patterned(list(o.shape), list(o.stride()), o.dtype) for o in outs]
        ckw = dict(kwargs)
        ckw.update(zip(self.out_names, mine, strict=True))
        copies = trials.layout_copies(cargs)
        seen = trials.OpsSeen()

        def run() -> None:
            with seen:
                self.binding(*copies, **ckw)
        try:
            if quiet.warnings_of(run):
                return False
        except Exception:
            return False
        return seen.ops == [self.computes_with] and all(
            trials.same_bits(m, o) for m, o in zip(mine, outs, strict=True))

    def compute(self, index: int, args: tuple, cargs: list, kwargs: dict) -> Any:
        """The CPU kernel's own results, moved to device ``index``."""
        return self._moved(self.cpu_call(*numbers_as_tensors(self.plan, cargs), **kwargs), index,
                           args, cargs)

    def _moved(self, r: Any, index: int, args: tuple, cargs: list) -> Any:
        """The CPU kernel's results ``r`` (of ``cargs``, the chip's views of ``args``) on
        device ``index``."""
        adopt = self.backend.result_to_device
        views = [c for c, a in zip(cargs, args, strict=True) if isinstance(a, Tensor)]
        cache = self.views
        on_device = outputs.result_on_device
        if isinstance(r, Tensor):
            return on_device(r, index, views, args, adopt, cache)
        if not isinstance(r, (tuple, list)):
            return r  # a number (``_fused_sdp_choice``)
        return type(r)(on_device(x, index, views, args, adopt, cache) if isinstance(x, Tensor)
                       else x for x in r)

    def outputs(self, index: int, call: Callable[..., Any], specs: list,
                fast: Callable[..., Any] | None, cargs: list, kwargs: dict) -> Any:
        """New device tensors laid out as ``specs`` say, ``out=`` into them: the results
        of every call with a learned layout but the single-output fast case."""
        b = self.backend
        outs = [outputs.new_output(b, index, s) for s in specs]
        for n, o in zip(self.out_names, outs, strict=True):
            kwargs[n] = self.views.entry(o)[0]
        call_out(call, fast, cargs, kwargs)
        return outs[0] if self.single else tuple(outs)

    def launch_specs(self, args: tuple, kwargs: dict) -> list | None:
        """:func:`.trials.launch_specs` of this op's ``out=`` overload, as
        :class:`~.outputs.OutputSpec` objects (``None``: no launch for this layout)."""
        specs = trials.launch_specs(self.op, self.out, self.out_names, args, kwargs)
        if specs is None:
            return None
        return [outputs.spec_for(self.backend, shape, stride, dtype)
                for shape, stride, dtype in specs]

    def launch(self, index: int, specs: list, args: tuple, kwargs: dict, rt: Any, phys: int,
               stream: Any, label: str) -> Any:
        """New device tensors laid out as ``specs`` say (from :meth:`launch_specs`), the
        computation into them queued on ``stream``; returns them."""
        b = self.backend
        outs = [outputs.new_output(b, index, s) for s in specs]
        cargs, ckw = host_arguments(self.views, args, kwargs)
        entry = self.views.entry
        ckw.update({n: entry(o, False)[0] for n, o in zip(self.out_names, outs, strict=True)})
        launch_call(rt, phys, stream, self.out, cargs, ckw, label)
        return outs[0] if self.single else tuple(outs)

    def launch_copy(self, index: int, specs: list, args: tuple, kwargs: dict, rt: Any,
                    phys: int, stream: Any, label: str) -> Any:
        """New device tensors laid out as ``specs`` say (from
        :func:`.trials.copy_launch_specs`; ``None``: a result left undefined), and queued
        on ``stream``, the functional CPU kernel with its results copied into them."""
        b = self.backend
        outs = [None if s is None else outputs.new_output(b, index, s) for s in specs]
        cargs, ckw = host_arguments(self.views, args, kwargs)
        entry = self.views.entry
        views = [None if o is None else entry(o, False)[0] for o in outs]
        cpu_call = self.cpu_call

        def functional() -> None:
            r = cpu_call(*cargs, **ckw)
            for v, x in zip(views, [r] if isinstance(r, Tensor) else r, strict=True):
                if v is None:
                    continue
                if x is None or x.shape != v.shape or x.dtype != v.dtype:
                    got = "none" if x is None else f"{x.dtype} {list(x.shape)}"
                    raise RuntimeError(f"{label}: the kernel gave a result of {got} where its "
                                       f"launch made {v.dtype} {list(v.shape)}")
                v.copy_(x)
        rt.launch(phys, stream, lambda: device_side(functional, [], {}), label)
        if self.list_result:
            return outs
        return outs[0] if self.single else tuple(outs)
