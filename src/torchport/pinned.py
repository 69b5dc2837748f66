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

import warnings
from typing import TYPE_CHECKING, Any

import torch

from torchport import native

if TYPE_CHECKING:
    from torchport.contracts import DeviceBackend


class PinnedMemoryWarning(RuntimeWarning):
    """Pinned memory was asked for where torchport cannot give it; the copy is unpinned."""


def install(backend: DeviceBackend, hooks_in_cpp: bool) -> None:
    """After registration: where the C++ hooks were not registered, answer pin requests with
    unpinned copies (one :class:`PinnedMemoryWarning`) instead of PyTorch's error."""
    backend.pinned_memory = hooks_in_cpp
    if hooks_in_cpp:
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
