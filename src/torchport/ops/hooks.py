"""Interception of device op calls, for the porting tools (autocompare, op dumps).

A tool registers an *interceptor*: a callable ``interceptor(call, run) -> result``
that receives an :class:`OpCall` (overload, name, path, arguments, nesting depth)
and ``run``, which executes the device op and returns its result. Interceptors
wrap each other in registration order (the first registered is outermost).

The op layer calls :func:`dispatch` around every device op call it sees on its
slow paths: native kernels (core ``copy_``/``_to_copy``/``empty`` included),
decompositions, the CPU fallback and metadata-only views. Registering an
interceptor turns the op layer's slow-path flag on; with none registered the
kernels pay only their existing single flag check.

Ops a tool runs itself (copying inputs to the CPU, reference runs) must not be
intercepted: run them inside :func:`suspended` (a thread-local guard).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from torchport.ops.switch import Registry

ACTIVE = False  # read by the op layer: any interceptor registered?
_INTERCEPTORS: Registry[Interceptor] = Registry()
_TLS = threading.local()
_ENV_LOADED = False
_ENV_STARTERS: list[Callable[[], None]] = []


class OpCall:
    """One device op call as seen by interceptors.

    ``path`` is the path chosen before the call (``native``, ``decomposed``,
    ``fallback``, ``view``); a kernel that declines updates it while running.
    ``depth`` is 0 for calls made by PyTorch, >0 for calls made while another
    intercepted call runs (the pieces of a decomposition, ops a kernel calls)."""

    __slots__ = ("args", "depth", "kwargs", "name", "op", "path")

    def __init__(self, op: Any, name: str, path: str, args: tuple, kwargs: dict,
                 depth: int) -> None:
        self.op = op
        self.name = name
        self.path = path
        self.args = args
        self.kwargs = kwargs
        self.depth = depth

    def __repr__(self) -> str:
        return f"OpCall({self.name}, path={self.path}, depth={self.depth})"


class Interceptor(Protocol):
    """What :func:`register` accepts."""

    def __call__(self, call: OpCall, run: Callable[[], Any]) -> Any: ...


def _sync(active: bool) -> None:
    global ACTIVE
    ACTIVE = active


_INTERCEPTORS.on_change(_sync)  # first listener: later ones see ACTIVE already updated


def register(interceptor: Interceptor) -> Interceptor:
    """Start intercepting device op calls with ``interceptor``; returns it."""
    _INTERCEPTORS.add(interceptor)
    return interceptor


def unregister(interceptor: Interceptor) -> None:
    """Stop ``interceptor`` (no error when it is not registered)."""
    _INTERCEPTORS.remove(interceptor)


def interceptors() -> list[Interceptor]:
    """The registered interceptors, outermost first."""
    return list(_INTERCEPTORS.members)


def on_change(fn: Callable[[], None]) -> None:
    """Call ``fn`` whenever interception starts or stops (the op layer caches a flag)."""
    _INTERCEPTORS.on_change(lambda active: fn())


def busy() -> bool:
    """True inside :func:`suspended` on this thread: calls are not intercepted."""
    return getattr(_TLS, "busy", 0) > 0


@contextmanager
def suspended() -> Iterator[None]:
    """Run the tools' own ops without intercepting them (thread-local, nestable)."""
    _TLS.busy = getattr(_TLS, "busy", 0) + 1
    try:
        yield
    finally:
        _TLS.busy -= 1


def dispatch(op: Any, name: str, path: str, args: tuple, kwargs: dict,
             body: Callable[[OpCall], Any]) -> Any:
    """Run one device op call through the interceptors; ``body(call)`` executes it."""
    depth = getattr(_TLS, "depth", 0)
    call = OpCall(op, name, path, args, kwargs, depth)
    chain = list(_INTERCEPTORS.members)
    if not chain:
        return body(call)

    def step(i: int) -> Any:
        if i == len(chain):
            _TLS.depth = depth + 1
            try:
                return body(call)
            finally:
                _TLS.depth = depth
        return chain[i](call, lambda: step(i + 1))

    return step(0)


def on_load_env(start: Callable[[], None]) -> None:
    """Call ``start`` at :func:`load_env`: a tool that environment variables switch on
    (the porting tools register theirs, :mod:`torchport.tools.debug.env`); once per ``start``."""
    if start not in _ENV_STARTERS:
        _ENV_STARTERS.append(start)


def load_env() -> None:
    """Start the tools asked for by environment variables (once, at backend registration)."""
    global _ENV_LOADED
    if _ENV_LOADED:
        return
    _ENV_LOADED = True
    for start in _ENV_STARTERS:
        start()
