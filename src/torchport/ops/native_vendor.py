"""A vendor's out= kernels called from C++, without a Python entry per call.

A kernel set's ``out_kernel`` (a Python function) or ``c_out_kernel`` (a C function) serves
three overloads, the ``out=`` one and the functional and in-place ones torchport derives
(:mod:`torchport.ops.derive`). Registered as Python kernels, each call would pay PyTorch's
boxing into Python objects and the derive wrapper's checks, about 30 us for a kernel that
does nothing. ``native_vendor_kernels.cpp`` registers them as C++ kernels instead: per call
a layout key and the call of the vendor's function (a C function without the GIL). What the
wrapper decides per call it asks once per layout of the arguments (:func:`derive.planner`);
the calls it leaves to Python (an ``out=`` to resize, a written tensor sharing memory with an
argument, a dtype the kernel does not declare) and every call while ops are intercepted
(op statistics, forced fallback, tools: ``fallback.SLOW``) take the Python kernel as before.
Without the library (no compiler, ``TORCHPORT_NATIVE=0``) the Python kernels serve.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from torchport.core import native
from torchport.ops import c_kernels, derive
from torchport.ops.declarations import Decline

if TYPE_CHECKING:
    from torchport.core.contracts import DeviceBackend

KINDS = {"out": 0, "functional": 1, "inplace": 2}
_held = 0  # python_only() depth
_listening = False


@functools.cache
def _functions() -> tuple[Any, Any] | None:
    add = native.python_function(
        "torchport_vendor_kernels_add",
        [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int, ctypes.py_object, ctypes.py_object,
         ctypes.py_object, ctypes.py_object, ctypes.c_uint64, ctypes.c_int64], ctypes.c_int)
    configure = native.python_function("torchport_vendor_kernels_configure",
                                       [ctypes.py_object, ctypes.py_object], ctypes.c_int)
    return None if add is None or configure is None else (add, configure)


def register(backend: DeviceBackend, name: str, op: torch._ops.OpOverload, kind: str,
             out_op: torch._ops.OpOverload, kernel: Callable[..., Any], fn: Callable[..., Any],
             refuses: Callable[[tuple, dict], bool], next_path: Callable[..., Any],
             group: int = 0) -> bool:
    """Register overload ``name`` (``op``, of ``kind``) of the vendor's out= kernel ``fn``
    (of ``out_op``) in C++, with ``kernel`` (as Python would register it) for the calls C++
    leaves to Python and ``next_path`` for a declined call, as one of ``group``'s (a kernel
    set's, which :func:`remove` withdraws); False: the library cannot, the caller registers
    ``kernel``."""
    global _listening
    functions = _functions()
    if functions is None or backend._guard_device is None:
        return False
    add, configure = functions
    configure(Decline, functools.partial(c_kernels.stream_handle, backend))
    out_name = out_op._schema.name.split("::")[1] + (
        "." + out_op._schema.overload_name if out_op._schema.overload_name else "")
    address = fn.address if isinstance(fn, c_kernels.CKernel) else 0
    add(name.encode(), out_name.encode(), KINDS[kind], kernel,
        derive.planner(kind, op, out_op, refuses), next_path, fn, address, group)
    native.enabled("vendor kernels")
    if not _listening:
        from torchport.ops import fallback, teardown

        fallback.on_slow_change(lambda _: _refresh())
        teardown.on_start(_refresh)
        _listening = True
        _refresh()
    return True


def remove(group: int) -> None:
    """Withdraw ``group``'s registrations: their overloads take the dispatcher's next
    kernel again (none of their calls may be running)."""
    fn = native.python_function("torchport_vendor_kernels_remove", [ctypes.c_int64], None)
    if fn is not None:
        fn(group)


def _refresh() -> None:
    """The Python kernels serve while ops are intercepted, the interpreter exits, or a
    :func:`python_only` block runs."""
    from torchport.ops import fallback

    cpp = native.loaded()
    if cpp is not None and hasattr(cpp, "torchport_vendor_kernels_python_only"):
        cpp.torchport_vendor_kernels_python_only(int(fallback.SLOW or _held > 0))


@contextlib.contextmanager
def python_only() -> Iterator[None]:
    """Within: the vendor's out= kernels take their Python path (tests of that path)."""
    global _held
    _held += 1
    _refresh()
    try:
        yield
    finally:
        _held -= 1
        _refresh()


def counts() -> tuple[int, int, int]:
    """(calls served from C++, calls handed to Python, calls the vendor's kernel declined
    in C++) in this process."""
    return native.counters("torchport_vendor_kernels_counts", 3)  # type: ignore[return-value]
