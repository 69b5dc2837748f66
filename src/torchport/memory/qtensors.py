"""Quantized tensors (``qint8``, ``quint8``, ``qint32``, ``quint4x2``, ``quint2x4``) on the device.

A quantized tensor is a ``QTensorImpl``: a storage of raw integers and a *quantizer* (scale
and zero point, or per-channel scales, zero points and axis). PyTorch builds them for a
PrivateUse1 device itself: its factories (``_empty_affine_quantized``,
``_empty_per_channel_affine_quantized``) compute the ``QuantizedPrivateUse1`` dispatch key
from the device and, in ``new_qtensor`` (``aten/src/ATen/quantized/Quantizer.cpp``), take
the memory from ``c10::GetAllocator(kPrivateUse1)`` -- torchport's caching allocator. Only
the kernels are missing: this module makes *shells* (a quantized tensor of no elements
bearing a given quantizer, on any device) that the op layer points at a storage with
``set_``, which is how quantized tensors move between the host and the device and how the
CPU's kernels see device memory.
"""

from __future__ import annotations

import torch

QUANTIZED_CPU_KS = torch._C.DispatchKeySet(torch._C.DispatchKey.QuantizedCPU)
_CPU = torch.device("cpu")
_empty_affine = torch.ops.aten._empty_affine_quantized.default
_empty_per_channel = torch.ops.aten._empty_per_channel_affine_quantized.default
_set_storage = torch.ops.aten.set_.source_Storage_storage_offset

# Sub-byte dtypes: several values per byte along the last dimension (rows padded to a byte).
SUB_BYTE = frozenset({torch.quint4x2, torch.quint2x4})


def _factory(op: torch._ops.OpOverload, device: torch.device, *args, **kwargs) -> torch.Tensor:
    """A quantized factory on ``device``. For the device, PyTorch's own QuantizedCPU kernel,
    which is device-generic: it allocates through the device's registered allocator and
    keys the tensor from its options (``QuantizedPrivateUse1``)."""
    if device.type == "cpu":
        return op(*args, device=device, **kwargs)
    return op.redispatch(QUANTIZED_CPU_KS, *args, device=device, **kwargs)


def shell(q: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A quantized tensor of no elements on ``device`` with ``q``'s dtype and quantization
    parameters (per-channel scales and zero points moved to ``device``)."""
    scheme = q.qscheme()
    if scheme in (torch.per_tensor_affine, torch.per_tensor_symmetric):
        return _factory(_empty_affine, device, [0], dtype=q.dtype, scale=q.q_scale(),
                        zero_point=q.q_zero_point())
    scales = q.q_per_channel_scales()
    zero_points = q.q_per_channel_zero_points()
    if scales.device != device:
        scales, zero_points = scales.to(device), zero_points.to(device)
    return _factory(_empty_per_channel, device, [0], scales=scales, zero_points=zero_points,
                    axis=q.q_per_channel_axis(), dtype=q.dtype)


def over_storage(q: torch.Tensor, storage: torch.UntypedStorage, offset: int, size,
                 stride) -> torch.Tensor:
    """A quantized tensor with ``q``'s quantization over ``storage`` (on its device)."""
    s = shell(q, storage.device)
    if storage.device.type == "cpu":
        return s.set_(storage, offset, size, stride)
    return _set_storage.redispatch(QUANTIZED_CPU_KS, s, storage, offset, list(size),
                                   list(stride))


def dense_bytes(q: torch.Tensor) -> int:
    """The bytes of a dense quantized tensor's values (sub-byte rows padded, as PyTorch
    lays them out)."""
    if q.dtype in SUB_BYTE:
        return q.untyped_storage().nbytes() - q.storage_offset() * q.element_size()
    return q.numel() * q.element_size()


def same_quantizer(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Do two quantized tensors dequantize their integers alike (dtype, scheme, parameters)?"""
    if a.dtype != b.dtype or a.qscheme() != b.qscheme():
        return False
    if a.qscheme() in (torch.per_tensor_affine, torch.per_tensor_symmetric):
        return a.q_scale() == b.q_scale() and a.q_zero_point() == b.q_zero_point()
    return a.q_per_channel_axis() == b.q_per_channel_axis() \
        and torch.equal(a.q_per_channel_scales().cpu(), b.q_per_channel_scales().cpu()) \
        and torch.equal(a.q_per_channel_zero_points().cpu(), b.q_per_channel_zero_points().cpu())
