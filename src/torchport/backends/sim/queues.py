"""The sim's streams in asynchronous mode (``TORCHPORT_SIM_ASYNC=1``): one worker thread per
stream runs its launches in issue order, the host waits only when a stream holds
:data:`MAX_QUEUED` of them, and a failure is reported at the next synchronising call."""

from __future__ import annotations

import ctypes
import queue
import threading
from collections.abc import Callable
from typing import Any


class SimAsyncError(RuntimeError):
    """Work queued on a sim stream failed; raised at the next synchronising call."""


# Launches a stream may hold before the host waits for it to catch up (CUDA blocks the
# host at about this depth): bounds memory in flight and what an interrupt abandons.
MAX_QUEUED = 1024


def _report(label: str, err: tuple[str, BaseException] | None) -> None:
    """Raise a failure a stream's queue kept, ``(op name, exception)``, if any."""
    if err is not None:
        name, exc = err
        raise SimAsyncError(f"sim: {name or 'work'} failed asynchronously on {label}: "
                            f"{type(exc).__name__}: {exc} (set TORCHPORT_LAUNCH_BLOCKING=1 "
                            f"to get the error where the op is called)") from exc


class _Worker:
    """One sim stream in asynchronous mode: a thread running its work in issue order.

    ``submitted``/``completed`` count tickets; the first failure is kept (with the
    op's name) until a synchronising call reports it; later work still runs, so the
    device stays usable. The host waits once :data:`MAX_QUEUED` launches are queued;
    ``abandon()`` drops what is queued (at interrupt and exit)."""

    def __init__(self, label: str, inline: bool = False) -> None:
        self.label = label
        self.q: queue.SimpleQueue[tuple[int, Callable[[], Any], str]] = queue.SimpleQueue()
        self.cv = threading.Condition()
        self.submitted = 0
        self.completed = 0
        self.abandoned = False
        # at exit, after the queue drained: work runs in the caller (the interpreter no
        # longer schedules this thread once it finalizes: a finaliser's op would wait forever)
        self.inline = inline
        self.error: tuple[str, BaseException] | None = None
        self.thread = threading.Thread(target=self._loop, name=f"torchport-{label}", daemon=True)
        if not inline:
            self.thread.start()

    def submit(self, fn: Callable[[], Any], name: str, bounded: bool = False) -> int:
        """Queue ``fn``; a ``bounded`` launch first waits for room (kernels and copies,
        never markers: an event is recorded while the allocator's lock is held, and
        work that finishes frees memory under that lock)."""
        if self.inline:
            with self.cv:
                self.submitted += 1
                ticket = self.submitted
            self._run(ticket, fn, name)
            return ticket
        with self.cv:
            if bounded and self.submitted - self.completed >= MAX_QUEUED \
                    and threading.current_thread() is not self.thread:
                self.cv.wait_for(lambda: self.submitted - self.completed < MAX_QUEUED)
            self.submitted += 1
            ticket = self.submitted
        self.q.put((ticket, fn, name))
        return ticket

    def _loop(self) -> None:
        while True:
            self._run(*self.q.get())

    def _run(self, ticket: int, fn: Callable[[], Any], name: str) -> None:
        if not self.abandoned:
            try:
                fn()
            except BaseException as exc:  # reported at the next synchronising call
                with self.cv:
                    if self.error is None:
                        self.error = (name, exc)
        with self.cv:
            self.completed = ticket
            self.cv.notify_all()

    def abandon(self) -> None:
        """Drop the queued work: what runs now finishes, the rest is skipped."""
        self.abandoned = True

    def queued(self) -> int:
        return self.submitted - self.completed

    def done(self, ticket: int | None = None) -> bool:
        return self.completed >= (self.submitted if ticket is None else ticket)

    def wait(self, ticket: int | None = None) -> None:
        with self.cv:
            target = self.submitted if ticket is None else ticket
            self.cv.wait_for(lambda: self.completed >= target)

    def raise_error(self) -> None:
        with self.cv:
            err, self.error = self.error, None
        _report(self.label, err)


class _Native:
    """The C++ queue functions (``native_queues.cpp``), or ``None`` without the library."""

    def __init__(self) -> None:
        from torchport.core import native

        self.cpp = cpp = native.loaded() if native.wanted() else None
        if cpp is None or not hasattr(cpp, "torchport_queue_new"):
            self.cpp = None
            return
        c = ctypes
        cpp.torchport_queue_new.restype = c.c_void_p
        cpp.torchport_queue_new.argtypes = [c.c_char_p, c.c_int64, c.c_int]
        for name, res, args in (
                ("torchport_queue_marker", c.c_int64, [c.c_void_p]),
                ("torchport_queue_wait_for", c.c_int64, [c.c_void_p, c.c_void_p, c.c_int64]),
                ("torchport_queue_wait", c.c_int, [c.c_void_p, c.c_int64, c.c_int]),
                ("torchport_queue_submitted", c.c_int64, [c.c_void_p]),
                ("torchport_queue_completed", c.c_int64, [c.c_void_p]),
                ("torchport_queue_abandon", None, [c.c_void_p]),
                ("torchport_queue_abandoned", c.c_int, [c.c_void_p]),
                ("torchport_queue_run_inline", None, [c.c_void_p])):
            f = getattr(cpp, name)
            f.restype, f.argtypes = res, args
        self.submit = native.python_function(
            "torchport_queue_submit", [c.c_void_p, c.py_object, c.c_char_p, c.c_int], c.c_int64)
        self.take_error = native.python_function(
            "torchport_queue_take_error", [c.c_void_p], c.py_object)
        self.submit_call = native.python_function(
            "torchport_queue_submit_call",
            [c.c_void_p, c.c_char_p, c.c_char_p, c.py_object, c.py_object, c.c_char_p],
            c.c_int64)


_native: _Native | None = None


def native_queues() -> _Native | None:
    """The C++ queues where the library has them (made on first use)."""
    global _native
    if _native is None:
        _native = _Native()
    return _native if _native.cpp is not None else None


class _NativeWorker:
    """:class:`_Worker` over a C++ queue (``native_queues.cpp``): the same interface, a C++
    worker thread that takes the GIL only for work given as a Python callable. Host-op
    kernels queue their CPU kernels here from C++ (``handle``), and an event's marker or a
    wait for another stream needs no Python at all."""

    def __init__(self, label: str, lib: _Native, inline: bool = False) -> None:
        self.label = label
        self.lib = lib
        self.cpp = lib.cpp
        self.handle: int = self.cpp.torchport_queue_new(label.encode(), MAX_QUEUED, int(inline))
        self._inline = inline
        self._error: tuple[str, BaseException] | None = None

    @property
    def error(self) -> tuple[str, BaseException] | None:
        """The first failure not reported yet: (op name, exception)."""
        got = self.lib.take_error(self.handle)
        if got is not None and self._error is None:
            self._error = got
        return self._error

    @property
    def inline(self) -> bool:
        return self._inline

    @inline.setter
    def inline(self, value: bool) -> None:
        if value and not self._inline:
            self.cpp.torchport_queue_run_inline(self.handle)
        self._inline = value

    @property
    def abandoned(self) -> bool:
        return bool(self.cpp.torchport_queue_abandoned(self.handle))

    @property
    def submitted(self) -> int:
        return self.cpp.torchport_queue_submitted(self.handle)

    @property
    def completed(self) -> int:
        return self.cpp.torchport_queue_completed(self.handle)

    def submit(self, fn: Callable[[], Any], name: str, bounded: bool = False) -> int:
        return self.lib.submit(self.handle, fn, name.encode(), int(bounded))

    def submit_op(self, op: Any, args: tuple, kwargs: dict, name: str) -> int:
        """Queue ``op``'s CPU kernel (an ATen ``OpOverload``) on ``(args, kwargs)``: the
        worker runs it without the GIL. Its ticket, or 0: arguments the schema does not
        take as they are (a number in a tensor's place), not queued."""
        schema = op._schema
        return self.lib.submit_call(self.handle, schema.name.encode(),
                                    schema.overload_name.encode(), args, kwargs, name.encode())

    def marker(self) -> int:
        """A ticket that completes when the work queued before it has run."""
        return self.cpp.torchport_queue_marker(self.handle)

    def wait_for(self, other: _NativeWorker, ticket: int) -> int:
        """Later work waits until ``other`` has run ``ticket``."""
        return self.cpp.torchport_queue_wait_for(self.handle, other.handle, ticket)

    def abandon(self) -> None:
        self.cpp.torchport_queue_abandon(self.handle)

    def queued(self) -> int:
        return self.submitted - self.completed

    def done(self, ticket: int | None = None) -> bool:
        return bool(self.cpp.torchport_queue_wait(self.handle, ticket or 0, -1))

    def wait(self, ticket: int | None = None) -> None:
        # in slices, so that Ctrl-C reaches the waiting thread between them
        target = ticket or self.cpp.torchport_queue_submitted(self.handle)
        wait = self.cpp.torchport_queue_wait
        while not wait(self.handle, target, 50):
            pass

    def raise_error(self) -> None:
        err, self._error = self.error, None
        _report(self.label, err)
