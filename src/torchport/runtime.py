"""The vendor runtime interface: the one class a chip vendor implements first.

torchport never touches device memory by itself. Everything it needs from the
hardware -- devices, memory, copies, streams, events -- goes through a
:class:`Runtime`. It plays the role of DIPU's ``deviceapis.h`` or the ACL/CNRT
layer under torch_npu / torch_mlu. Kernels (see ``torchport.ops``) are the
other half a vendor writes.

Conventions every method follows:

* ``index`` is the *physical* device index of the runtime (0 .. ``device_count()-1``).
  torchport applies ``TORCHPORT_VISIBLE_DEVICES`` renumbering on top.
* Device addresses are plain ``int``; torchport treats them as opaque unless
  :attr:`Runtime.host_addressable` is true.
* Host addresses are plain ``int`` pointing at CPU memory the caller keeps alive
  until the copy has finished (for asynchronous copies: until the stream reaches it).
* ``stream`` is a handle returned by :meth:`Runtime.create_stream`, or ``None`` for
  the device's default stream. **The default stream is a stream** (CUDA's rule): every
  launch, copy, memset and event record runs after the work queued before it on its
  stream, ``None`` included. A copy or memset given ``None`` is in addition complete on
  return, as ``cudaMemcpy``: the runtime first lets the work queued on the default
  stream finish, then copies. One given a stream handle is appended to that stream's
  queue and returns.
* A kernel's device-side work (the function given to :meth:`Runtime.launch`) is the
  chip itself: it reads and writes device memory directly, never through these host
  calls, which would wait for the queue it runs in.
* A method that fails raises; :meth:`Runtime.malloc` alone reports exhaustion by
  returning ``None`` so the caching allocator can free cached blocks and retry.

What a vendor must implement: the devices (:meth:`~Runtime.device_count`,
:meth:`~Runtime.get_device_properties`), memory (:meth:`~Runtime.malloc`,
:meth:`~Runtime.free`, :meth:`~Runtime.mem_get_info`) and copies (``copy_h2d``,
``copy_d2h``, ``copy_d2d``, ``memset``): the abstract methods. The rest has defaults.

Synchronous and asynchronous devices. A real accelerator has in-order queues (CUDA
streams, ACL/CNRT queues): the host appends work -- a kernel launch, a copy, an event
record, a wait on another queue's event -- and goes on; the device runs each queue's work
in the order it was appended. :attr:`Runtime.asynchronous` says which kind a runtime is:

* **Synchronous** (``asynchronous = False``, the default): every call is complete on
  return -- a kernel has run when :meth:`Runtime.launch` returns, a copy has landed. Each
  queue is then always empty, and the stream and event methods have exact defaults:
  ``create_stream`` returns a handle, ``synchronize``/``synchronize_stream`` return at once,
  ``query_*`` say finished, ``stream_wait_event`` waits for nothing, ``record_event``
  takes the host's clock so that ``event_elapsed_time`` measures. A device whose driver
  blocks (or a first port) implements only the abstract methods.
* **Asynchronous** (``asynchronous = True``): a stream handle names one of the device's
  queues (``None``: its default queue). :meth:`Runtime.launch` and every copy or memset
  given a stream *append* to that queue and return; ``stream=None`` copies and memsets
  wait for the default queue, then complete on return (torchport synchronises a
  non-default current stream itself where the copy must see its work). ``record_event``
  appends a marker, ``stream_wait_event`` appends a wait
  on it, ``synchronize_*`` block until the queue (or marker) is reached and re-raise the
  first error of work that ran there, ``query_*`` poll. Such a runtime overrides all the
  stream and event methods and :meth:`Runtime.launch` (``Runtime.ASYNC_REQUIRED``);
  torchport then keeps freed memory until the queues that used it are past it (it calls
  :meth:`Runtime.free` only for memory no queued work uses), and orders copies across
  devices with events, as PyTorch does on CUDA.
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass, field
from typing import Any

import torch

StreamHandle = Any
EventHandle = Any


@dataclass(frozen=True)
class DeviceProperties:
    """What ``torch.<device>.get_device_properties`` reports (CUDA's field names)."""

    name: str
    total_memory: int
    major: int = 1
    minor: int = 0
    multi_processor_count: int = 1
    extra: dict[str, Any] = field(default_factory=dict)
    # The rest of CUDA's fields (torch._C._CudaDeviceProperties, 2.13 to 2.15): code written
    # for CUDA reads them (inductor's cache key reads gcnArchName on a build without CUDA).
    is_integrated: int = 0
    is_multi_gpu_board: int = 0
    # A runtime that does not set the thread model gets what inductor assumes for a device
    # that reports none (torch/_inductor/runtime/hints.py, choices.py): its GPU reduction
    # heuristics, which a vendor's own code generator takes, size a split from these and
    # divide by zero unless multi_processor_count * max_threads_per_multi_processor is at
    # least 8 warps.
    max_threads_per_multi_processor: int = 2048
    max_threads_per_block: int = 1024
    warp_size: int = 32
    uuid: str = ""
    L2_cache_size: int = 0  # noqa: N815  (CUDA's name)
    clock_rate: int = 0
    memory_clock_rate: int = 0
    memory_bus_width: int = 0
    shared_memory_per_block: int = 0
    shared_memory_per_block_optin: int = 0
    shared_memory_per_multiprocessor: int = 0
    regs_per_multiprocessor: int = 0

    @property
    def gcnArchName(self) -> str:  # noqa: N802  (CUDA's name)
        """The architecture name ROCm reports; here the device's name."""
        return self.name

    def __repr__(self) -> str:
        mib = self.total_memory // (1024 * 1024)
        return (
            f"_DeviceProperties(name='{self.name}', major={self.major}, minor={self.minor}, "
            f"total_memory={mib}MB, multi_processor_count={self.multi_processor_count})"
        )


@dataclass(frozen=True)
class NativeCopies:
    """A runtime's blocking copies as C functions (:meth:`Runtime.native_copies`).

    ``copy_d2h`` and ``copy_h2d`` are the addresses of two C functions of the signature
    ``int32_t fn(void *context, int32_t index, uint64_t dst, uint64_t src, uint64_t nbytes)``
    (``context`` is passed as given; ``index`` is the runtime's physical device index; the
    host side is a host address, the device side a device address, as the Python methods
    take them). Each keeps the ``stream=None`` rule of the Python method (after the default
    stream's work, complete on return) and may be called from any thread, without the GIL.
    It returns 0 once the bytes moved; any other value moves nothing and hands the copy to
    the Python method, which waits, raises the runtime's error or copies (a driver's fast
    path that declines a busy queue or an unknown address). ``keep`` holds what keeps the
    functions and the context alive (a ``ctypes`` library, ``CFUNCTYPE`` objects).

    ``copy_d2d`` (optional) is the address of a copy within one device of the same signature
    (``dst`` and ``src`` both device addresses of device ``index``; the spans may overlap),
    under the same rules: a copy within the device of one span of bytes (``t.clone()``,
    ``dst.copy_(src)`` of contiguous tensors of one dtype) then runs without Python.

    ``query_default_stream`` (optional, for an asynchronous runtime) is the address of
    ``int32_t fn(void *context, int32_t index)``: 1 when device ``index``'s default stream
    has run everything queued on it (``query_stream(index, None)`` would say True); any
    other value hands the question to :meth:`Runtime.query_stream`. The caching allocator
    asks it for each block freed, from any thread, with or without the GIL and with its
    lock held: it must not block or call back into torchport."""

    copy_d2h: int
    copy_h2d: int
    context: int = 0
    keep: Any = None
    query_default_stream: int = 0
    copy_d2d: int = 0


class Runtime(abc.ABC):
    """Abstract device runtime. Subclass it and implement every abstract method.

    Class attributes a vendor sets:

    * ``host_addressable``: the CPU may read and write device addresses directly
      (unified memory). torchport then builds zero-copy host views for the CPU
      fallback; otherwise it stages every byte through :meth:`copy_d2h` /
      :meth:`copy_h2d`.
    * ``unsupported_dtypes``: dtypes the device cannot hold (e.g. Ascend has no
      float64). Creating a device tensor of such a dtype raises a clear error and
      autocast never picks it.
    * ``survives_fork``: a process forked after this one used the device can use it
      too. False (the default, as CUDA): such a child gets "Cannot re-initialize ... in
      forked subprocess" instead of a runtime state it does not own.
    """

    host_addressable: bool = False
    unsupported_dtypes: frozenset[torch.dtype] = frozenset()
    survives_fork: bool = False

    # ---- devices -------------------------------------------------------------
    @abc.abstractmethod
    def device_count(self) -> int:
        """Number of physical devices present (0 means the backend is unavailable)."""

    @abc.abstractmethod
    def get_device_properties(self, index: int) -> DeviceProperties:
        """Static properties of device ``index``: name, total memory, capability."""

    def synchronize(self, index: int) -> None:
        """Block the host until all work queued on every stream of ``index`` finished
        (default, a synchronous device: nothing is ever queued)."""
        return None

    # ---- memory --------------------------------------------------------------
    @abc.abstractmethod
    def malloc(self, index: int, nbytes: int) -> int | None:
        """Allocate ``nbytes`` (> 0) on device ``index``; return the address, or ``None``
        when the device is out of memory. Addresses must be aligned to 256 bytes."""

    @abc.abstractmethod
    def free(self, index: int, ptr: int) -> None:
        """Release an address returned by :meth:`malloc`. Pending work using it has
        finished (the caching allocator guarantees this)."""

    @abc.abstractmethod
    def mem_get_info(self, index: int) -> tuple[int, int]:
        """``(free_bytes, total_bytes)`` of device ``index``, as ``cudaMemGetInfo``."""

    def host_alloc(self, nbytes: int) -> int | None:
        """Optional: ``nbytes`` of page-locked host memory for pinned tensors
        (``Tensor.pin_memory()``, ``DataLoader(pin_memory=True)``), which copies between the
        host and the device may read or write while the host goes on; its address, or
        ``None`` for plain host memory (the default). Freed with :meth:`host_free`."""
        return None

    def host_free(self, ptr: int) -> None:
        """Release an address returned by :meth:`host_alloc` (no copy uses it any more)."""
        raise NotImplementedError(f"{type(self).__name__}.host_alloc gave memory; its "
                                  f"host_free must release it")

    def adopt_host(self, index: int, buffer: torch.UntypedStorage) -> int | None:
        """Optional (unified-memory devices): make ``buffer``, a CPU storage the caller
        gives up (keep a reference while the memory is in use), device memory without
        copying; return its device address (then freed with :meth:`free`), or ``None``:
        not supported, or no capacity left. torchport uses it for large results the host
        computed, instead of copying them."""
        return None

    # ---- memory shared with other processes (optional) --------------------------
    # CUDA's IPC: memory one process exports and another maps; torchport passes device
    # tensors to ``torch.multiprocessing`` children through these three methods and does
    # the rest (the storage reductions, keeping the memory alive until every receiver let
    # go: :mod:`torchport.device.sharing`). A runtime that keeps the defaults cannot share: its
    # tensors raise ``DeviceSharingError`` when sent (move them to the CPU first).
    def malloc_shareable(self, index: int, nbytes: int) -> int | None:
        """Optional: ``nbytes`` (> 0) of device memory that :meth:`ipc_export` can hand to
        another process, as :meth:`malloc` (``None`` when out of memory; freed with
        :meth:`free`). torchport moves a storage here the first time it is sent."""
        raise NotImplementedError(f"{type(self).__name__} cannot share device memory "
                                  f"between processes")

    def ipc_export(self, index: int, ptr: int) -> Any:
        """A handle to the allocation at ``ptr`` (an address :meth:`malloc_shareable` or
        :meth:`ipc_open` returned) for another process's :meth:`ipc_open`: picklable by
        ``multiprocessing``'s pickler (it may hold ``multiprocessing.reduction.DupFd``
        file descriptors), made for one send."""
        raise NotImplementedError(f"{type(self).__name__} cannot share device memory "
                                  f"between processes")

    def ipc_open(self, index: int, handle: Any, nbytes: int) -> int:
        """Map the ``nbytes`` allocation behind ``handle`` (another process's
        :meth:`ipc_export`) on device ``index`` of this process: its address here, the
        same memory (writes show in the other process once synchronised). Released with
        :meth:`free`; the memory itself lives until every process released it."""
        raise NotImplementedError(f"{type(self).__name__} cannot share device memory "
                                  f"between processes")

    # ---- events shared with other processes (optional) ------------------------------
    # CUDA's interprocess events (``torch.cuda.Event(interprocess=True)``, ``ipc_handle``,
    # ``Event.from_ipc_handle``): one process records, another waits. torchport also sends
    # one with each shared tensor on an asynchronous runtime, so the sender does not block
    # (the receiver's stream waits for the work queued before the send). A runtime that
    # keeps the defaults cannot: ``Event(interprocess=True)`` raises, and a send
    # synchronises the device instead.
    def create_ipc_event(self, index: int) -> EventHandle:
        """Optional: an event on device ``index`` (no timing) that :meth:`ipc_event_export`
        can hand to another process; recorded, waited for, queried, synchronised and
        destroyed through the event methods below, like any event of this runtime."""
        raise NotImplementedError(f"{type(self).__name__} cannot share events between "
                                  f"processes")

    def ipc_event_export(self, index: int, event: EventHandle) -> bytes:
        """A handle (bytes, as CUDA's) to an event :meth:`create_ipc_event` made, valid
        while that event lives, for another process's :meth:`ipc_event_open`."""
        raise NotImplementedError(f"{type(self).__name__} cannot share events between "
                                  f"processes")

    def ipc_event_open(self, index: int, handle: bytes) -> EventHandle:
        """The event behind ``handle`` in this process: waiting for it (or querying it)
        waits for the work the other process captured by its latest record; recording it
        here is seen there."""
        raise NotImplementedError(f"{type(self).__name__} cannot share events between "
                                  f"processes")

    # ---- copies --------------------------------------------------------------
    @abc.abstractmethod
    def copy_h2d(self, index: int, dst: int, src_host: int, nbytes: int,
                 stream: StreamHandle | None = None) -> None:
        """Copy ``nbytes`` from host address ``src_host`` to device address ``dst``.
        With ``stream=None`` the copy runs after the work queued on the default stream
        and is complete on return; with a stream it is appended to that stream's queue and
        the host buffer must stay alive until the queue reaches it."""

    @abc.abstractmethod
    def copy_d2h(self, index: int, dst_host: int, src: int, nbytes: int,
                 stream: StreamHandle | None = None) -> None:
        """Copy ``nbytes`` from device address ``src`` to host address ``dst_host``
        (same blocking rules as :meth:`copy_h2d`)."""

    @abc.abstractmethod
    def copy_d2d(self, dst_index: int, dst: int, src_index: int, src: int, nbytes: int,
                 stream: StreamHandle | None = None) -> None:
        """Copy ``nbytes`` between device addresses, possibly across devices
        (``stream`` belongs to ``dst_index``). Within one device (``dst_index ==
        src_index``) it also serves same-device copies of device-only memory
        (``b.copy_(a)`` of one dense span), ordered on the current stream."""

    @abc.abstractmethod
    def memset(self, index: int, ptr: int, value: int, nbytes: int,
               stream: StreamHandle | None = None) -> None:
        """Fill ``nbytes`` at ``ptr`` with the byte ``value`` (same stream rules as
        :meth:`copy_h2d`)."""

    # ---- streams -------------------------------------------------------------
    # The defaults below are those of a synchronous device (every call complete on
    # return): one queue per device that is always empty. An asynchronous runtime
    # overrides them all (see the module docstring; a subclass that sets
    # ``asynchronous = True`` and keeps them is refused at class creation).
    def create_stream(self, index: int, priority: int = 0) -> StreamHandle:
        """A new stream on device ``index``; lower ``priority`` runs first, as CUDA.
        Default: a handle naming the device's one queue."""
        return SyncStream(index, priority)

    def destroy_stream(self, index: int, stream: StreamHandle) -> None:
        """Release a stream created by :meth:`create_stream` after its work finished."""
        return None

    def synchronize_stream(self, index: int, stream: StreamHandle | None) -> None:
        """Block until all work queued on ``stream`` finished; re-raise its errors.
        Default: nothing is ever queued."""
        return None

    def query_stream(self, index: int, stream: StreamHandle | None) -> bool:
        """True when all work queued on ``stream`` has finished (default: always)."""
        return True

    # ---- events --------------------------------------------------------------
    def create_event(self, index: int, enable_timing: bool = False,
                     blocking: bool = False) -> EventHandle:
        """A new event on device ``index`` (default: a host timestamp holder)."""
        return SyncEvent(index, enable_timing)

    def destroy_event(self, index: int, event: EventHandle) -> None:
        """Release an event."""
        return None

    def record_event(self, index: int, event: EventHandle, stream: StreamHandle | None) -> None:
        """Capture the work queued so far on ``stream`` in ``event``. Default: the work is
        done already; the event takes the host's time now, for :meth:`event_elapsed_time`."""
        event.timestamp = time.perf_counter()

    def stream_wait_event(self, index: int, stream: StreamHandle | None,
                          event: EventHandle) -> None:
        """Make future work on ``stream`` wait until ``event`` completed (no host block).
        Default: nothing to wait for."""
        return None

    def synchronize_event(self, index: int, event: EventHandle) -> None:
        """Block the host until ``event`` completed (default: it has)."""
        return None

    def query_event(self, index: int, event: EventHandle) -> bool:
        """True when the work captured by ``event`` completed (or it was never recorded)."""
        return True

    def event_elapsed_time(self, index: int, start: EventHandle, end: EventHandle) -> float:
        """Milliseconds between two completed timing events (default: between the host
        times :meth:`record_event` took)."""
        for e in (start, end):
            if not getattr(e, "enable_timing", False):
                raise RuntimeError("Both events must be created with enable_timing=True "
                                   "to measure elapsed time")
            if getattr(e, "timestamp", None) is None:
                raise RuntimeError("Both events must be recorded before calculating "
                                   "elapsed time")
        return (end.timestamp - start.timestamp) * 1000.0

    # ---- optional ------------------------------------------------------------
    def native_copies(self) -> NativeCopies | None:
        """The blocking copies (:meth:`copy_d2h` and :meth:`copy_h2d` with ``stream=None``)
        as C functions, for a device whose memory the host does not address: torchport then
        calls them from C++ without the GIL when the CPU fallback moves a call's bytes
        (:class:`NativeCopies`). ``None`` (the default): the Python methods serve."""
        return None

    def host_address(self, ptr: int) -> int:
        """Host address of device address ``ptr``; only for host-addressable runtimes."""
        if not self.host_addressable:
            raise RuntimeError(f"{type(self).__name__}: device memory is not host-addressable")
        return ptr

    #: True when :meth:`launch` (and a copy given a stream) queues work on the stream
    #: and returns before it ran, as a real device's in-order queues do. torchport then
    #: launches kernels whose output layout the meta kernels give, orders streams with
    #: events, and synchronises the current stream before the host touches device memory
    #: (host views, blocking copies, the CPU fallback). False: every call is complete on
    #: return and the stream and event defaults above are exact.
    asynchronous: bool = False

    def launch(self, index: int, stream: StreamHandle | None, fn: Any, name: str = "") -> None:
        """Run ``fn()`` (a kernel's device-side work) in order on ``stream``.

        ``fn`` stands for what a real device does when the stream's queue reaches the
        work (a kernel launch, a DMA): it must only touch device memory and host buffers
        kept alive for it. A synchronous runtime keeps this default (run now); an
        asynchronous one appends ``fn`` to the stream's queue, runs it after the work
        queued before it, and reports its exception at the next synchronising call on
        that stream (:meth:`synchronize_stream`, :meth:`synchronize`,
        :meth:`synchronize_event`), as CUDA reports an asynchronous kernel error. ``name``
        labels the work in that error."""
        fn()

    #: What an asynchronous runtime must implement itself (the defaults are synchronous).
    ASYNC_REQUIRED = ("launch", "synchronize", "create_stream", "synchronize_stream",
                      "query_stream", "create_event", "record_event", "stream_wait_event",
                      "synchronize_event", "query_event", "event_elapsed_time")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("asynchronous") is True:
            missing = [m for m in Runtime.ASYNC_REQUIRED
                       if getattr(cls, m) is getattr(Runtime, m)]
            if missing:
                raise TypeError(f"{cls.__name__} sets asynchronous = True but keeps the "
                                f"synchronous defaults of {', '.join(missing)}; implement them "
                                f"over its stream queues (docs/vendor-guide.md)")


class SyncStream:
    """The default stream handle of a synchronous runtime (:meth:`Runtime.create_stream`)."""

    __slots__ = ("index", "priority")

    def __init__(self, index: int, priority: int = 0) -> None:
        self.index = index
        self.priority = priority

    def __repr__(self) -> str:
        return f"SyncStream(index={self.index}, priority={self.priority})"


class SyncEvent:
    """The default event handle of a synchronous runtime: the host time it was recorded."""

    __slots__ = ("enable_timing", "index", "timestamp")

    def __init__(self, index: int, enable_timing: bool = False) -> None:
        self.index = index
        self.enable_timing = enable_timing
        self.timestamp: float | None = None


def shares_memory(runtime: Runtime) -> bool:
    """Does ``runtime`` implement the IPC memory methods (device memory shared between
    processes)?"""
    return _overrides(runtime, ("malloc_shareable", "ipc_export", "ipc_open"))


def shares_events(runtime: Runtime) -> bool:
    """Does ``runtime`` implement the IPC event methods (events shared between processes)?"""
    return _overrides(runtime, ("create_ipc_event", "ipc_event_export", "ipc_event_open"))


def _overrides(runtime: Runtime, methods: tuple[str, ...]) -> bool:
    t = type(runtime)
    return all(getattr(t, m) is not getattr(Runtime, m) for m in methods)
