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
  the device's default stream. Operations "on a stream" execute in issue order
  relative to other work on that stream.
* A method that fails raises; :meth:`Runtime.malloc` alone reports exhaustion by
  returning ``None`` so the caching allocator can free cached blocks and retry.
"""

from __future__ import annotations

import abc
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

    def __repr__(self) -> str:
        mib = self.total_memory // (1024 * 1024)
        return (
            f"_DeviceProperties(name='{self.name}', major={self.major}, minor={self.minor}, "
            f"total_memory={mib}MB, multi_processor_count={self.multi_processor_count})"
        )


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

    @abc.abstractmethod
    def synchronize(self, index: int) -> None:
        """Block the host until all work queued on every stream of ``index`` finished."""

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

    # ---- copies --------------------------------------------------------------
    @abc.abstractmethod
    def copy_h2d(self, index: int, dst: int, src_host: int, nbytes: int,
                 stream: StreamHandle | None = None) -> None:
        """Copy ``nbytes`` from host address ``src_host`` to device address ``dst``.
        With ``stream=None`` the copy is complete on return; with a stream it is
        ordered on that stream and the host buffer must stay alive until then."""

    @abc.abstractmethod
    def copy_d2h(self, index: int, dst_host: int, src: int, nbytes: int,
                 stream: StreamHandle | None = None) -> None:
        """Copy ``nbytes`` from device address ``src`` to host address ``dst_host``
        (same blocking rules as :meth:`copy_h2d`)."""

    @abc.abstractmethod
    def copy_d2d(self, dst_index: int, dst: int, src_index: int, src: int, nbytes: int,
                 stream: StreamHandle | None = None) -> None:
        """Copy ``nbytes`` between device addresses, possibly across devices
        (``stream`` belongs to ``dst_index``)."""

    @abc.abstractmethod
    def memset(self, index: int, ptr: int, value: int, nbytes: int,
               stream: StreamHandle | None = None) -> None:
        """Fill ``nbytes`` at ``ptr`` with the byte ``value``."""

    # ---- streams -------------------------------------------------------------
    @abc.abstractmethod
    def create_stream(self, index: int, priority: int = 0) -> StreamHandle:
        """A new stream on device ``index``; lower ``priority`` runs first, as CUDA."""

    @abc.abstractmethod
    def destroy_stream(self, index: int, stream: StreamHandle) -> None:
        """Release a stream created by :meth:`create_stream` after its work finished."""

    @abc.abstractmethod
    def synchronize_stream(self, index: int, stream: StreamHandle | None) -> None:
        """Block until all work queued on ``stream`` finished; re-raise its errors."""

    @abc.abstractmethod
    def query_stream(self, index: int, stream: StreamHandle | None) -> bool:
        """True when all work queued on ``stream`` has finished."""

    # ---- events --------------------------------------------------------------
    @abc.abstractmethod
    def create_event(self, index: int, enable_timing: bool = False,
                     blocking: bool = False) -> EventHandle:
        """A new event on device ``index``."""

    @abc.abstractmethod
    def destroy_event(self, index: int, event: EventHandle) -> None:
        """Release an event."""

    @abc.abstractmethod
    def record_event(self, index: int, event: EventHandle, stream: StreamHandle | None) -> None:
        """Capture the work queued so far on ``stream`` in ``event``."""

    @abc.abstractmethod
    def stream_wait_event(self, index: int, stream: StreamHandle | None,
                          event: EventHandle) -> None:
        """Make future work on ``stream`` wait until ``event`` completed (no host block)."""

    @abc.abstractmethod
    def synchronize_event(self, index: int, event: EventHandle) -> None:
        """Block the host until ``event`` completed."""

    @abc.abstractmethod
    def query_event(self, index: int, event: EventHandle) -> bool:
        """True when the work captured by ``event`` completed (or it was never recorded)."""

    @abc.abstractmethod
    def event_elapsed_time(self, index: int, start: EventHandle, end: EventHandle) -> float:
        """Milliseconds between two completed timing events."""

    # ---- optional ------------------------------------------------------------
    def host_address(self, ptr: int) -> int:
        """Host address of device address ``ptr``; only for host-addressable runtimes."""
        if not self.host_addressable:
            raise RuntimeError(f"{type(self).__name__}: device memory is not host-addressable")
        return ptr

    #: True when :meth:`launch` queues work and returns before it ran. torchport then
    #: launches kernels whose output layout the meta kernels give, and synchronises the
    #: device before the host touches its memory (host views, the CPU fallback).
    asynchronous: bool = False

    def launch(self, index: int, stream: StreamHandle | None, fn: Any, name: str = "") -> None:
        """Run ``fn()`` (a kernel's device-side work) in order on ``stream``.

        Runtimes that execute synchronously keep this default; asynchronous ones
        queue ``fn`` and report its exceptions at the next synchronising call."""
        fn()
