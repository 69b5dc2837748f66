"""Device time in ``torch.profiler``: PyTorch's PrivateUse1 profiler stubs, in C++.

PyTorch times each op on a PrivateUse1 device only in the profiler state
``KINETO_PRIVATEUSE1_FALLBACK``: the kineto profiler records an event from the
PrivateUse1 *profiler stubs* at the op's start and end and reads the time between them
(``Self <DEVICE>``/``<DEVICE> total`` in ``key_averages().table()``). The stubs are C++
(``ProfilerStubs``, ``registerPrivateUse1Methods``) and PyTorch's defaults throw from every
method, which the profiler prints with a C++ backtrace for every op. PyTorch 2.13 picks
that state for ``torch.autograd.profiler.profile(use_device=...)`` (``use_kineto=False``);
``torch.profiler.profile(activities=[..., ProfilerActivity.PrivateUse1])`` builds its
profile with ``use_kineto=True``, which picks ``KINETO_PRIVATEUSE1``, a state served only
by a kineto activity profiler in C++ (``REGISTER_PRIVATEUSE1_PROFILER``), so the device
columns stay empty there.

So :func:`install` registers the stubs of ``native_profiler.cpp``, which make the events
with the vendor runtime (:meth:`Runtime.create_event` with timing, recorded on the current
device's current stream; elapsed time after :meth:`Runtime.synchronize_event`) through the
ctypes callbacks below, and has every profile of the device (both forms) use the fallback
state, unless a kineto activity profiler of PrivateUse1 is registered. Without the C++
library no stubs can be registered: the profile then records CPU time only, with one
:class:`DeviceProfilerWarning`, instead of a backtrace per op. Nothing changes while no
profiler runs: PyTorch calls the stubs from its profiler's callbacks only.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import itertools
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch._C._profiler import ProfilerActivity, ProfilerState

from torchport.core import interrupts, native

if TYPE_CHECKING:
    from torchport.core.contracts import DeviceBackend

_RECORD = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.POINTER(ctypes.c_int32))
_ELAPSED = ctypes.CFUNCTYPE(ctypes.c_double, ctypes.c_int64, ctypes.c_int64)
_RELEASE = ctypes.CFUNCTYPE(None, ctypes.c_int64)
_SYNCHRONIZE = ctypes.CFUNCTYPE(None)


class DeviceProfilerWarning(RuntimeWarning):
    """The profiler cannot time ops on the device (no C++ library, or a runtime failure)."""


class _Events:
    """The runtime events the stubs hold, by handle (what the C++ side keeps)."""

    def __init__(self, backend: DeviceBackend) -> None:
        self.backend = backend
        self.runtime = backend.runtime
        self.live: dict[int, tuple[int, Any]] = {}  # handle -> (physical index, event)
        self.ids = itertools.count(1)
        self.created = 0
        self.failed = False

    def record(self, device: Any) -> int:
        b, rt = self.backend, self.runtime
        index = b.current_device()
        phys = b.visible[index]
        event = rt.create_event(phys, True, False)
        try:
            rt.record_event(phys, event, b.current_stream_handle(index))
        except BaseException:
            rt.destroy_event(phys, event)
            raise
        handle = next(self.ids)
        self.live[handle] = (phys, event)
        self.created += 1
        device[0] = index
        return handle

    def elapsed(self, start: int, end: int) -> float:
        """Microseconds from ``start`` to ``end``; -1 for events of two devices."""
        (phys, first), (phys_end, last) = self.live[start], self.live[end]
        if phys != phys_end:  # a range that changed device: no common clock on a chip
            return -1.0
        rt = self.runtime
        rt.synchronize_event(phys, first)
        rt.synchronize_event(phys, last)
        return float(rt.event_elapsed_time(phys, first, last)) * 1000.0

    def release(self, handle: int) -> None:
        entry = self.live.pop(handle, None)
        if entry is not None:
            self.runtime.destroy_event(*entry)

    def synchronize(self) -> None:
        for index in range(self.backend.device_count()):
            self.backend.synchronize(index)

    def report(self, what: str, exc: BaseException) -> None:
        """One warning for the first failure: the op gets no device time, the process
        goes on (an exception cannot leave a callback)."""
        if self.failed:
            return
        self.failed = True
        try:
            warnings.warn(f"torchport: the profiler could not {what} on {self.backend.name} "
                          f"({type(exc).__name__}: {exc}); those ops show no device time",
                          DeviceProfilerWarning, stacklevel=2)
        except Exception:  # warnings turned into errors: nothing may leave the callback
            pass


def _guarded(fn: Callable[..., Any], what: str, default: Any,
             events: _Events) -> Callable[..., Any]:
    def call(*args: Any) -> Any:
        try:
            return interrupts.to_completion(fn, *args)  # (Ctrl-C: raised once back in C++)
        except KeyboardInterrupt as exc:  # a second one: the call is given up
            interrupts.redeliver(exc)
        except BaseException as exc:
            events.report(what, exc)
        return default

    return call


class _State:
    events: _Events | None = None
    callbacks: tuple[Any, ...] = ()  # the ctypes callbacks, alive while C++ may call them
    device_time = False
    why = ""


_S = _State()


def _enable(cpp: ctypes.CDLL, events: _Events) -> bool:
    callbacks = (
        _RECORD(_guarded(events.record, "record an event", 0, events)),
        _ELAPSED(_guarded(events.elapsed, "time an op", -1.0, events)),
        _RELEASE(_guarded(events.release, "destroy an event", None, events)),
        _SYNCHRONIZE(_guarded(events.synchronize, "synchronize", None, events)),
    )
    enable = cpp.torchport_profiler_enable
    enable.restype = ctypes.c_int
    enable.argtypes = [ctypes.c_int, _RECORD, _ELAPSED, _RELEASE, _SYNCHRONIZE]
    if not enable(events.backend.device_count(), *callbacks):
        return False
    _S.callbacks = callbacks
    cpp.torchport_profiler_disable.restype = None
    atexit.register(cpp.torchport_profiler_disable)  # no Python from C++ after this
    native.enabled("profiler stubs (device time per op)")
    return True


def _kineto_profiler_registered(cpp: ctypes.CDLL | None) -> bool:
    if cpp is None:
        return False
    cpp.torchport_profiler_kineto_registered.restype = ctypes.c_int
    return bool(cpp.torchport_profiler_kineto_registered())


def install(backend: DeviceBackend) -> None:
    """At registration: register the profiler stubs where the C++ library loads, and make
    every profile of ``backend``'s device time its ops with them."""
    cpp = native.load()
    events = _Events(backend)
    _S.events = events
    _S.device_time = cpp is not None and _enable(cpp, events)
    _S.why = "" if _S.device_time else (native.UNAVAILABLE or "TORCHPORT_NATIVE=0")
    if not _kineto_profiler_registered(cpp):
        _route_profiles(backend.name)


def _route_profiles(name: str) -> None:
    """Give each ``torch.autograd.profiler.profile`` of device ``name`` (what
    ``torch.profiler.profile`` builds too) the fallback state, where the stubs time ops;
    without them, CPU time only, with one warning."""
    cls = torch.autograd.profiler.profile
    if getattr(cls.__init__, "__torchport__", False):
        return
    init = cls.__init__
    warned = False

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        nonlocal warned
        init(self, *args, **kwargs)
        if not getattr(self, "enabled", False) or getattr(self, "use_device", None) != name \
                or not self.use_cpu or self.profiler_kind not in (
                    ProfilerState.KINETO_PRIVATEUSE1, ProfilerState.KINETO_PRIVATEUSE1_FALLBACK):
            return
        self.kineto_activities.discard(ProfilerActivity.PrivateUse1)
        if _S.device_time:
            self.profiler_kind = ProfilerState.KINETO_PRIVATEUSE1_FALLBACK
            return
        self.profiler_kind = ProfilerState.KINETO
        if not warned:
            warned = True
            warnings.warn(f"torchport: the profiler records no {name} device time without "
                          f"torchport's C++ library ({_S.why}); CPU times are recorded (build "
                          f"the library: a C++ compiler, TORCHPORT_NATIVE unset)",
                          DeviceProfilerWarning, stacklevel=2)

    __init__.__torchport__ = True  # type: ignore[attr-defined]
    cls.__init__ = __init__  # type: ignore[method-assign]


def device_time() -> bool:
    """Does the profiler time ops on the device in this process (the stubs are registered)?"""
    return _S.device_time


def live_events() -> int:
    """Runtime events the profiler holds now (released with the profile's results)."""
    return 0 if _S.events is None else len(_S.events.live)


def events_created() -> int:
    """Runtime events the profiler has created in this process."""
    return 0 if _S.events is None else _S.events.created
