"""What is switched on in the op layer (statistics recorders, tool interceptors).

The kernels read one cached flag (``fallback.SLOW``); each of these registries
tells its listeners when it gains or loses members so the flag stays right.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


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
