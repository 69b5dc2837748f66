"""Device op results while the interpreter tears its modules down.

Once the interpreter has started finalising (``sys.is_finalizing()``: the ``__del__`` of
module globals, generators closed by the teardown), PyTorch no longer takes the reference
that preserves the Python object of a tensor C++ still holds (its PyObject preservation
skips Python while the interpreter is not initialised). A Python kernel's result handed
back to C++ is then freed under it, and PyTorch aborts in ``THPVariable_clear``
(``use_count() == 1``). CUDA's kernels, in C++, never meet this; the device's Python
kernels do. From torchport's exit handler on, the kernels take their slow path
(``fallback.SLOW``), which hands each result to :func:`keep`, as the host runs hand their
Python storages: kept from the start of the teardown and never freed (a Python storage
freed while C++ still holds its memory trips PyTorch's ``THPStorage_dealloc`` assertion
just as well). Kernels in C++ keep their path (their results never had a Python object).
"""

from __future__ import annotations

import atexit
import ctypes
import sys
from collections.abc import Callable
from typing import Any

ACTIVE = False  # the exit handlers have started: results may have to be kept
_KEPT: list[Any] = []
_LISTENERS: list[Callable[[], None]] = []


def keep(result: Any, finalizing: Callable[[], bool] = sys.is_finalizing,
         kept: list[Any] = _KEPT) -> Any:
    """``result``, kept alive until the process ends when the teardown has started."""
    # the defaults hold what the teardown may clear from this module's globals
    if finalizing():
        kept.append(result)
    return result


def on_start(fn: Callable[[], None]) -> None:
    """Call ``fn`` when the exit handlers reach torchport's (the op layer's flag)."""
    _LISTENERS.append(fn)


def _start() -> None:
    global ACTIVE
    ACTIVE = True
    for fn in _LISTENERS:
        fn()


def install() -> None:
    """Keep results from the exit handlers on (ops before them pay nothing)."""
    # a reference no teardown step drops: what is kept is never freed under C++
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(_KEPT))
    atexit.register(_start)
