"""What an op's schema says about the host kernel it can have, decided once per op.

Every predicate here reads only the schema (through :func:`torchport.ops.plan.plan_for`)
and PyTorch's dispatcher tables, never a call's arguments: the entry point
(:mod:`torchport.ops.hostkernels`) asks them once, when the kernel is registered.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torchport.ops.plan import plan_for

Tensor = torch.Tensor
_has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key


def takes_tensor_lists(op: torch._ops.OpOverload) -> bool:
    """Does ``op`` take a ``Tensor[]`` argument (``cat``, ``index``, ``_foreach_*``)?"""
    return any(isinstance(a.type, torch.ListType) and "Tensor" in str(a.type.getElementType())
               for a in op._schema.arguments)


def qualifies(op: torch._ops.OpOverload, lists: bool = False, random: bool = False) -> bool:
    """Can calls of ``op`` map their tensors to the chip's views and compute into new
    device tensors? ``lists``: also ops taking tensor lists (``cat``, ``index``,
    ``_foreach_*``); ``random``: also random ops (:func:`random_functional`)."""
    p = plan_for(op)  # (a list kernel sends any tensor of another device to the general path)
    return not (p.write_args or (p.random and not random) or p.has_device_arg or p.is_view
                or (p.mixed_device_ok and not lists) or p.host_args or p.num_returns == 0
                or (not lists and takes_tensor_lists(op)))


def in_place(op: torch._ops.OpOverload) -> bool:
    """An in-place op (``add_``, ``_foreach_mul_``, ``index_put_``): it writes its first
    argument (a tensor or a list of them) and returns it or nothing; no resize, no
    randomness. (``index_put_`` with CPU indices, which CUDA accepts, reaches the general
    path: the in-place kernel takes tensors of the device only; so do ops whose argument
    must be on the CPU, ``_foreach_addcdiv_``'s ``scalars``: a device one raises there.)"""
    p = plan_for(op)
    first = p.arg_names[0] if p.arg_names else None
    return (op._schema.name.endswith("_") and p.write_args == (first,) and not p.random
            and not p.host_args
            and not p.has_device_arg and all(a == first for a in p.return_alias))


def out_call(op: torch._ops.OpOverload) -> bool:
    """An ``out=`` overload (``add.out``, ``max.dim_max``): it writes only its keyword-only
    outputs, draws no random number, and takes no device argument."""
    p = plan_for(op)
    outs = [a for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    return bool(outs) and all(a.kwarg_only for a in outs) \
        and set(p.write_args) == {a.name for a in outs} and not p.random \
        and not p.has_device_arg and not p.is_view


def random_fill(op: torch._ops.OpOverload) -> bool:
    """An in-place random op filling its first argument from a generator it may be given
    (``uniform_``, ``normal_``, ``bernoulli_``, ``random_``, ``exponential_``...): whether
    a call's numbers are independent of the tensor's values is the kernel's trial
    (:func:`.drawing.fill_trial`)."""
    p = plan_for(op)
    first = p.arg_names[0] if p.arg_names else None
    return (op._schema.name.endswith("_") and p.write_args == (first,) and p.random
            and p.has_generator_arg and not p.has_device_arg
            and all(a == first for a in p.return_alias))


def writes_lists_in_place(op: torch._ops.OpOverload) -> bool:
    """An in-place op writing several tensor lists and returning nothing: the fused
    optimizers (``_fused_adamw_`` updates parameters, gradients, moments). Like
    :func:`in_place` ops, they never resize and draw no random numbers."""
    p = plan_for(op)
    types = {a.name: str(a.type) for a in op._schema.arguments}
    return (op._schema.name.endswith("_") and p.num_returns == 0 and len(p.write_args) > 1
            and not p.random and not p.has_device_arg
            and all(types[n] == "List[Tensor]" for n in p.write_args))


def factory(op: torch._ops.OpOverload, random: bool = False) -> bool:
    """A factory op whose CPU kernel is PyTorch's composite one (``full``, ``zeros_like``,
    ``new_ones``, ``scalar_tensor``, ``arange``): a ``device=`` argument, one new tensor,
    nothing written, nothing random; ``empty`` plus an op that fills it. ``random``: random
    ones too (``randn``, ``rand_like``: ``empty`` plus an in-place random op, which draws
    from the device's generator when it runs on the device)."""
    p = plan_for(op)
    name = op.name()
    return p.has_device_arg and p.num_returns == 1 and not (
        p.write_args or (p.random and not random) or p.is_view or p.mixed_device_ok
        or takes_tensor_lists(op)) and _has_kernel(name, "CompositeExplicitAutograd") \
        and not _has_kernel(name, "CPU")


def random_functional(op: torch._ops.OpOverload) -> bool:
    """A random op that is otherwise a plain functional one (``native_dropout``, the CPU
    flash attention with its ``dropout_p``): no generator argument, no tensor lists."""
    p = plan_for(op)
    return p.random and not p.has_generator_arg and qualifies(op, random=True)


def composite_view(op: torch._ops.OpOverload) -> bool:
    """A view op whose CPU kernel is a composite one calling ``as_strided`` (``select``,
    ``permute``, ``expand``...), returning a view of its first argument."""
    p = plan_for(op)
    return p.is_view and not _has_kernel(op.name(), "CPU") \
        and _has_kernel(op.name(), "CompositeExplicitAutograd") \
        and p.num_returns == 1 and p.return_alias == (p.arg_names[0],) \
        and isinstance(op._schema.arguments[0].type, torch.TensorType)


def number_in_tensor_slot(args: tuple, slots: tuple[int, ...]) -> bool:
    """Does a call hand a Python number where a Tensor goes (``OpPlan.number_slots``)?"""
    return any(i < len(args) and args[i] is not None and not isinstance(args[i], Tensor)
               for i in slots)


def sees_view_bits(op: torch._ops.OpOverload) -> bool:
    """Can a conjugate or negative view reach ``op``'s backend kernel? Only when the op
    has its own Conjugate/Negative kernel (a fallthrough: views, copies, some linear
    algebra); PyTorch's fallbacks for those keys materialise such inputs first."""
    name = op._schema.name + ("." + op._schema.overload_name if op._schema.overload_name
                              else "")
    return any(_has_kernel(name, k) for k in (torch._C.DispatchKey.Conjugate,
                                              torch._C.DispatchKey.Negative))


def out_overload(op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """The ``out=`` overload computing what functional ``op`` returns (``add.Tensor`` ->
    ``add.out``), or ``None``."""
    def inputs(schema: Any) -> list[tuple[str, str]]:
        return [(a.name, str(a.type)) for a in schema.arguments
                if not (a.alias_info is not None and a.alias_info.is_write)]
    want = inputs(op._schema)
    n = len(op._schema.returns)
    for name in op.overloadpacket.overloads():
        cand = getattr(op.overloadpacket, name)
        s = cand._schema
        outs = [a for a in s.arguments if a.alias_info is not None and a.alias_info.is_write]
        if cand is not op and len(outs) == n and all(a.kwarg_only for a in outs) \
                and inputs(s) == want:
            return cand
    return None


def out_names(op: torch._ops.OpOverload) -> list[str]:
    """The names of an ``out=`` overload's written arguments, in order."""
    return [a.name for a in op._schema.arguments
            if a.alias_info is not None and a.alias_info.is_write]


_BINDING_MODULES = (torch._C._VariableFunctions, torch._C._nn, torch._C._linalg,
                    torch._C._special, torch._C._fft)


def python_binding(op: torch._ops.OpOverload) -> Callable[..., Any] | None:
    """The generated Python function of ``op``'s name (``torch.add`` for ``add.out``):
    its argument parser and unboxed call cost about half of a boxed call. It chooses
    the overload from the arguments, so a caller must check which one it reached."""
    name = op._schema.name.split("::")[1]
    for m in _BINDING_MODULES:
        f = getattr(m, name, None)
        if f is not None:
            return f
    return None


def foreach_twin(op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """The in-place twin of a functional foreach op taking a tensor list first
    (``_foreach_sqrt_`` of ``_foreach_sqrt``), or ``None``."""
    name = op._schema.name.split("::")[1]
    args = op._schema.arguments
    if not name.startswith("_foreach_") or not args or str(args[0].type) != "List[Tensor]":
        return None
    packet = getattr(torch.ops.aten, name + "_", None)
    twin = getattr(packet, op._overloadname, None) if packet is not None else None
    if twin is None or not in_place(twin) or \
            [str(a.type) for a in twin._schema.arguments] != [str(a.type) for a in args]:
        return None
    return twin


def per_tensor_out(op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """For a unary foreach op (``_foreach_sqrt``), its per-tensor ``out=`` overload
    (``sqrt.out``): the CPU's foreach kernel for these applies the per-tensor op to each
    tensor, so the bits are the same."""
    name = op._schema.name.split("::")[1]
    if not name.startswith("_foreach_") or op._overloadname != "default" \
            or [str(a.type) for a in op._schema.arguments] != ["List[Tensor]"]:
        return None
    packet = getattr(torch.ops.aten, name[len("_foreach_"):], None)
    out = getattr(packet, "out", None) if packet is not None else None
    if out is None or [(a.name, str(a.type)) for a in out._schema.arguments] != \
            [("self", "Tensor"), ("out", "Tensor")]:
        return None
    return out
