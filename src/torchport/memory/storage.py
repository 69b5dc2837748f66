"""Device storages resized in place (``UntypedStorage.resize_``).

FSDP2 frees and re-allocates each unsharded parameter's memory through its
storage; PyTorch sends a PrivateUse1 storage's resize to a C++ hook
(``PrivateUse1HooksInterface::resizePrivateUse1Bytes``). With torchport's C++
library its hooks fill it (``native_hooks.cpp``, over the C++ caching allocator);
without it a Python backend cannot, so torchport replaces the method for device
storages.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from torchport.core import native
from torchport.memory import tensors
from torchport.memory.allocator import NativeAllocator

if TYPE_CHECKING:
    from torchport.core.contracts import DeviceBackend

_C_RESIZE = torch._C.StorageBase.resize_


def install_storage_resize(backend: DeviceBackend) -> None:
    """Make ``UntypedStorage.resize_`` work on the device, in place.

    FSDP2 frees and re-allocates each unsharded parameter with
    ``tensor.untyped_storage().resize_(0 / nbytes)``; every tensor sharing that
    storage must see the new memory. PyTorch 2.13 sends a PrivateUse1 storage to
    the C++ hook ``PrivateUse1HooksInterface::resizePrivateUse1Bytes``, which a
    Python backend cannot implement (``torch/csrc/acc/Module.cpp`` forwards no such
    method). Instead: allocate the new block, copy the kept bytes, and move it into
    the storage with ``_swap_data_ptr_`` (swaps data pointer and size, see
    :func:`torchport.memory.tensors.swap_storage_blocks`); the old block leaves with the temporary storage and
    returns to the allocator.
    Storages of other devices take PyTorch's path unchanged.
    """
    name = backend.name

    def resize_(self: Any, size: int) -> Any:
        if self.device.type != name:
            return _C_RESIZE(self, size)
        resize_storage(backend, self, int(size))
        return self

    resize_.__doc__ = _C_RESIZE.__doc__
    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]


def resize_storage(backend: DeviceBackend, storage: torch.UntypedStorage, n: int) -> None:
    """Resize a device storage to ``n`` bytes in place, keeping the bytes both sizes hold:
    every tensor on it sees the new memory."""
    old = storage.nbytes()
    if n < 0:
        raise RuntimeError(f"resize_: size must be non-negative, got {n}")
    if n == old:
        return
    index = storage.device.index
    if backend.runtime.asynchronous:
        backend.synchronize(index)  # queued kernels may still read or write the old block
    fresh = backend.empty_strided([n], [1], torch.uint8, index).untyped_storage()
    keep = min(n, old)
    if keep:
        p = backend.phys(index)
        backend.runtime.copy_d2d(p, fresh.data_ptr(), p, storage.data_ptr(), keep)
    if old and n:  # _swap_data_ptr_ needs equal sizes or one empty side: empty it first
        empty = backend.empty_strided([0], [1], torch.uint8, index).untyped_storage()
        tensors.swap_storage_blocks(storage, empty)
    tensors.swap_storage_blocks(storage, fresh)


def resize_in_cpp(backend: DeviceBackend) -> bool:
    """Will PyTorch's own ``UntypedStorage.resize_`` serve device storages: the C++
    allocator owns them, and the C++ hooks (about to be registered, before PyTorch's
    Python-backend set-up) resize them."""
    cpp = native.loaded()
    if cpp is None or not hasattr(cpp, "torchport_hooks_resize_ready") \
            or not all(isinstance(a, NativeAllocator) for a in backend.allocators):
        return False
    return bool(cpp.torchport_hooks_resize_ready())


def on_register(backend: DeviceBackend, module: Any) -> None:
    """The feature's install as ``backend`` registers (:mod:`torchport.features`)."""
    if not resize_in_cpp(backend):
        install_storage_resize(backend)
