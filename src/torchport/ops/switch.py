"""What is switched on in the op layer (statistics recorders, tool interceptors; the C++
kernels that queue host ops).

The kernels read one cached flag (``fallback.SLOW``); each of these registries
tells its listeners when it gains or loses members so the flag stays right.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")

#: While C++ queues host ops (``ops/native_hostops.py`` sets it): ``teach(op, out, specs)``,
#: called by a Python host kernel that queued a call, so that C++ queues the calls with its
#: arguments' layout itself from then on (``out``: the ``out=`` overload computing into new
#: tensors laid out as ``specs`` say; ``None``: in place). ``None`` otherwise.
QUEUED_TEACH: Callable[..., None] | None = None

#: Whether the CPU fallback serves ops without a kernel (``TORCHPORT_FALLBACK``,
#: ``ops.set_fallback_enabled``; ``ops/fallback.py`` keeps it): a derived kernel's meta-kernel
#: error hands the call to the CPU kernel for its words only while it does.
FALLBACK_ENABLED: bool = True


class Registry(Generic[T]):
    """Members in the order they joined; ``active`` says whether there are any."""

    def __init__(self) -> None:
        self.members: list[T] = []
        self.active = False
        self._lock = threading.Lock()
        self._listeners: list[Callable[[bool], None]] = []

    def add(self, member: T) -> None:
        with self._lock:
            self.members.append(member)
            self.active = True
        self._notify()

    def remove(self, member: T) -> None:
        """No error when ``member`` is not there."""
        with self._lock:
            if member in self.members:
                self.members.remove(member)
            self.active = bool(self.members)
        self._notify()

    def on_change(self, fn: Callable[[bool], None]) -> None:
        """Call ``fn(active)`` after every add or remove."""
        self._listeners.append(fn)

    def _notify(self) -> None:
        for fn in self._listeners:
            fn(self.active)
