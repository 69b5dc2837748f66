"""Ctrl-C inside Python that C++ called (the callbacks of the allocator, the stream layer,
pinned memory and the profiler).

Python raises ``KeyboardInterrupt`` at the next bytecode the main thread runs after SIGINT,
and that can be inside a callback the C++ library made (an event recorded for a block a
storage's deleter returns, a wait for a stream). A callback cannot hand the interrupt back
through C++: turned into a ``c10::Error`` it became a ``RuntimeError``, and in a deleter,
which cannot raise, it was printed and lost -- the program went on as if Ctrl-C had never
been pressed, the interrupted free's block neither in use nor free. Nor can the callback
raise it again itself: Python checks for signals between its bytecodes, so a signal set
inside the callback fires there again. CUDA's runtime calls are never cut half-way; the
signal is handled once control is back in Python. So here a callback catches the
interrupt, finishes its work (:func:`to_completion`) or reports its failure, and
:func:`redeliver` has the C++ library raise SIGINT again once the callback has returned,
where Python's next bytecode is the caller's (native_interrupts.cpp). A SIGINT that arrives
as C++ enters a callback, before its first bytecode, would fire where no ``try`` of the
callback's can catch it: :func:`enable` (at registration) has the C++ library hold SIGINT
while the main thread is inside a callback and raise it again after.

Only for callbacks the C++ library calls: elsewhere nothing would raise it again.
"""

from __future__ import annotations

import _thread
import ctypes
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from torchport.core import native

T = TypeVar("T")

# native_interrupts.cpp's PythonApi: the interpreter's functions, in its order.
_API = ("PyGILState_Ensure", "PyGILState_Release", "PyErr_SetInterrupt", "PyOS_InterruptOccurred")


class _PythonApi(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in _API]


_enabled: list[_PythonApi] = []  # alive for the process: C++ keeps its address


def enable() -> None:
    """Have the C++ library hold SIGINT while Python's main thread is inside one of its
    callbacks, and raise it again once the callback has returned (idempotent; nothing
    without the C++ library)."""
    cpp = native.loaded()
    if cpp is None or _enabled:
        return
    functions = _PythonApi(*(ctypes.cast(getattr(ctypes.pythonapi, name), ctypes.c_void_p).value
                             for name in _API))
    _enabled.append(functions)
    cpp.torchport_interrupts_enable(ctypes.byref(functions),
                                    ctypes.c_ulong(threading.main_thread().ident or 0))


def redeliver(exc: BaseException) -> None:
    """Where ``exc`` is a ``KeyboardInterrupt`` a callback caught: raise it again in the main
    thread once the callback has returned to its C++ caller."""
    if isinstance(exc, KeyboardInterrupt):
        _on_return()


def _on_return() -> None:
    cpp = native.loaded()
    if cpp is None:  # (no C++ caller then: raised again at the next bytecode)
        _thread.interrupt_main()
        return
    enable()
    cpp.torchport_interrupt_requested()


def _held() -> bool:
    """Whether the C++ library holds a Ctrl-C for after this callback (this is a second)."""
    cpp = native.loaded()
    return cpp is not None and bool(cpp.torchport_interrupt_held())


def to_completion(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, run again from the start where Ctrl-C interrupted it, the interrupt
    then raised again once the callback has returned to C++. ``fn`` must be safe to repeat
    (a query, a wait, a recording). A second Ctrl-C during the same call (the first may be
    held by the C++ library) gives up: its ``KeyboardInterrupt`` propagates (a wait that
    never ends stays interruptible)."""
    interrupted = False
    try:
        while True:
            try:
                return fn(*args)
            except KeyboardInterrupt:
                if interrupted or _held():
                    raise
                interrupted = True
    finally:
        if interrupted:
            _on_return()
