"""Streams and events on ``torch.<device>``, mirroring ``torch.cuda``.

A :class:`Stream` is a ``torch.Stream`` (so ``Tensor.record_stream`` and code
that type-checks streams accept it) whose runtime handle comes from
:meth:`Runtime.create_stream`; stream id 0 is the device's default stream
(runtime handle ``None``). The current stream is per thread and per device, as
in CUDA; :meth:`Backend.current_stream_handle` asks this layer for it, so new
allocations and ``non_blocking`` copies go to the current stream.

Stream-aware freeing: ``tensor.record_stream(s)`` marks the tensor's allocator
block as used by ``s``; when the tensor dies, the allocator records one event
per such stream and keeps the block out of every pool until they completed,
so no other stream is handed memory that pending work still reads.
"""

from __future__ import annotations

import threading
import types
from typing import TYPE_CHECKING, Any

import torch

from torchport.core import interrupts
from torchport.device import device_module
from torchport.memory.allocator import DeviceAllocator
from torchport.runtime import shares_events

if TYPE_CHECKING:
    from torchport.core.contracts import DeviceBackend

_DEVICE_TYPE_PRIVATEUSE1 = 20  # c10::DeviceType::PrivateUse1


class _StreamState:
    """Per-backend stream bookkeeping: default streams, ids, per-thread current streams.

    With the C++ guard (:meth:`connect`) the current streams are the guard's, one state
    with ``torch.accelerator``, ``torch.Stream`` and the autograd engine; without it they
    are kept here per thread."""

    def __init__(self, backend: DeviceBackend) -> None:
        self.backend = backend
        self.lock = threading.Lock()
        self.next_id = 1
        self.by_id: dict[tuple[int, int], Any] = {}  # (logical index, stream id) -> Stream
        self.tls = threading.local()
        self.defaults: list[Any] = []
        self.guard: Any = None  # native.GuardDevice, once connected
        self.events: dict[int, tuple[int, Any, bool]] = {}  # guard event id -> (index, handle, timing)
        self.next_event = 1
        self.pools: dict[tuple[int, int], tuple[list[Any], list[int]]] = {}
        self.sids: dict[int, int] = {}  # id of a stream's runtime handle -> its stream id

    def current(self, index: int) -> Any:
        guard = self.guard
        if guard is not None:
            sid = guard.get_stream(index)
            return self.defaults[index] if sid == 0 else self.by_id[(index, sid)]
        cur: dict[int, Any] | None = getattr(self.tls, "current", None)
        if cur is not None and index in cur:
            return cur[index]
        return self.defaults[index]

    def set_current(self, stream: Any) -> None:
        if self.guard is not None:
            self.guard.set_stream(stream.device_index, stream.stream_id)
            return
        cur = getattr(self.tls, "current", None)
        if cur is None:
            cur = self.tls.current = {}
        cur[stream.device_index] = stream
        self.watch()

    def watch(self) -> None:
        """From now on, let new work ask which stream is current (until a stream other than
        the default one exists, or is current without the guard, nothing needs asking)."""
        if self.backend.stream_hook is None:
            self.backend.stream_hook = lambda index: self.current(index).handle

    def stream(self, index: int, sid: int) -> Any:
        return self.defaults[index] if sid == 0 else self.by_id[(index, sid)]

    def pooled(self, index: int, priority: int, new_stream: Any) -> Any:
        """A stream of the device's pool for ``priority`` (``getStreamFromGlobalPool``): the
        pool grows to :data:`POOL_SIZE` streams, then hands them out round-robin, as CUDA's."""
        with self.lock:
            pool, turn = self.pools.setdefault((index, priority), ([], [0]))
            stream = None
            if len(pool) >= POOL_SIZE:
                stream = pool[turn[0] % POOL_SIZE]
                turn[0] += 1
        if stream is None:  # made outside the lock, which making a stream takes
            stream = new_stream(index, priority)
            with self.lock:
                if len(pool) < POOL_SIZE:
                    pool.append(stream)
        return stream

    def connect(self, guard: Any, new_stream: Any) -> None:
        """Serve the C++ guard's stream and event calls from now on (see native_guard.cpp)."""
        b = self.backend
        rt = b.runtime
        events = self.events

        def event(eid: int) -> tuple[int, Any, bool]:
            return events[eid]

        def serve(op: int, a: int, b_: int, c: int, iout: Any, dout: Any) -> int:
            if op == _NEW_STREAM:
                iout[0] = (self.pooled(a, b_, new_stream) if c else new_stream(a, b_)).stream_id
            elif op == _QUERY_STREAM:
                return int(self.stream(a, b_).query())
            elif op == _SYNC_STREAM:
                self.stream(a, b_).synchronize()
            elif op == _SYNC_DEVICE:
                b.synchronize(a)
            elif op == _EVENT_CREATE:
                with self.lock:
                    eid = self.next_event
                    self.next_event += 1
                events[eid] = (a, rt.create_event(b.phys(a), bool(b_), False), bool(b_))
                iout[0] = eid
            elif op == _EVENT_RECORD:
                index, handle, _ = event(a)
                if index != b_:
                    raise RuntimeError(
                        f"Event device index {index} does not match recording stream's "
                        f"device index {b_}.")
                rt.record_event(b.phys(index), handle, self.stream(b_, c).handle)
            elif op == _EVENT_BLOCK:
                rt.stream_wait_event(b.phys(b_), self.stream(b_, c).handle, event(a)[1])
            elif op == _EVENT_QUERY:
                index, handle, _ = event(a)
                return int(bool(rt.query_event(b.phys(index), handle)))
            elif op == _EVENT_SYNC:
                index, handle, _ = event(a)
                rt.synchronize_event(b.phys(index), handle)
            elif op == _EVENT_ELAPSED:
                (i0, h0, t0), (i1, h1, t1) = event(a), event(b_)
                if not (t0 and t1):
                    raise RuntimeError("Both events must be created with argument "
                                       "'enable_timing=True'.")
                rt.synchronize_event(b.phys(i0), h0)
                rt.synchronize_event(b.phys(i1), h1)
                dout[0] = float(rt.event_elapsed_time(b.phys(i0), h0, h1))
            elif op == _EVENT_DESTROY:
                found = events.pop(a, None)
                if found is not None:
                    rt.destroy_event(b.phys(found[0]), found[1])
            elif op == _RECORD_DATA:
                _record_use(b, a, b_, self.stream(b_, c))
            return 0

        def call(op: int, a: int, b_: int, c: int, iout: Any, dout: Any) -> int:
            # each call is a runtime call, which Ctrl-C does not cut half-way (as CUDA's)
            try:
                return interrupts.to_completion(serve, op, a, b_, c, iout, dout)
            except BaseException as e:  # noqa: BLE001 -- becomes the C++ caller's error
                interrupts.redeliver(e)
                what = repr(e) if isinstance(e, KeyboardInterrupt) else str(e)
                guard.fail(f"{b.name}: {what}".encode(errors="replace"))
                return -1

        self.guard = guard
        guard.set_callback(call)
        for index in range(len(self.defaults)):  # what this thread made current so far
            cur = getattr(self.tls, "current", None) or {}
            if index in cur:
                guard.set_stream(index, cur[index].stream_id)
        if len(self.by_id) > len(self.defaults):
            self.watch()


POOL_SIZE = 32  # streams per device and priority in the pool, as CUDA's

# The guard's calls (native_guard.cpp's Op).
(_NEW_STREAM, _QUERY_STREAM, _SYNC_STREAM, _SYNC_DEVICE, _EVENT_CREATE, _EVENT_RECORD,
 _EVENT_BLOCK, _EVENT_QUERY, _EVENT_SYNC, _EVENT_ELAPSED, _EVENT_DESTROY, _RECORD_DATA) = range(12)


def _make(mod: types.ModuleType, b: DeviceBackend) -> None:
    """Add Stream, Event and the stream functions to the device module ``mod``."""
    state = _StreamState(b)
    rt = b.runtime
    name = b.name

    def _index(device: Any) -> int:
        if device is None or (isinstance(device, str) and device == name):
            return b.current_device()
        if isinstance(device, torch.Stream):
            return device.device_index
        return b.index_of(device)

    class Stream(torch.Stream):
        """A queue of device work executing in issue order (``torch.cuda.Stream``).

        Lower ``priority`` runs first, as in CUDA. Streams are never destroyed
        (CUDA pools them too), so a stream object may be recreated freely."""

        handle: Any

        def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any) -> Stream:
            idx = _index(device)
            if "stream_id" in kwargs:  # internal: wrap an existing id
                sid = int(kwargs["stream_id"])
                handle = kwargs.get("_handle")
            else:
                handle = rt.create_stream(b.phys(idx), int(priority))
                with state.lock:
                    sid = state.next_id
                    state.next_id += 1
            self = super().__new__(cls, stream_id=sid, device_index=idx,
                                   device_type=_DEVICE_TYPE_PRIVATEUSE1)
            self.handle = handle
            self._priority = int(priority)
            state.by_id[(idx, sid)] = self
            if handle is not None:
                state.sids[id(handle)] = sid
            if sid and state.guard is not None:  # PyTorch may make it current from C++
                state.watch()
            return self

        def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
            pass

        @property
        def priority(self) -> int:
            return self._priority

        @property
        def _phys(self) -> int:
            return b.phys(self.device_index)

        def query(self) -> bool:
            """True when all work queued on this stream has finished."""
            return bool(rt.query_stream(self._phys, self.handle))

        def synchronize(self) -> None:
            """Block the host until this stream's work finished (re-raises its errors)."""
            rt.synchronize_stream(self._phys, self.handle)

        def wait_event(self, event: Event) -> None:
            """Make future work on this stream wait for ``event`` (no host block)."""
            event.wait(self)

        def wait_stream(self, stream: Stream) -> None:
            """Make future work on this stream wait for work queued so far on ``stream``."""
            self.wait_event(stream.record_event())

        def record_event(self, event: Event | None = None) -> Event:
            """Record ``event`` (a new one when ``None``) on this stream and return it."""
            if event is None:
                event = Event()
            event.record(self)
            return event

        def __eq__(self, other: object) -> bool:
            return (isinstance(other, torch.Stream) and other.device_type == self.device_type
                    and other.device_index == self.device_index
                    and other.stream_id == self.stream_id)

        def __hash__(self) -> int:
            return hash((self.device_type, self.device_index, self.stream_id))

        def __repr__(self) -> str:
            return f"<torch.{name}.Stream device={name}:{self.device_index} stream_id={self.stream_id}>"

    class Event:
        """A marker in a stream's work (``torch.cuda.Event``); bound to a device at first
        :meth:`record`. Before that, ``query`` is True and ``wait``/``synchronize`` no-ops."""

        def __init__(self, enable_timing: bool = False, blocking: bool = False,
                     interprocess: bool = False) -> None:
            if interprocess:
                if not shares_events(rt):
                    raise _no_ipc_events()
                if enable_timing:
                    raise RuntimeError(f"torch.{name}.Event: an interprocess event cannot "
                                       f"measure time (as on CUDA); create it with "
                                       f"enable_timing=False")
            self.enable_timing = enable_timing
            self.blocking = blocking
            self.interprocess = interprocess
            self.device_index: int | None = None
            self.handle: Any = None

        def _create(self, index: int) -> None:
            self.device_index = index
            phys = b.phys(index)
            self.handle = (rt.create_ipc_event(phys) if self.interprocess
                           else rt.create_event(phys, self.enable_timing, self.blocking))

        @property
        def device(self) -> torch.device | None:
            return None if self.device_index is None else torch.device(name, self.device_index)

        def record(self, stream: Stream | None = None) -> None:
            """Capture the work queued so far on ``stream`` (default: current stream)."""
            if stream is None:
                stream = current_stream()
            if self.device_index is None:
                self._create(stream.device_index)
            elif self.device_index != stream.device_index:
                raise RuntimeError(
                    f"Event device {name}:{self.device_index} does not match recording stream's "
                    f"device {name}:{stream.device_index}")
            rt.record_event(b.phys(self.device_index), self.handle, stream.handle)

        def wait(self, stream: Stream | None = None) -> None:
            """Make future work on ``stream`` (default: current) wait for this event."""
            if stream is None:
                stream = current_stream()
            if self.handle is not None:
                rt.stream_wait_event(b.phys(stream.device_index), stream.handle, self.handle)

        def query(self) -> bool:
            """True when the captured work completed (or the event was never recorded)."""
            if self.handle is None:
                return True
            return bool(rt.query_event(b.phys(self.device_index), self.handle))

        def synchronize(self) -> None:
            """Block the host until the captured work completed."""
            if self.handle is not None:
                rt.synchronize_event(b.phys(self.device_index), self.handle)

        def elapsed_time(self, end_event: Event) -> float:
            """Milliseconds from this event to ``end_event`` (both timing, recorded, done)."""
            if self.handle is None or end_event.handle is None:
                raise RuntimeError("Both events must be recorded before calculating elapsed time")
            if not (self.enable_timing and end_event.enable_timing):
                raise RuntimeError("Both events must be created with enable_timing=True "
                                   "to measure elapsed time")
            self.synchronize()
            end_event.synchronize()
            return float(rt.event_elapsed_time(b.phys(self.device_index), self.handle,
                                               end_event.handle))

        def ipc_handle(self) -> bytes:
            """A handle (bytes) another process opens with :meth:`from_ipc_handle`; the
            event must be ``interprocess=True`` (bound to the current device if it was
            never recorded) and stay alive while others wait for it."""
            if not self.interprocess:
                raise RuntimeError(f"torch.{name}.Event.ipc_handle: the event was not created "
                                   f"with interprocess=True")
            if self.device_index is None:
                self._create(current_stream().device_index)
            return rt.ipc_event_export(b.phys(self.device_index), self.handle)

        @classmethod
        def from_ipc_handle(cls, device: Any, handle: bytes) -> Event:
            """The event another process's :meth:`ipc_handle` names, on ``device``."""
            if not shares_events(rt):
                raise _no_ipc_events()
            ev = cls(interprocess=True)
            ev.device_index = _index(device)
            ev.handle = rt.ipc_event_open(b.phys(ev.device_index), handle)
            return ev

        def __repr__(self) -> str:
            return f"<torch.{name}.Event {'recorded' if self.handle is not None else 'uninitialized'}>"

    def _no_ipc_events() -> NotImplementedError:
        return NotImplementedError(
            f"{name} events cannot be shared between processes: runtime "
            f"{type(rt).__name__} does not implement create_ipc_event/ipc_event_export/"
            f"ipc_event_open; call torch.{name}.synchronize() before signalling the other "
            f"process instead (device tensors passed to it share their memory)")

    for i in range(b.device_count()):
        state.defaults.append(Stream(i, stream_id=0, _handle=None))

    def current_stream(device: Any = None) -> Stream:
        """The stream new work on ``device`` (default: current device) goes to."""
        return state.current(_index(device))

    def default_stream(device: Any = None) -> Stream:
        """The default stream of ``device``."""
        return state.defaults[_index(device)]

    def set_stream(stream: Stream | None) -> None:
        """Make ``stream`` the current stream of its device (``None``: no-op)."""
        if stream is None:
            return
        state.set_current(_own(stream))

    def _own(stream: Any) -> Stream:
        if isinstance(stream, Stream):
            return stream
        if isinstance(stream, torch.Stream) and stream.device_type == _DEVICE_TYPE_PRIVATEUSE1:
            found = state.by_id.get((stream.device_index, stream.stream_id))
            if found is not None:
                return found
        raise TypeError(f"expected a torch.{name}.Stream, got {stream!r}")

    class StreamContext:
        """Context manager that makes ``stream`` current on its device (``None``: no-op)."""

        def __init__(self, stream: Stream | None) -> None:
            self.stream = stream
            self.prev: Stream | None = None

        def __enter__(self) -> Stream | None:
            if self.stream is not None:
                self.prev = current_stream(self.stream.device_index)
                set_stream(self.stream)
            return self.stream

        def __exit__(self, *exc: Any) -> bool:
            if self.stream is not None and self.prev is not None:
                set_stream(self.prev)
            return False

    def stream(stream: Stream | None) -> StreamContext:
        """``with torch.<device>.stream(s):`` -- run the block's work on ``s``."""
        return StreamContext(stream)

    device_module.add(mod, Stream=Stream, Event=Event, StreamContext=StreamContext,
                      current_stream=current_stream, default_stream=default_stream,
                      set_stream=set_stream, stream=stream, _stream_state=state)

    # Until some thread makes another stream current, new work goes to the default
    # stream (handle None) and nothing needs asking: set_current installs the hook.
    b.stream_hook = None
    _install_stream_freeing(b, state)
    _register_record_stream(b, _own)


def _install_stream_freeing(b: DeviceBackend, state: _StreamState) -> None:
    """Give each allocator the hook that names the work a freed block must wait for:
    an event on each stream ``record_stream`` named, and on an asynchronous runtime one
    on the block's allocation stream while that stream still has queued work. (The C++
    allocator records those events itself, through the guard's stream layer: it is given
    the stream ids of runtime stream handles instead.)"""
    if any(not isinstance(a, DeviceAllocator) for a in b.allocators):
        sids = state.sids

        def stream_id_of(handle: Any) -> int:
            return 0 if handle is None else sids[id(handle)]

        for a in b.allocators:
            a.stream_id_of = stream_id_of
            a.stream_of = state.stream
        return
    rt = b.runtime
    asynchronous = rt.asynchronous

    def record(phys: int, handle: Any) -> tuple[int, Any]:
        ev = rt.create_event(phys)
        rt.record_event(phys, ev, handle)
        return (phys, ev)

    def event_query(e: tuple[int, Any]) -> bool:
        return bool(rt.query_event(e[0], e[1]))

    def event_release(e: tuple[int, Any]) -> None:
        rt.destroy_event(e[0], e[1])

    for a in b.allocators:
        def free_events(block: Any, phys: int = a.phys) -> list[tuple[int, Any]]:
            events = [record(b.phys(s.device_index), s.handle) for s in block.stream_uses]
            block.stream_uses.clear()
            if asynchronous and not rt.query_stream(phys, block.stream):
                events.append(record(phys, block.stream))
            return events

        a.free_events = free_events
        a.event_query = event_query
        a.event_release = event_release


def _record_use(b: DeviceBackend, address: int, index: int, stream: Any) -> None:
    """Keep the allocator block at ``address`` on device ``index`` from reuse until the
    work queued so far on ``stream`` ran (``Tensor.record_stream``)."""
    alloc = b.allocator(index)
    if not isinstance(alloc, DeviceAllocator):  # the C++ allocator
        alloc.record_use(address, stream.device_index, stream.stream_id)
        return
    with alloc.lock:
        block = alloc.active.get(address)
        if block is None:
            return  # memory not from this allocator (nothing to protect)
        if stream.device_index == index and stream.handle is block.stream:
            return  # the allocation stream is ordered already
        block.stream_uses.add(stream)


def _register_record_stream(b: DeviceBackend, own: Any) -> None:
    """``Tensor.record_stream`` for device tensors: remember the stream on the block."""

    def record_stream(self: torch.Tensor, s: torch.Stream) -> None:
        stream = own(s)
        st = self.untyped_storage()
        if st.nbytes() != 0:
            _record_use(b, st.data_ptr(), self.device.index, stream)

    b.library().impl("record_stream", record_stream, "PrivateUse1")


def connect_guard(b: DeviceBackend, guard: Any) -> None:
    """Make the C++ guard's per-thread streams the device's current streams and serve its
    stream and event calls (``torch.Stream``, ``torch.Event``, ``torch.accelerator``)."""
    mod = b.device_module
    mod._stream_state.connect(guard, lambda index, priority: mod.Stream(index, priority))


def on_register(backend: DeviceBackend, module: types.ModuleType) -> None:
    """Add the streams and events as ``backend`` registers (:mod:`torchport.features`)."""
    _make(module, backend)
