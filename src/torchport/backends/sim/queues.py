"""The sim's streams in asynchronous mode (``TORCHPORT_SIM_ASYNC=1``): one worker thread per
stream runs its launches in issue order, the host waits only when a stream holds
:data:`MAX_QUEUED` of them, and a failure is reported at the next synchronising call."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any


class SimAsyncError(RuntimeError):
    """Work queued on a sim stream failed; raised at the next synchronising call."""


# Launches a stream may hold before the host waits for it to catch up (CUDA blocks the
# host at about this depth): bounds memory in flight and what an interrupt abandons.
MAX_QUEUED = 1024


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
        if err is not None:
            name, exc = err
            raise SimAsyncError(f"sim: {name or 'work'} failed asynchronously on {self.label}: "
                                f"{type(exc).__name__}: {exc} (set TORCHPORT_LAUNCH_BLOCKING=1 "
                                f"to get the error where the op is called)") from exc
