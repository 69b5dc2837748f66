"""Device and CPU tensors are interchangeable under ``.data =``, as CUDA's are.

``Module._apply`` (``.to()``, ``.cuda()``, ``.half()``) keeps each Parameter object -- so
tied weights stay tied and an optimizer built before the move keeps training them -- only
where ``torch._has_compatible_shallow_copy_type(old, new)``; otherwise it makes a new
Parameter per module. PyTorch's C++ answer (``TensorImpl::has_compatible_shallow_copy_type``)
counts CPU and CUDA dense tensors as compatible but not PrivateUse1 ones, and leaves the op
to a PrivateUse1 backend to register.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torchport.core.contracts import DeviceBackend

_dispatch_keys = torch._C._dispatch_keys


def install(backend: DeviceBackend) -> None:
    """Register ``_has_compatible_shallow_copy_type`` for the device (any call where one
    of the two tensors is on it reaches this kernel)."""
    dense_devices = ("cpu", backend.name)

    def dense(t: torch.Tensor) -> bool:
        return t.layout == torch.strided and t.device.type in dense_devices \
            and not t.is_quantized and not t.is_nested

    def compatible(self: torch.Tensor, from_: torch.Tensor) -> bool:
        """CUDA's rule with the device among the dense backends: two dense tensors of
        the CPU or the device are compatible; otherwise equal dispatch key sets are."""
        return (dense(self) and dense(from_)) or _dispatch_keys(self) == _dispatch_keys(from_)

    backend.library().impl("_has_compatible_shallow_copy_type", compatible, "PrivateUse1")
