"""Per-overload dispatch plans, computed once from the op schema.

Reading ``op._schema`` on every call is what makes a naive Python backend slow;
a plan holds what the fallback and the kernels need to know about an overload:
which arguments are written, which returns alias which argument, whether the
op is a view, a factory or a random op.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

_PLANS: dict[object, OpPlan] = {}


class DeviceMismatchError(RuntimeError):
    """Tensors of one op live on different devices."""


# Where CUDA's kernels take a tensor argument on the CPU next to device tensors; everywhere
# else only TensorIterator's CPU scalars (0-dim) may be (hostexec.op_device applies both).
# CPU_ARGS: any CPU tensor -- index tensors ATen's AdvancedIndex moves to the device (the
# ``values`` of index_put stay on the device unless 0-dim, or the masked_fill shortcut).
_INDICES = frozenset({"indices"})
CPU_ARGS: dict[str, frozenset[str]] = {
    "aten::index.Tensor": _INDICES, "aten::index.Tensor_out": _INDICES,
    "aten::index_put_": _INDICES, "aten::index_put": _INDICES,
    "aten::_index_put_impl_": _INDICES, "aten::_index_put_impl": _INDICES,
}
# HOST_ARGS: arguments CUDA reads on the host and requires on the CPU: foreach's packed
# scalars (ForeachUtils.h ``convert_tensor_to_scalar_list``: "Expected scalars to be on
# CPU"), checked before anything else, so also for integer and bool inputs.
_SCALARS = frozenset({"scalars"})
HOST_ARGS: dict[str, frozenset[str]] = {
    f"aten::_foreach_{op}.Tensor": _SCALARS
    for op in ("addcdiv", "addcdiv_", "addcmul", "addcmul_")
}

# CUDA's registrations of the ops whose native_functions.yaml entry keeps the default
# ``device_check: ExactSame``: torchgen (dest/register_dispatch_key.py, gen_device_check)
# checks their ``out`` and flat positional tensors with ``check_and_update_common_device``
# (ATen/core/op_registration/adaption.h), which takes no CPU scalar: where TensorIterator
# would take a 0-dim CPU tensor, these raise. Read from the yaml torchgen ships, once, on the
# first 0-dim CPU tensor next to device tensors (:func:`cuda_checked_args`).
_NATIVE_FUNCTIONS = ("torchgen", "packaged/ATen/native/native_functions.yaml")
_CUDA_KEYS = frozenset({"CUDA", "SparseCUDA", "SparseCsrCUDA"})
_yaml_facts: dict[str, tuple[bool, str | None, frozenset[str]]] | None = None


def _native_functions() -> dict[str, tuple[bool, str | None, frozenset[str]]]:
    """Overload name -> (device-checked, structured delegate, dispatch keys), scanned from
    the yaml line by line (the few fields needed, no yaml parser)."""
    global _yaml_facts
    if _yaml_facts is not None:
        return _yaml_facts
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec(_NATIVE_FUNCTIONS[0])
    facts: dict[str, tuple[bool, str | None, frozenset[str]]] = {}
    if spec is None or not spec.submodule_search_locations:
        _yaml_facts = facts
        return facts
    path = Path(next(iter(spec.submodule_search_locations))) / _NATIVE_FUNCTIONS[1]
    entry: list[Any] = []  # [name, checked, delegate, keys]

    def close() -> None:
        if entry:
            facts[entry[0]] = (entry[1], entry[2], frozenset(entry[3]))

    in_dispatch = False
    for line in path.read_text().splitlines():
        if line.startswith("- func:"):
            close()
            entry[:] = [line[7:].strip().split("(", 1)[0], True, None, set()]
            in_dispatch = False
        elif not entry:
            continue
        elif line.startswith("    ") and in_dispatch:
            keys = line.split("#", 1)[0].rsplit(":", 1)[0]
            entry[3].update(k.strip() for k in keys.split(","))
        elif line.startswith("  ") and not line.startswith("   "):
            field, _, value = line.strip().partition(":")
            value = value.split("#", 1)[0].strip()
            in_dispatch = field == "dispatch"
            if field == "device_check":
                entry[1] = value != "NoCheck"
            elif field == "structured_delegate":
                entry[2] = value
    close()
    _yaml_facts = facts
    return facts


def composite_elsewhere() -> list[str]:
    """Overloads (``"native_layer_norm"``, ``"addr.out"``) with CPU and CUDA kernels of their
    own whose other devices get a ``CompositeExplicitAutograd`` kernel instead, from the
    yaml torchgen ships: a computation CUDA never runs."""
    return sorted(name for name, (_, _, keys) in _native_functions().items()
                  if {"CPU", "CUDA", "CompositeExplicitAutograd"} <= keys)


_checked: dict[str, tuple[str, ...]] = {}


def cuda_checked_args(plan: OpPlan) -> tuple[str, ...]:
    """The arguments, in order, whose devices CUDA's registration of ``plan``'s op compares
    before its kernel runs, no CPU scalar excepted (none: the op's CUDA kernel, or
    TensorIterator, decides; or it has no CUDA kernel of its own)."""
    got = _checked.get(plan.name)
    if got is None:
        got = _checked[plan.name] = _checked_args(plan)
    return got


def _checked_args(plan: OpPlan) -> tuple[str, ...]:
    facts = _native_functions()
    fact = facts.get(plan.name.removeprefix("aten::"))
    if fact is None or not fact[0]:
        return ()
    keys = fact[2]
    if fact[1] is not None:  # a structured group's functional/in-place: its out= kernel's too
        keys = keys | facts.get(fact[1], (False, None, frozenset()))[2]
    if not keys & _CUDA_KEYS:
        return ()
    positional = tuple(n for n in plan.arg_names if n not in plan.kwarg_only)
    return plan.out_args + positional


def check_common_device(plan: OpPlan, args: tuple, kwargs: dict) -> None:
    """A CPU tensor next to device tensors: CUDA's registration of an op whose
    native_functions.yaml entry keeps ``device_check: ExactSame`` compares the devices of its
    out= and positional tensors before the kernel (adaption.h, no CPU scalar excepted) and
    raises as here; other ops leave it to the kernel (TensorIterator takes a CPU scalar)."""
    checked = cuda_checked_args(plan)
    if not checked:
        return
    bound = bind(plan, args, kwargs)
    common: torch.device | None = None
    for arg in checked:
        v = bound.get(arg)
        for t in (v if isinstance(v, (list, tuple)) else (v,)):
            if not isinstance(t, torch.Tensor):
                continue
            if common is None:
                common = t.device
            elif t.device != common:
                device = common if common.type != "cpu" else t.device
                raise DeviceMismatchError(
                    f"Expected all tensors to be on the same device, but got {arg} is on "
                    f"{t.device}, different from other tensors on {common} (when checking "
                    f"argument in method {plan.overload_name}; CUDA's registration of the op "
                    f"takes no CPU tensor, 0-dim ones neither: move it with .to({str(device)!r}))")


# out= overloads whose CPU kernel writes its output as if it were contiguous: given a
# non-contiguous ``out`` of the right size, it scatters wrong values (CUDA's kernels
# address the output through its strides; op_db marks ``avg_pool3d``'s test_out an
# expected failure on the CPU alone). The host path computes these into contiguous
# results and copies them in (:func:`torchport.ops.hostexec.run_on_host`).
STRIDE_BLIND_OUT = frozenset({
    "aten::avg_pool3d.out", "aten::avg_pool3d_backward.grad_input",
    "aten::adaptive_avg_pool3d.out", "aten::adaptive_avg_pool3d_backward.grad_input",
    "aten::adaptive_max_pool3d.out", "aten::fractional_max_pool3d.output",
    "aten::col2im.out", "aten::im2col.out",
    "aten::slow_conv_transpose2d.out", "aten::slow_conv_transpose3d.out",
})


# Arguments a kernel writes that its schema does not mark (``Tensor(a!)``): native_batch_norm
# updates the running statistics in training, though its schema (older than the annotation)
# says nothing. Every path that runs the op elsewhere than in the argument's memory (the CPU
# fallback on device-only memory, the porting tools' dumps and comparisons) writes them back.
HIDDEN_WRITES: dict[str, tuple[str, ...]] = {
    "aten::native_batch_norm": ("running_mean", "running_var"),
    "aten::native_batch_norm.out": ("running_mean", "running_var"),
}


# Tensor arguments that may hold indices (``target``, ``indices``, ``offsets``, lengths and
# counts): some CPU kernels trust them unchecked (``nll_loss2d_backward`` writes where its
# target points), so an integer stand-in there is 0, the one index valid in every
# non-empty dimension, never a value that would make the kernel write outside its memory.
_INDEX_NAME = re.compile(r"ind|target|offset|bag|length|size|count")


@dataclass(frozen=True)
class OpPlan:
    name: str  # "aten::add.out"
    overload_name: str  # "add.out"
    arg_names: tuple[str, ...]
    kwarg_only: frozenset[str]
    write_args: tuple[str, ...]  # arguments the op mutates, as its schema says
    written_args: tuple[str, ...]  # those and the ones it writes unannounced (HIDDEN_WRITES)
    out_args: tuple[str, ...]  # its out= arguments (written and keyword-only, as in ATen)
    return_alias: tuple[str | None, ...]  # for each return, the argument it is (or None)
    is_view: bool  # returns alias an input without writing it
    is_inplace_or_out: bool
    has_device_arg: bool
    has_generator_arg: bool
    random: bool
    mixed_device_ok: bool  # takes a tensor on the CPU by design (CPU_ARGS or HOST_ARGS)
    cpu_args: frozenset[str]  # CPU_ARGS: may be CPU tensors of any shape
    host_args: frozenset[str]  # HOST_ARGS: must be CPU tensors
    stride_blind_out: bool  # in STRIDE_BLIND_OUT
    num_returns: int
    # positions of single-Tensor arguments: there a boxed call to Python hands a kernel a
    # Python number for a wrapped scalar (``x + 1``, ``copysign(x, 2.0)``)
    number_slots: tuple[int, ...]
    index_args: frozenset[str]  # tensor arguments that may hold indices (_INDEX_NAME)


def plan_for(op: torch._ops.OpOverload) -> OpPlan:
    plan = _PLANS.get(op)
    if plan is None:
        plan = _PLANS[op] = _make_plan(op)
    return plan


def _make_plan(op: torch._ops.OpOverload) -> OpPlan:
    schema = op._schema
    alias_to_arg: dict[str, str] = {}
    write_args, kwarg_only = [], set()
    for a in schema.arguments:
        if a.kwarg_only:
            kwarg_only.add(a.name)
        info = a.alias_info
        if info is not None:
            for s in info.before_set:
                alias_to_arg.setdefault(s, a.name)
            if info.is_write:
                write_args.append(a.name)
    ret_alias: list[str | None] = []
    is_view = False
    for r in schema.returns:
        info = r.alias_info
        if info is None:
            ret_alias.append(None)
            continue
        target = next((alias_to_arg[s] for s in info.before_set if s in alias_to_arg), None)
        ret_alias.append(target)
        if not info.is_write:
            is_view = True
    overload = schema.name.split("::", 1)[-1] + ("." + schema.overload_name
                                                 if schema.overload_name else "")
    names = tuple(a.name for a in schema.arguments)
    name = schema.name + ("." + schema.overload_name if schema.overload_name else "")
    return OpPlan(
        name=name,
        overload_name=overload,
        arg_names=names,
        kwarg_only=frozenset(kwarg_only),
        write_args=tuple(write_args),
        written_args=(*write_args, *HIDDEN_WRITES.get(name, ())),
        out_args=tuple(a for a in write_args if a in kwarg_only),
        return_alias=tuple(ret_alias),
        is_view=is_view,
        is_inplace_or_out=bool(write_args),
        has_device_arg="device" in names,
        has_generator_arg="generator" in names,
        random=torch.Tag.nondeterministic_seeded in op.tags,
        mixed_device_ok=name in CPU_ARGS or name in HOST_ARGS,
        cpu_args=CPU_ARGS.get(name, frozenset()),
        host_args=HOST_ARGS.get(name, frozenset()),
        stride_blind_out=name in STRIDE_BLIND_OUT,
        num_returns=len(schema.returns),
        number_slots=tuple(i for i, a in enumerate(schema.arguments)
                           if not a.kwarg_only and str(a.type) in ("Tensor", "Optional[Tensor]")),
        index_args=frozenset(a.name for a in schema.arguments
                             if "Tensor" in str(a.type) and _INDEX_NAME.search(a.name)),
    )


def named_arguments(plan: OpPlan, args: tuple | list, kwargs: dict) -> list[tuple[str, Any]]:
    """(schema name, value) of each argument of a call."""
    return [*zip(plan.arg_names, args, strict=False), *kwargs.items()]


def numbers_as_tensors(plan: OpPlan, args: tuple) -> tuple:
    """``args`` with each Python number in a Tensor slot made the wrapped-number tensor
    the dispatcher had made of it (a boxed call to Python turns it back into a number,
    which an op's CPU kernel called from Python refuses where it wants a Tensor)."""
    slots = plan.number_slots
    if not slots or not any(i < len(args) and isinstance(args[i], (bool, int, float, complex))
                            for i in slots):
        return args
    return tuple(_wrapped_number(v) if i in slots and isinstance(
        v, (bool, int, float, complex)) else v for i, v in enumerate(args))


def bind(plan: OpPlan, args: tuple, kwargs: dict) -> dict[str, object]:
    """Argument name -> value for a boxed call (positional then keyword)."""
    bound = dict(zip(plan.arg_names, args, strict=False))
    bound.update(kwargs)
    return bound


_native: Any = None


def _wrapped_number(value: bool | int | float | complex) -> torch.Tensor:
    """:func:`torchport.core.native.wrapped_number`, the module imported on first use (importing
    the plans alone stays light) and kept: the op layer's registration makes that first use,
    as a finaliser at exit could no longer import."""
    global _native
    if _native is None:
        from torchport.core import native
        _native = native
    return _native.wrapped_number(value)
