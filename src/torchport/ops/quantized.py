"""Quantized device tensors (the ``QuantizedPrivateUse1`` dispatch key) and the int8/int4
matmul kernels quantized inference reaches.

PyTorch keys a quantized tensor on the device ``QuantizedPrivateUse1`` and has no kernel
of its own there. This module registers one handler for the key (its boxed fallback, and
the kernel of each op with a QuantizedCPU kernel of its own, :func:`install`), with two
paths:

* metadata -- views, the quantization parameters (``q_scale``, ``q_per_channel_scales``...),
  ``set_`` and the quantized factories: PyTorch's QuantizedCPU kernel itself, which only
  touches the tensor's metadata and, for the factories, allocates through the device's
  registered allocator (``new_qtensor``), so it serves device tensors as they are;
* values -- everything else (``dequantize``, ``int_repr``, ``clone``, ``equal``, quantized
  arithmetic): the CPU fallback, which runs PyTorch's CPU quantized kernel on the host's
  view (or copy) of the device tensors (:mod:`torchport.memory.qtensors` makes those views) and
  returns results to the device. Results are the CPU's, bit for bit.

A device whose kernels are CPU kernels on its own view of its memory (the sim) declares
those CPU kernels its own with ``ks.quantized_host_ops(to_cpu)``, as it does the sparse
ones: then they run on that view as native kernels, without a fallback warning, and so do
the dense ops that make quantized tensors (:data:`QUANTIZING`, ``quantize_per_tensor``...).

Copies (``copy_``, ``.to``) reach ``_copy_from`` here, served by :func:`copy`.

The int8/int4 matmuls (:data:`LOW_BIT_KERNELS`) are ordinary dense ops a vendor declares in
its kernel set; :func:`install_int_mm_route` sends torchao's int8 x int8 products to
``_int_mm`` on the device.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from torchport.core import native
from torchport.memory import qtensors, tensors
from torchport.memory.allocator import NativeAllocator
from torchport.ops import fallback, hostexec, stats
from torchport.ops.declarations import Decline
from torchport.ops.plan import plan_for

if TYPE_CHECKING:
    from torchport.core.contracts import DeviceBackend

# Ops whose QuantizedCPU kernel reads and writes metadata only (device-generic).
METADATA = frozenset({
    "q_scale", "q_zero_point", "qscheme", "q_per_channel_scales", "q_per_channel_zero_points",
    "q_per_channel_axis", "_empty_affine_quantized", "_empty_per_channel_affine_quantized",
    "empty_quantized", "empty", "empty_strided", "empty_like", "set_", "is_set_to",
    "as_strided", "view", "_reshape_alias", "_unsafe_view", "alias", "is_same_size",
})


# The low-bit matmul kernels quantized inference reaches (torchao's int8 and int4 paths,
# PyTorch's own int8/int4 packed-weight kernels): the overloads a vendor declares natively
# (``KernelSet.kernel``/``out_kernel``); the sim runs the CPU's on its memory. Without a
# declaration they take the CPU fallback.
LOW_BIT_KERNELS = ("_int_mm", "_weight_int8pack_mm", "_convert_weight_to_int4pack_for_cpu",
                   "_weight_int4pack_mm_for_cpu")


# The dense ops of quantization (float in; quantized or fake-quantized out): the CPU's
# kernels serve them on a device that declared its quantized kernels the CPU's.
QUANTIZING = ("quantize_per_tensor.default", "quantize_per_tensor.tensor_qparams",
              "quantize_per_tensor.tensors", "quantize_per_tensor_dynamic.default",
              "quantize_per_channel.default", "_make_per_tensor_quantized_tensor.default",
              "_make_per_channel_quantized_tensor.default",
              "fake_quantize_per_tensor_affine_cachemask.default",
              "_fake_quantize_per_tensor_affine_cachemask_tensor_qparams.default",
              "fake_quantize_per_channel_affine_cachemask.default")

# the device's own view of its memory, where the CPU's quantized kernels are its own
_HOST_VIEW: list[Callable[[torch.Tensor], torch.Tensor]] = []
_HAS_CPU_KERNEL: dict[str, bool] = {}


class QuantizedUnavailableError(NotImplementedError):
    """Quantized device tensors need the device's allocator registered with PyTorch."""


def check_available(backend: DeviceBackend) -> None:
    """Raise :class:`QuantizedUnavailableError` where PyTorch cannot allocate a quantized
    device tensor: ``new_qtensor`` takes ``GetAllocator(kPrivateUse1)``, which only
    torchport's C++ caching allocator registers (with the Python one there is none)."""
    if not backend.allocators or not all(isinstance(a, NativeAllocator)
                                         for a in backend.allocators):
        raise QuantizedUnavailableError(
            f"quantized {backend.name} tensors need torchport's C++ library (PyTorch allocates "
            f"them through the C++ allocator it registers; {native.describe()}): build it "
            f"(a C++ compiler, TORCHPORT_NATIVE unset) or quantize on the CPU")


class QuantizerMismatchError(NotImplementedError):
    """A copy into a device quantized tensor would have to change its quantizer."""


def _name(op: Any) -> str:
    return op._schema.name.split("::", 1)[1]


def make_fallback(backend: DeviceBackend) -> Callable[..., Any]:
    """The boxed fallback of ``QuantizedPrivateUse1``."""
    ks = qtensors.QUANTIZED_CPU_KS
    available: list[bool] = []

    def quantized_fallback(keyset: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        if not available:
            check_available(backend)  # raises, and is asked again next time
            available.append(True)
        dtype = kwargs.get("dtype")
        if dtype in backend.runtime.unsupported_dtypes:  # a factory of a refused dtype
            backend.check_dtype(dtype)
        name = _name(op)
        if name in METADATA or plan_for(op).is_view:
            return op.redispatch(ks, *args, **kwargs)
        if name == "_copy_from":
            return copy(backend, args[1], args[0])
        if name == "resize_":
            return resize(backend, args, kwargs)
        overload = plan_for(op).overload_name
        if _HOST_VIEW and _has_cpu_kernel(op, "QuantizedCPU") \
                and not fallback.is_forced(overload):
            return _timed(overload, lambda: run_on_host(backend, op, args, kwargs), args,
                          kwargs)
        return fallback.run_cpu(backend, op, overload, args, kwargs, cpu_key="QuantizedCPU")
    return quantized_fallback


def _has_cpu_kernel(op: Any, key: str) -> bool:
    qualified = f"{op.name()}@{key}"
    has = _HAS_CPU_KERNEL.get(qualified)
    if has is None:
        has = _HAS_CPU_KERNEL[qualified] = \
            torch._C._dispatch_has_computed_kernel_for_dispatch_key(op.name(), key)
    return has


def _timed(name: str, fn: Callable[[], Any], args: tuple, kwargs: dict) -> Any:
    if not stats.ENABLED:
        return fn()
    t0 = time.perf_counter()
    try:
        return fn()
    finally:
        stats.add(name, "native", args, kwargs, time.perf_counter() - t0, "quantized")


def withdraw_host_view(to_cpu: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Forget a :func:`declare_host_view` of ``to_cpu``."""
    if _HOST_VIEW and _HOST_VIEW[0] is to_cpu:
        _HOST_VIEW.clear()


def declare_host_view(to_cpu: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """The backend's kernels are the CPU's over ``to_cpu``'s views, quantized ones included
    (the first declaration wins)."""
    if _HOST_VIEW:
        return False
    _HOST_VIEW.append(to_cpu)
    return True


def _quantized_view(to_cpu: Callable[[torch.Tensor], torch.Tensor]
                    ) -> Callable[[torch.Tensor], torch.Tensor]:
    """``to_cpu`` for quantized tensors too: the CPU quantized tensor with ``t``'s
    quantizer over ``to_cpu``'s view of its storage's bytes (a view of dense dtypes only)."""
    def view(t: torch.Tensor) -> torch.Tensor:
        if not t.is_quantized:
            return to_cpu(t)
        raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
        cpu = to_cpu(raw)
        return qtensors.over_storage(t, cpu.untyped_storage(),
                                     cpu.storage_offset() // t.element_size() + t.storage_offset(),
                                     t.shape, t.stride())
    return view


def run_on_host(backend: DeviceBackend, op: Any, args: tuple, kwargs: dict) -> Any:
    """``op`` by its CPU kernel on the device's declared view of its memory."""
    index = hostexec.op_device(backend, op, plan_for(op), args, kwargs)
    backend.host_sync(backend.current_device() if index is None else index)
    return hostexec.run_on_host(backend, op, args, kwargs, _quantized_view(_HOST_VIEW[0]), True)


def dense_kernel(backend: DeviceBackend, op: Any) -> Callable[..., Any]:
    """A :data:`QUANTIZING` op's kernel where the backend declared the CPU's quantized
    kernels its own (a :class:`Decline` while none is declared: the CPU fallback)."""
    def kernel(*args: Any, **kwargs: Any) -> Any:
        if not _HOST_VIEW:
            raise Decline("no quantized host view declared")
        return run_on_host(backend, op, args, kwargs)
    return kernel


def install(backend: DeviceBackend, lib: torch.library.Library) -> None:
    """Register the fallback, and the same handler as the kernel of every op PyTorch gives a
    QuantizedCPU kernel of its own: on ``QuantizedPrivateUse1`` those would otherwise take
    their CompositeExplicitAutograd kernel, which knows no quantizer (``clone`` and
    ``empty_like`` would make tensors without quantization parameters)."""
    handler = make_fallback(backend)
    fallback.register(backend, handler, "QuantizedPrivateUse1")
    registered = torch._C._dispatch_get_registrations_for_dispatch_key
    taken = set(registered("QuantizedPrivateUse1"))
    for full in sorted(registered("QuantizedCPU")):
        if not full.startswith("aten::") or full in taken:
            continue
        base, _, overload = full[6:].partition(".")
        op = getattr(getattr(torch.ops.aten, base), overload or "default")
        lib.impl(full[6:], _kernel(handler, op), "QuantizedPrivateUse1")


def _kernel(handler: Callable[..., Any], op: Any) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        return handler(None, op, *args, **kwargs)
    return kernel


def resize(backend: DeviceBackend, args: tuple, kwargs: dict) -> torch.Tensor:
    """``resize_`` of a quantized device tensor: the CPU's resize on a stand-in of its
    layout gives the new layout (or the CPU's error); the device storage grows in place,
    keeping its bytes, as the CPU's does."""
    t = args[0]
    n = tensors.storage_nbytes(t.shape, t.stride(), t.element_size(), t.storage_offset())
    stand = qtensors.over_storage(t, torch.UntypedStorage(n), t.storage_offset(), t.shape,
                                  t.stride())
    stand.resize_(*args[1:], **kwargs)
    backend.resize_device_tensor(t, stand.shape, stand.stride())
    return t


def copy(backend: DeviceBackend, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(src)`` where one of them is a quantized device tensor: the CPU's copy on
    the host's views (its checks, its quantization of a float source), stored in ``dst``.

    The CPU's copy between quantized tensors also gives ``dst`` the source's quantizer;
    PyTorch offers no way to change a tensor's quantizer from outside its C++ core, so a
    device ``dst`` must already have the source's parameters (as ``.to()``'s, ``clone``'s
    and ``torch.load``'s have)."""
    name = backend.name
    if dst.device.type == name and dst.is_quantized and src.is_quantized \
            and dst.dtype == src.dtype and dst.qscheme() == src.qscheme() \
            and not qtensors.same_quantizer(dst, src):
        raise QuantizerMismatchError(
            f"copy_ into a quantized {name} tensor from one with other quantization parameters "
            f"would change the destination's quantizer, which only PyTorch's core can do; "
            f"make the destination from the source instead (src.clone(), src.to({name!r}))")
    host_src = backend.to_host(src) if src.device.type == name else src
    if dst.device.type != name:
        dst.copy_(host_src)
        return dst
    host_dst = backend.to_host(dst)
    host_dst.copy_(host_src)
    if not backend.runtime.host_addressable:  # a copy: store its bytes
        tensors.store_span(backend, dst, host_dst)
    return dst


def install_int_mm_route() -> None:
    """Route ``out_dtype(mm, int32, int8, int8)`` on the device to ``aten._int_mm``.

    torchao's int8 dynamic-activation linear (``int_scaled_matmul`` -> ``safe_int_mm``)
    multiplies int8 activations by int8 weights with the ``out_dtype`` higher-order op on
    every device but the CPU; PyTorch lowers that to ``_int_mm`` only on CUDA and XPU
    (``is_int_mm`` in ``torch/_higher_order_ops/out_dtype.py``) and otherwise widens both
    operands to int32 for an ordinary ``mm``. On the device it reaches ``_int_mm`` instead,
    the vendor's int8 kernel (exact integer sums: the same values either way)."""
    from torch._higher_order_ops.out_dtype import out_dtype, out_dtype_dense

    key = torch._C.DispatchKey.PrivateUse1
    if key in out_dtype.py_kernels:
        return

    @out_dtype.py_impl(key)
    def _device_out_dtype(op: Any, output_dtype: torch.dtype, *args: Any) -> Any:
        if op is torch.ops.aten.mm.default and output_dtype == torch.int32 and len(args) == 2 \
                and all(isinstance(a, torch.Tensor) and a.dtype == torch.int8 and a.dim() == 2
                        for a in args):
            return torch.ops.aten._int_mm.default(*args)
        return out_dtype_dense(op, output_dtype, *args)
