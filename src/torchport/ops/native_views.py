"""View ops without Python: PyTorch's own C++ view kernels, registered for the device.

A view op (``view``, ``as_strided``, ``select``, ``permute``...) only makes a tensor
header over the same storage, and ATen's CPU kernels do that for any device. As Python
kernels they cost a Python entry each, more in a training step, whose large kernels evict
the interpreter from the caches (docs/performance.md). ``native_views.cpp`` (part of :mod:`torchport.core.native`)
registers the same ATen functions for PrivateUse1 from C++, and the composite views
(``select``, ``t``...) then run PyTorch's composite kernels, all without Python.

Where the library is unavailable or ``TORCHPORT_NATIVE=0``, the Python view kernels serve,
with the same results. While op statistics record, ops are forced to the CPU or a tool
intercepts ops (``fallback.SLOW``) the Python kernels serve too, so that views are
counted and seen like every other op.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from torchport.core import native
from torchport.core.libraries import keep_past_exit

if TYPE_CHECKING:
    from torchport.core.contracts import DeviceBackend

# The ops the C++ library registers (native_views.cpp): views with no composite kernel.
OPS = ("as_strided", "view", "_reshape_alias", "unfold", "view_as_real", "view_as_complex")


def switchable(op: torch._ops.OpOverload) -> bool:
    """Is a Python view kernel of ``op`` replaced while the C++ kernels are on: its op is
    one of theirs, or a composite view that reaches them."""
    name = op.name()
    if op._schema.overload_name == "" and name.split("::")[1] in OPS:
        return True
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return has(name, "CompositeExplicitAutograd") and not has(name, "CPU")


class ViewKernels:
    """A backend's switchable Python view kernels, and which of the two serves.

    Never both: the dispatcher would warn of an overridden kernel. The switch re-registers
    kernels, so it happens when a recorder or tool starts or stops, not per op."""

    def __init__(self) -> None:
        self.python: dict[str, Any] = {}  # overload name -> Python kernel
        self._registered: torch.library.Library | None = None  # the Python ones, while serving
        self.native = False
        self.vendor_owned: set[str] = set()  # those of OPS the backend has a kernel of

    def give_way(self, name: str) -> None:
        """A kernel set brings its own kernel for ``name``, one of :data:`OPS`: C++ no
        longer serves."""
        self.vendor_owned.add(name)
        self.use(False)

    def take_back(self, name: str) -> None:
        """The kernel set's ``name`` is withdrawn: C++ serves again once no other is left
        (unless ops are intercepted)."""
        from torchport.ops import fallback

        self.vendor_owned.discard(name)
        if not self.vendor_owned:
            self.use(not fallback.INTERCEPTING)

    def add(self, name: str, kernel: Any) -> None:
        self.python[name] = kernel
        if self._registered is not None:
            self._registered.impl(name, kernel, "PrivateUse1")

    def remove(self, name: str) -> None:
        """Withdraw ``name``'s Python kernel (a library unregisters all its kernels at
        once: the others are registered again)."""
        if self.python.pop(name, None) is None or self._registered is None:
            return
        self._registered._destroy()
        self._registered = None
        self.use(False)

    def use(self, from_cpp: bool) -> None:
        """Serve views from C++ (where it could be loaded) or from the Python kernels."""
        lib = native.load() if from_cpp and not self.vendor_owned else None
        if lib is not None:
            if self._registered is not None:
                self._registered._destroy()
                self._registered = None
            lib.torchport_native_views_enable()
            self.native = True
            return
        if native.loaded() is not None:
            native.loaded().torchport_native_views_disable()
        self.native = False
        if self._registered is None:
            self._registered = keep_past_exit(torch.library.Library("aten", "IMPL"))
            for name, kernel in self.python.items():
                self._registered.impl(name, kernel, "PrivateUse1")


def install(backend: DeviceBackend) -> None:
    """Serve the backend's views natively unless ops are slowed down, and follow that."""
    from torchport.ops import fallback

    views = backend.view_kernels
    views.use(not fallback.INTERCEPTING)
    fallback.on_slow_change(lambda slow: views.use(not slow))

