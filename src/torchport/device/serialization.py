"""Storages on the device, so ``torch.save``/``torch.load`` and ``Storage.to`` work.

PyTorch's own privateuse1 serialization package tags device storages
``<device>:<index>`` and restores them with ``UntypedStorage(size, device=...)``,
which in C++ asks for the PrivateUse1 allocator. torchport's C++ library registers one
(``native_allocator.cpp``, blocks of the caching allocator); without it a Python backend
has none (the C++ would crash), and torchport routes storage creation for its device
through its own allocator from Python instead.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torchport.core.contracts import DeviceBackend

_C_NEW = torch._C.StorageBase.__new__


def install(backend: DeviceBackend, storages_in_cpp: bool) -> None:
    """Storages of the device made by ``UntypedStorage(...)`` from its allocator: PyTorch's
    own C++ path where the C++ allocator is registered (``storages_in_cpp``), else a Python
    constructor for the device's storages."""
    _keep_backend_metadata()
    if storages_in_cpp:
        return

    def storage_new(cls: type, *args: Any, device: Any = None, **kwargs: Any) -> Any:
        if device is None or torch.device(device).type != backend.name:
            if device is not None:
                kwargs["device"] = device
            return _C_NEW(cls, *args, **kwargs)
        index = backend.index_of(device)
        if not args or isinstance(args[0], int):
            nbytes = args[0] if args else 0
            return backend.empty([nbytes], torch.uint8, index).untyped_storage()
        cpu = _C_NEW(cls, *args, **kwargs)  # from a sequence: build on CPU, then copy
        out = backend.empty([cpu.nbytes()], torch.uint8, index)
        out.copy_(torch.empty(0, dtype=torch.uint8).set_(cpu))
        return out.untyped_storage()

    torch.UntypedStorage.__new__ = staticmethod(storage_new)


def _keep_backend_metadata() -> None:
    """Backend entries of ``torch._utils.set_tensor_metadata`` kept on device tensors and
    through ``torch.save``/``torch.load`` (``native_metadata.cpp``), where the C++ library
    loads; without it PyTorch ignores them, as for any device without the hook."""
    from torchport.core import native

    cpp = native.load()
    if cpp is not None:
        cpp.torchport_metadata_enable.restype = ctypes.c_int
        if cpp.torchport_metadata_enable():
            native.enabled("backend metadata in checkpoints")
