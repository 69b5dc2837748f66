"""What a vendor writes: kernel declarations (:class:`KernelSet`) and :class:`Decline`.

The registry (:mod:`torchport.ops.registry`) turns them into dispatcher registrations;
this module depends on nothing of torchport, so a backend's kernels and the op layer's
paths both import it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch


class Decline(Exception):
    """Raised by a kernel that does not handle this input; the op takes the next path."""


@dataclass(frozen=True)
class CFunction:
    """A C kernel's entry (``torchport_kernel.h``): its address in the vendor's library."""

    address: int
    name: str = ""

    @staticmethod
    def of(fn: Any) -> CFunction:
        """``fn``: a ``ctypes`` function of a loaded library, or an address."""
        if isinstance(fn, int):
            return CFunction(fn, hex(fn))
        import ctypes  # (only a C kernel's declaration needs it)

        try:
            address = ctypes.cast(fn, ctypes.c_void_p).value
        except ctypes.ArgumentError:
            address = None
        if not address:
            raise TypeError(f"c_out_kernel: expected a ctypes function of a loaded library "
                            f"(ctypes.CDLL(path).name) or its address, not {fn!r}")
        return CFunction(address, getattr(fn, "__name__", hex(address)))


@dataclass
class KernelDecl:
    name: str  # as declared: "add", "add.out", "mm"
    fn: Callable[..., Any] | None  # ATen-signature kernel, or None for host ops
    to_cpu: Callable[[torch.Tensor], torch.Tensor] | None = None
    dtypes: frozenset[torch.dtype] | None = None
    kind: str = "aten"  # "aten": as registered; "out": functional/in-place derived; "host";
    # "autograd"; "sparse": for sparse tensors of ``layout``; "sparse_host"/"quantized_host":
    # the CPU's sparse/quantized kernels over ``to_cpu``'s views
    derived_from: str | None = None  # for overloads derived from an out= kernel
    layout: torch.layout | None = None  # a "sparse" kernel's layout
    math_bits: bool = False  # the kernel reads conjugate/negative bits itself (else resolved)

    def derived(self, out_name: str) -> KernelDecl:
        return KernelDecl(self.name, self.fn, self.to_cpu, self.dtypes, self.kind, out_name,
                          self.layout, self.math_bits)


@dataclass
class KernelSet:
    """Kernels of one backend, declared by ATen op name."""

    name: str = "kernels"
    decls: list[KernelDecl] = field(default_factory=list)

    def kernel(self, name: str, dtypes: Iterable[torch.dtype] | None = None, *,
               math_bits: bool = False):
        """Decorator: ``fn`` implements ``name`` (an overload, or every overload of a name).

        ``fn`` gets tensors without conjugate or negative bits (``x.conj()``,
        ``torch._neg_view``): torchport materialises such arguments first and writes a
        written argument carrying one back through it. ``math_bits=True`` declares that
        ``fn`` reads the bits itself (as CUDA's kernels do), and is handed the views."""
        def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
            self.decls.append(KernelDecl(name, fn, None, frozenset(dtypes) if dtypes else None,
                                         math_bits=math_bits))
            return fn
        return deco

    def out_kernel(self, name: str, dtypes: Iterable[torch.dtype] | None = None, *,
                   math_bits: bool = False):
        """Decorator: ``fn`` implements the ``out=`` overload(s) ``name`` (``"add.out"``, or
        ``"add"`` for every out= overload of add); torchport derives the functional and
        in-place overloads (:mod:`torchport.ops.derive`). ``fn`` gets ready outputs, and
        tensors without conjugate or negative bits unless ``math_bits`` (:meth:`kernel`)."""
        def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
            self.decls.append(KernelDecl(name, fn, None, frozenset(dtypes) if dtypes else None,
                                         "out", math_bits=math_bits))
            return fn
        return deco

    def c_out_kernel(self, name: str, fn: Any, dtypes: Iterable[torch.dtype] | None = None
                     ) -> None:
        """``fn``, a C function (``int32_t fn(const TorchportCall*)``, as ``torchport_kernel.h``
        declares; a ``ctypes`` function of the vendor's library, or its address), implements
        the ``out=`` overload(s) ``name`` as :meth:`out_kernel`'s ``fn`` does; torchport calls
        it from C++ without Python where it can (``torchport.ops.c_kernels``)."""
        self.decls.append(KernelDecl(name, CFunction.of(fn),  # type: ignore[arg-type]
                                     None, frozenset(dtypes) if dtypes else None, "out"))

    def autograd_kernel(self, name: str):
        """Decorator: ``fn`` replaces ``name`` on the device's autograd key -- for ops that
        decompose above the backend (CompositeImplicitAutograd) when the device has a
        better way; ``fn`` calls ops with derivatives of their own."""
        def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
            self.decls.append(KernelDecl(name, fn, None, None, "autograd"))
            return fn
        return deco

    def sparse_kernel(self, name: str, layout: torch.layout = torch.sparse_coo):
        """Decorator: ``fn`` implements ``name`` (ATen signature) when an argument is a sparse
        tensor of ``layout`` (``torch.sparse_coo``; any compressed layout -- CSR, CSC, BSR,
        BSC -- shares one dispatch key); it gets and returns device tensors, and may raise
        :class:`Decline` to let PyTorch's CPU sparse kernel serve the call."""
        if layout == torch.strided:
            raise ValueError("sparse_kernel: layout must be a sparse layout (torch.sparse_coo, "
                             "torch.sparse_csr, ...); declare strided kernels with kernel()")

        def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
            self.decls.append(KernelDecl(name, fn, None, None, "sparse", layout=layout))
            return fn
        return deco

    def sparse_host_ops(self, to_cpu: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Declare PyTorch's CPU sparse kernels this device's own, run on views made by
        ``to_cpu`` of the indices and values (as :meth:`host_ops` does for dense ops): they
        serve sparse ops as native kernels, without a fallback warning."""
        self.decls.append(KernelDecl("sparse", None, to_cpu, None, "sparse_host"))

    def quantized_host_ops(self, to_cpu: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Declare PyTorch's CPU quantized kernels this device's own (those of
        ``QuantizedCPU``, and the dense ops that make quantized tensors, such as
        ``quantize_per_tensor``), run on views made by ``to_cpu`` of the device's bytes (as
        :meth:`sparse_host_ops` does for sparse ones): native kernels, without a fallback
        warning."""
        self.decls.append(KernelDecl("quantized", None, to_cpu, None, "quantized_host"))

    def host_ops(self, names: Iterable[str], to_cpu: Callable[[torch.Tensor], torch.Tensor],
                 dtypes: Iterable[torch.dtype] | None = None) -> None:
        """Declare ops run by the CPU kernel on zero-copy views made by ``to_cpu``."""
        ds = frozenset(dtypes) if dtypes else None
        for n in names:
            self.decls.append(KernelDecl(n, None, to_cpu, ds, "host"))
