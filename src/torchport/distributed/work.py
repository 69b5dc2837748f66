"""The asynchronous side of the collectives: the ``Work`` a collective returns, its future
and callbacks (kept countable so that exit can wait for the communication threads), and the
error a failed collective raises."""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    pass


Tensor = torch.Tensor
RedOp = dist.ReduceOp.RedOpType


class CollectiveError(RuntimeError):
    """A collective failed: a timeout, a dead peer, or arguments the backend cannot serve."""



_WAITER: Any = None


_CALLBACK_PREFIX = "Got the following error when running the callback: "


def unwrap(msg: str) -> str:
    """Drop the prefixes torch futures put on an error raised in a callback."""
    while msg.startswith(_CALLBACK_PREFIX):
        msg = msg[len(_CALLBACK_PREFIX):]
    if msg.startswith("CollectiveError: "):
        msg = msg[len("CollectiveError: "):]
    return msg.split("\n\nAt:\n")[0]


class DeviceWork(dist.Work):
    """An asynchronous collective: ``wait()`` re-raises its error (PyTorch's
    future-wrapping Work swallows it) and honours a timeout instead of hanging."""

    def __init__(self, fut: torch.futures.Future, what: str = "collective") -> None:
        super().__init__()
        self.fut = fut
        self.what = what

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        if timeout is not None:
            secs = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
            if secs > 0:
                deadline = time.monotonic() + secs
                while not self.fut.done():
                    if time.monotonic() > deadline:
                        raise CollectiveError(f"{self.what} did not complete within {secs:g} s")
                    time.sleep(0.001)
        try:
            self.fut.wait()
        except CollectiveError:
            raise
        except RuntimeError as e:
            raise CollectiveError(unwrap(str(e))) from None
        return True

    def is_completed(self) -> bool:
        return self.fut.done()

    def is_success(self) -> bool:
        if not self.fut.done():
            return False
        try:
            self.fut.value()
        except Exception:
            return False
        return True

    def exception(self) -> BaseException | None:
        try:
            self.fut.value()
        except Exception as e:
            return e
        return None

    def get_future(self) -> torch.futures.Future:
        return self.fut

    def result(self) -> list[Tensor]:
        return self.fut.wait()

    def synchronize(self) -> None:
        self.wait()


def future_of(work: Any) -> torch.futures.Future:
    """``work.get_future()``, or a future completed by a waiter thread for Work types
    that have none (Gloo's reduce_scatter_tensor in 2.13)."""
    global _WAITER
    try:
        return work.get_future()
    except RuntimeError:
        pass
    if _WAITER is None:
        from concurrent.futures import ThreadPoolExecutor

        _WAITER = ThreadPoolExecutor(1, thread_name_prefix="torchport-work")
    fut: torch.futures.Future = torch.futures.Future()

    def wait() -> None:
        try:
            work.wait()
            fut.set_result([])
        except Exception as e:
            fut.set_exception(e)

    _WAITER.submit(wait)
    return fut


# Callbacks still held by C++ futures. After running a callback, the communication thread
# (Gloo's worker, a C++ thread) drops it in ``~PythonFunctionGuard``, which takes the GIL
# inside a destructor (torch/csrc/jit/python/pybind_utils.h). If the interpreter is already
# finalizing, taking the GIL ends the thread with pthread_exit, whose forced unwind through
# that noexcept destructor calls std::terminate: "terminate called without an active
# exception" after an otherwise successful run. Counting live callbacks lets the exit
# handler wait (GIL released) until those threads are done with Python.
_CALLBACKS = [0]
_CALLBACKS_LOCK = threading.Lock()


def _callback_released() -> None:
    with _CALLBACKS_LOCK:
        _CALLBACKS[0] -= 1


def then(fut: torch.futures.Future, fn: Callable[[torch.futures.Future], Any]
          ) -> torch.futures.Future:
    """``fut.then(fn)``, counted until the C++ side releases ``fn`` (see above)."""
    with _CALLBACKS_LOCK:
        _CALLBACKS[0] += 1
    weakref.finalize(fn, _callback_released).atexit = False
    return fut.then(fn)


def callbacks_pending() -> bool:
    """Do communication threads still hold callbacks of this process's collectives?"""
    return _CALLBACKS[0] > 0


def drain_callbacks(timeout: float) -> None:
    """Wait, without holding the GIL, until communication threads dropped every callback."""
    deadline = time.monotonic() + timeout
    while _CALLBACKS[0] > 0 and time.monotonic() < deadline:
        time.sleep(0.002)
