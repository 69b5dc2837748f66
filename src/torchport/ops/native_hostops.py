"""Host-op kernels without a Python entry, for devices whose memory is host memory.

A host-op kernel (:mod:`torchport.ops.hostkernels`) runs PyTorch's CPU kernel on the
chip's views of device memory. Where the host reads device memory at the device address
itself and the runtime is synchronous (the sim by default, a unified-memory device),
``native_hostops.cpp`` (part of :mod:`torchport.native`) does the same from C++ for an
op's common calls: tensors of one device, CPU tensors over the same memory, the CPU
kernel, new results copied into blocks of the C++ caching allocator. Its uncommon calls
(another device, conjugate views, a large first input of a functional op, an ``out=`` to
grow) it hands to the op's Python kernel, so results and errors stay the Python ones.

Served so: the functional, in-place and ``out=`` ops whose schema holds only tensors,
tensor lists, numbers, strings, dtypes and memory formats (no device, generator or
layout), that draw no random numbers and change no tensor's metadata. As with the view and
empty kernels, never both are registered: where the library is missing, the memory is not
host memory at the device address, the runtime is asynchronous, and while
``fallback.SLOW`` is set (op statistics, forced fallback, tools intercepting ops), the
Python kernels serve.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from torchport import native
from torchport.libraries import keep_past_exit
from torchport.ops.plan import plan_for

if TYPE_CHECKING:
    from torchport.contracts import DeviceBackend

#: A functional op whose first tensor is larger takes the Python kernel, which computes
#: into new device blocks directly: its results are likely as large (an activation of a
#: large batch), and C++ computes a new result in host memory, then copies it (up to
#: ``ADOPT_MIN_BYTES``) or has the runtime adopt it.
FUNCTIONAL_INPUT_MAX = 1 << 20

_ARG_TYPES = frozenset({
    "Tensor", "Tensor?", "number", "number?", "int", "int?", "bool", "bool?", "float",
    "float?", "str", "str?", "List[int]", "List[int]?", "List[bool]", "List[float]",
    "List[float]?", "ScalarType", "ScalarType?", "MemoryFormat", "MemoryFormat?",
    "List[Tensor]", "List[Optional[Tensor]]", "List[number]"})
_RETURN_TYPES = frozenset({"Tensor", "number", "int", "float", "bool", "List[Tensor]"})


def servable(op: torch._ops.OpOverload) -> bool:
    """Can ``op``'s host kernel be served in C++ (its schema alone decides)?"""
    p = plan_for(op)
    if p.is_view or p.random or p.has_device_arg or p.has_generator_arg \
            or (p.num_returns == 0 and not p.write_args) or torch.Tag.inplace_view in op.tags:
        return False
    name = op._schema.name.split("::")[1]
    if name.startswith(("resize", "set_", "_resize")):
        return False
    s = op._schema
    if any(_arg_type(a) not in _ARG_TYPES for a in s.arguments):
        return False
    if any(str(r.type) not in _RETURN_TYPES for r in s.returns):
        return False
    # written arguments: tensors or tensor lists (in-place, out=, the fused optimizers)
    return all(str(a.type) in ("Tensor", "List[Tensor]") for a in s.arguments
               if a.name in p.write_args)


def _arg_type(a: Any) -> str:
    t = a.real_type
    if isinstance(t, torch.OptionalType):
        return str(t.getElementType()) + "?"
    return str(t)


class HostOpKernels:
    """A backend's host-op kernels servable in C++, and which of the two sets serves."""

    def __init__(self, backend: DeviceBackend) -> None:
        self.backend = backend
        self.python: dict[str, tuple[Callable[..., Any], bool]] = {}  # name -> (kernel, functional)
        self._registered: torch.library.Library | None = None  # the Python ones, while serving
        self.native = False
        self._held = 0  # python_only() depth

    def add(self, name: str, op: torch._ops.OpOverload, kernel: Callable[..., Any]) -> None:
        """``op``'s Python host kernel, registered as ``name`` (by whichever set serves)."""
        self.python[name] = (kernel, not plan_for(op).write_args)
        if self.native:
            self._enable({name: self.python[name]})
        elif self._registered is not None:
            self._registered.impl(name, kernel, "PrivateUse1")

    def direct(self) -> bool:
        """Does the host read device memory at the device address, synchronously?"""
        rt = self.backend.runtime
        return not rt.asynchronous and self.backend.host_address_is_device_address

    def _library(self) -> Any:
        """The library's enable function, where C++ can serve the device."""
        b = self.backend
        if b._guard_device is None or not self.direct() \
                or any(getattr(a, "new_tensor", None) is None for a in b.allocators):
            return None
        return native.python_function(
            "torchport_native_hostops_enable",
            [ctypes.py_object, ctypes.py_object, ctypes.c_int, ctypes.c_int64, ctypes.c_int64],
            ctypes.c_int)

    def _enable(self, kernels: dict[str, tuple[Callable[..., Any], bool]]) -> bool:
        from torchport.allocator import ADOPT_MIN_BYTES

        enable = self._library()
        if enable is None:
            return False
        if self._registered is not None:  # never both registered
            self._registered._destroy()
            self._registered = None
        enable(kernels, _result_function(self.backend), self.backend.device_count(),
               FUNCTIONAL_INPUT_MAX, ADOPT_MIN_BYTES - 1)
        return True

    @contextlib.contextmanager
    def python_only(self) -> Iterator[None]:
        """Within: the Python kernels serve whatever else switches (tests of their paths)."""
        from torchport.ops import fallback

        self._held += 1
        self.use(False)
        try:
            yield
        finally:
            self._held -= 1
            self.use(not fallback.SLOW)

    def use(self, from_cpp: bool) -> None:
        """Serve the ops from C++ (where it can) or from the Python kernels."""
        if from_cpp and not self._held and self.python and self._enable(self.python):
            native.enabled("host-op kernels")
            self.native = True
            return
        cpp = native.loaded()
        if cpp is not None and hasattr(cpp, "torchport_native_hostops_disable"):
            cpp.torchport_native_hostops_disable()
        self.native = False
        if self._registered is None:
            self._registered = keep_past_exit(torch.library.Library("aten", "IMPL"))
            for name, (kernel, _) in self.python.items():
                self._registered.impl(name, kernel, "PrivateUse1")


def _result_function(backend: DeviceBackend) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """A CPU result C++ does not copy itself, on device ``index`` (as the Python kernels
    move theirs: large ones adopted)."""
    def result(cpu: torch.Tensor, index: int) -> torch.Tensor:
        if cpu._is_zerotensor():
            cpu = torch.zeros(cpu.shape, dtype=cpu.dtype)
        return backend.result_to_device(cpu, index)
    return result


def counts() -> tuple[int, int]:
    """(calls served in C++, calls handed to the Python kernels) in this process."""
    cpp = native.loaded()
    if cpp is None or not hasattr(cpp, "torchport_native_hostops_counts"):
        return (0, 0)
    out = (ctypes.c_int64 * 2)()
    cpp.torchport_native_hostops_counts(out)
    return (out[0], out[1])


def install(backend: DeviceBackend) -> None:
    """Serve the backend's servable host ops natively unless ops are slowed down."""
    from torchport.ops import fallback

    kernels = backend.host_op_kernels
    kernels.use(not fallback.SLOW)
    fallback.on_slow_change(lambda slow: kernels.use(not slow))
