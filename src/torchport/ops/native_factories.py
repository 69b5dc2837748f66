"""Allocation without Python: ``empty.memory_format`` and ``empty_strided`` in C++.

Every new device tensor of a model's ops starts with one of these two; as Python kernels
each costs a Python entry. ``native_factories.cpp`` (part of :mod:`torchport.core.native`)
registers both for PrivateUse1 from C++: a tensor over a block of the C++ caching
allocator on the current stream, with the Python kernels' sizes, strides and dtypes. What
it does not serve itself (an error to raise, an unusual layout) it hands to the Python
kernel, so that results and errors stay the Python ones.

As with the view kernels (:mod:`torchport.ops.native_views`), never both are registered:
where the library, its Python part, the C++ guard or the C++ allocator is missing, and
while ``fallback.SLOW`` is set (op statistics, forced fallback, tools intercepting ops),
the Python kernels serve, so that allocations are counted and seen like every other op.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from torchport.core import native
from torchport.core.libraries import keep_past_exit

if TYPE_CHECKING:
    from torchport.core.contracts import DeviceBackend

# The overloads the C++ library registers (native_factories.cpp).
OPS = ("empty.memory_format", "empty_strided")


class FactoryKernels:
    """The backend's two Python allocation kernels, and which of the two sets serves."""

    def __init__(self, backend: DeviceBackend, python: dict[str, Callable[..., Any]]) -> None:
        self.backend = backend
        self.python = dict(python)  # overload name -> the registered Python kernel
        self._registered: torch.library.Library | None = None
        self.native = False

    def _library(self) -> Any:
        """The library's enable function, where C++ can serve the device."""
        b = self.backend
        if b._guard_device is None or any(getattr(a, "new_tensor", None) is None
                                           for a in b.allocators):
            return None
        return native.python_function("torchport_native_factories_enable",
                                      [ctypes.py_object] * 3 + [ctypes.c_int], ctypes.c_int)

    def use(self, from_cpp: bool) -> None:
        """Serve ``empty*`` from C++ (where it can) or from the Python kernels."""
        enable = self._library() if from_cpp else None
        if enable is not None:
            if self._registered is not None:
                self._registered._destroy()
                self._registered = None
            enable(self.python["empty.memory_format"], self.python["empty_strided"],
                   self.backend.refused_dtypes(),
                   self.backend.device_count())
            native.enabled("empty kernels")
            self.native = True
            return
        cpp = native.loaded()
        if cpp is not None and hasattr(cpp, "torchport_native_factories_disable"):
            cpp.torchport_native_factories_disable()
        self.native = False
        if self._registered is None:
            self._registered = keep_past_exit(torch.library.Library("aten", "IMPL"))
            for name, kernel in self.python.items():
                self._registered.impl(name, kernel, "PrivateUse1")


SERVING: list[FactoryKernels] = []  # the registered backend's (tests and tools read it)


def install(backend: DeviceBackend, python: dict[str, Callable[..., Any]]) -> FactoryKernels:
    """Serve the backend's ``empty*`` natively unless ops are slowed down, and follow that."""
    from torchport.ops import fallback

    kernels = FactoryKernels(backend, python)
    SERVING[:] = [kernels]
    kernels.use(not fallback.INTERCEPTING)
    fallback.on_slow_change(lambda slow: kernels.use(not slow))
    return kernels


def compiled_allocator(fallback: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """What a compiled program allocates its buffers with, ``(size, stride, dtype, index)``:
    a C function serving them as ``empty_strided`` does from C++ (no Python frame per
    buffer), handing the rest to ``fallback`` (the same call in Python); ``fallback`` itself
    where the library cannot."""
    make = native.python_function("torchport_compiled_empty_strided", [ctypes.py_object],
                                  ctypes.py_object)
    return fallback if make is None else make(fallback)
