"""Pinned host memory for the device: ``Tensor.pin_memory()``, ``DataLoader(pin_memory=True)``.

PyTorch pins a CPU tensor for the current accelerator (``DataLoader(pin_memory=True)``
pins every batch for it, on its pin thread): ``aten::_pin_memory`` takes its memory from
that accelerator's hooks (``getPinnedMemoryAllocator``), and ``Tensor.is_pinned()`` asks
them whether an address is pinned (``isPinnedPtr``). PyTorch's hooks for Python backends
(``torch/csrc/acc``) forward neither to Python: pinning raises ``NotImplementedError``.
So the hooks come from torchport's C++ library (``native_hooks.cpp``), registered before
PyTorch's Python-backend set-up (PyTorch keeps the first hooks registered): pinned
tensors there are host memory the hooks record, and ``is_pinned()`` is true for them.

Where the library is unavailable (``TORCHPORT_NATIVE=0``, no compiler), the Python twin is
a CPU kernel of ``aten::_pin_memory`` that warns once and returns an unpinned copy:
pinning is a speed hint, and copies from pageable memory to the device, ``non_blocking``
ones included, give the same values.
"""

from __future__ import annotations

import atexit
import ctypes
import warnings
from typing import TYPE_CHECKING, Any

import torch

from torchport.core import interrupts, native
from torchport.runtime import Runtime

if TYPE_CHECKING:
    from torchport.core.contracts import DeviceBackend


class PinnedMemoryWarning(RuntimeWarning):
    """Pinned memory was asked for where torchport cannot give it; the copy is unpinned."""


def install(backend: DeviceBackend, hooks_in_cpp: bool) -> None:
    """After registration: where the C++ hooks were not registered, answer pin requests with
    unpinned copies (one :class:`PinnedMemoryWarning`) instead of PyTorch's error."""
    backend.pinned_memory = hooks_in_cpp
    if hooks_in_cpp:
        _use_runtime_host_memory(backend)
        return
    warned = False
    why = native.UNAVAILABLE or ("TORCHPORT_NATIVE=0" if not native.wanted()
                                 else "PrivateUse1 hooks registered by another library")

    def pin_memory(self: torch.Tensor, device: Any = None) -> torch.Tensor:
        nonlocal warned
        if not warned:
            warned = True
            warnings.warn(
                f"torchport: no pinned memory for {backend.name} without its C++ library "
                f"({why}); pin_memory() returns an unpinned copy, which copies to the device "
                f"as correctly (build the library, or pass pin_memory=False)",
                PinnedMemoryWarning, stacklevel=2)
        out = torch.empty_strided(self.size(), self.stride(), dtype=self.dtype)
        return out.copy_(self)

    backend.library().impl("_pin_memory", pin_memory, "CPU")


_HOST_ALLOC = ctypes.CFUNCTYPE(ctypes.c_longlong, ctypes.c_longlong)
_HOST_FREE = ctypes.CFUNCTYPE(None, ctypes.c_longlong)


def _use_runtime_host_memory(backend: DeviceBackend) -> None:
    """Pinned blocks from the runtime's ``host_alloc``/``host_free``, where it overrides
    them (page-locked memory); the default keeps plain host memory, with no Python call."""
    rt = backend.runtime
    if type(rt).host_alloc is Runtime.host_alloc:
        return
    cpp = native.loaded()
    if cpp is None:
        return

    def alloc(nbytes: int) -> int:
        try:
            return interrupts.to_completion(rt.host_alloc, nbytes) or 0
        except BaseException as e:  # noqa: BLE001 -- the C++ caller raises
            interrupts.redeliver(e)
            warnings.warn(f"torchport: {type(rt).__name__}.host_alloc({nbytes}) failed: {e}",
                          RuntimeWarning, stacklevel=1)
            return -1

    def free(ptr: int) -> None:
        try:
            interrupts.to_completion(rt.host_free, ptr)
        except BaseException as e:  # noqa: BLE001 -- a deleter: nothing can raise
            interrupts.redeliver(e)
            warnings.warn(f"torchport: {type(rt).__name__}.host_free failed: {e}",
                          RuntimeWarning, stacklevel=1)

    callbacks = (_HOST_ALLOC(alloc), _HOST_FREE(free))
    set_memory = cpp.torchport_hooks_set_host_memory
    set_memory.restype = None
    set_memory.argtypes = [_HOST_ALLOC, _HOST_FREE]
    set_memory(*callbacks)
    backend.pinned_host_memory = callbacks  # alive while set
    atexit.register(set_memory, _HOST_ALLOC(), _HOST_FREE())  # no Python from C++ at exit
