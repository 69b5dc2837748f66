"""Kernel registry: how a vendor's kernels reach PyTorch's dispatcher.

A vendor groups kernels in a :class:`KernelSet` and hands it to its
:class:`~torchport.backend.Backend`. Two kinds of declaration:

* ``@ks.kernel("mm")`` / ``@ks.kernel("add.Tensor")`` -- a plain ATen-signature
  kernel: it receives device tensors and returns device tensors, full control;
* ``ks.host_ops(["add", "mul.out"], to_cpu=...)`` -- run PyTorch's CPU kernel on
  the device's own view of its memory (what a simulator or a unified-memory
  device can do; the sim backend's kernels are made this way).

A name without overload (``"add"``) covers the whole family. Every overload
without a kernel reaches the CPU fallback (``torchport.ops.fallback``).
Declarations stay inspectable: :func:`native_overloads` lists them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from torchport.ops import core, fallback, hostexec

if TYPE_CHECKING:
    from torchport.backend import Backend


class Decline(Exception):
    """Raised by a kernel that does not handle this input; the op takes the next path."""


@dataclass
class KernelDecl:
    name: str  # as declared: "add", "add.out", "mm"
    fn: Callable[..., Any] | None  # ATen-signature kernel, or None for host ops
    to_cpu: Callable[[torch.Tensor], torch.Tensor] | None = None
    dtypes: frozenset[torch.dtype] | None = None


@dataclass
class KernelSet:
    """Kernels of one backend, declared by ATen op name."""

    name: str = "kernels"
    decls: list[KernelDecl] = field(default_factory=list)

    def kernel(self, name: str, dtypes: Iterable[torch.dtype] | None = None):
        """Decorator: ``fn`` implements ``name`` (an overload, or every overload of a name)."""
        def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
            self.decls.append(KernelDecl(name, fn, None, frozenset(dtypes) if dtypes else None))
            return fn
        return deco

    def host_ops(self, names: Iterable[str], to_cpu: Callable[[torch.Tensor], torch.Tensor],
                 dtypes: Iterable[torch.dtype] | None = None) -> None:
        """Declare ops run by the CPU kernel on zero-copy views made by ``to_cpu``."""
        ds = frozenset(dtypes) if dtypes else None
        for n in names:
            self.decls.append(KernelDecl(n, None, to_cpu, ds))


def resolve_overloads(name: str) -> list[torch._ops.OpOverload]:
    """``"add"`` -> every overload of aten.add; ``"add.out"`` -> that one."""
    base, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, base, None)
    if packet is None:
        raise ValueError(f"unknown ATen op {name!r}")
    if overload:
        return [getattr(packet, overload)]
    return [getattr(packet, o) for o in packet.overloads()]


def _has_backend_slot(op: torch._ops.OpOverload) -> bool:
    """False for ops that decompose above the backend (CompositeImplicitAutograd)."""
    name = op._schema.name + ("." + op._schema.overload_name if op._schema.overload_name else "")
    try:
        return not torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeImplicitAutograd")
    except RuntimeError:  # TorchScript-only overloads (aten::add.t) are not dispatcher ops
        return False


_NATIVE: dict[str, KernelDecl] = {}


def native_overloads() -> dict[str, KernelDecl]:
    """Overload name ("add.out") -> its declaration, for tools and reports."""
    return dict(_NATIVE)


def _host_kernel(backend: Backend, op: torch._ops.OpOverload, decl: KernelDecl):
    to_cpu = decl.to_cpu

    def kernel(*args: Any, **kwargs: Any) -> Any:
        return hostexec.run_on_host(backend, op, args, kwargs, to_cpu, True)
    return kernel


def install(backend: Backend) -> None:
    """Register core kernels, the backend's kernel sets and the fallback."""
    lib = torch.library.Library("aten", "IMPL")
    backend._libs.append(lib)
    taken: set[str] = set()
    for name, fn in core.core_kernels(backend).items():
        lib.impl(name, fn, "PrivateUse1")
        taken.add(name)
    for ks in backend.kernel_sets:
        for decl in ks.decls:
            for op in resolve_overloads(decl.name):
                oname = op._schema.name.split("::")[1] + (
                    "." + op._schema.overload_name if op._schema.overload_name else "")
                if oname in taken or not _has_backend_slot(op):
                    continue
                fn = decl.fn if decl.fn is not None else _host_kernel(backend, op, decl)
                lib.impl(oname, fn, "PrivateUse1")
                taken.add(oname)
                _NATIVE[oname] = decl
    fb = torch.library.Library("_", "IMPL")
    backend._libs.append(fb)
    fb.fallback(fallback.make_fallback(backend), "PrivateUse1", with_keyset=True)
