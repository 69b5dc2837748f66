"""Device tensors passed to other processes: the memory is shared, as CUDA's IPC shares it.

``torch.multiprocessing`` (and ``multiprocessing`` once torch is imported) pickles a
tensor by *sharing* its memory: CUDA memory through CUDA IPC handles, CPU memory through
shared files. Every tensor, typed storage, sparse and nested tensor reaches the storage
reducer; for a device storage torchport's reducer takes CUDA's path over the runtime's
three IPC methods (:meth:`~torchport.runtime.Runtime.malloc_shareable`, ``ipc_export``,
``ipc_open``):

* the sender moves the storage, in place, into shareable device memory the first time it
  is sent (every tensor on it follows; ``share_memory_()`` stays a no-op, as on CUDA),
  synchronises the device and sends (device index, handle, bytes) with a reference slot;
* the receiver maps the handle as device memory of its own and rebuilds a storage over it
  (one storage per sent storage and process, as CUDA's cache of opened handles): writes
  in one process show in the other once it synchronised;
* memory is freed when the last process lets go: like CUDA's ``CudaIPCSentData`` and its
  reference-counter file, the sender keeps the storage (its allocator counts the block)
  while a slot it set in a small shared file of its own is not yet cleared by the
  receiver, which clears it when its storage dies (or it exits). The sender looks at its
  slots at each send and at ``torch.<device>.ipc_collect()``.

A runtime without the IPC methods (OpenCL) makes the reducer raise
:class:`DeviceSharingError`, which names the backend and says to move the tensor to the
CPU first. Interprocess events (``torch.<device>.Event(interprocess=True)``) are the
stream layer's, over the runtime's IPC event methods. Every other storage is reduced by PyTorch's own reducer, unchanged.
"""

from __future__ import annotations

import atexit
import importlib
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from torchport.memory import allocator as _allocator
from torchport.memory import tensors
from torchport.runtime import shares_memory

if TYPE_CHECKING:
    from torchport.core.contracts import DeviceBackend

__all__ = ["DeviceSharingError", "install", "ipc_collect", "on_register", "shares_memory"]


class DeviceSharingError(RuntimeError):
    """A device tensor or storage cannot be shared with another process."""


_BACKEND: list[DeviceBackend] = []  # the registered backend (one PrivateUse1 a process)
_LOCK = threading.RLock()


def _device_type() -> str:
    return torch._C._get_privateuse1_backend_name()


# ---- reference slots -------------------------------------------------------------------
_SLOTS_PER_FILE = 4096


class _SlotFile:
    """Bytes in a shared-memory file: 1 while a receiver holds what was sent with it."""

    def __init__(self, key: int, storage: torch.UntypedStorage) -> None:
        self.key = key
        self.storage = storage
        self.bytes = torch.empty(0, dtype=torch.uint8).set_(storage)
        self.free = list(range(storage.nbytes() - 1, -1, -1))

    def __reduce__(self) -> Any:
        """Sent once per message however many tensors it holds (the pickler's memo: a
        descriptor passed twice to a spawned child is refused)."""
        from multiprocessing.reduction import DupFd

        fd, size = self.storage._share_fd_cpu_()
        return (_peer_slots, (os.getpid(), self.key, DupFd(fd), size))


@dataclass
class _Sent:
    storage: torch.UntypedStorage  # kept (with its device memory) until the slot clears
    slots: _SlotFile
    slot: int


@dataclass
class _Shared:
    """A segment of shareable (or opened) device memory in this process."""

    nbytes: int
    opened: bool
    slots: list[tuple[_SlotFile, int]] = field(default_factory=list)  # to clear when freed


_OWN_SLOTS: list[_SlotFile] = []
_SENT: list[_Sent] = []
_SHARED: dict[int, _Shared] = {}  # segment address -> what it is
_PEER_SLOTS: dict[tuple[int, int], _SlotFile] = {}  # (sender pid, file) -> its slots
_OPENED: dict[tuple[int, int, int], Any] = {}  # (sender pid, device, address) -> weak ref
_EXIT_HOOKED: list[int] = []  # the process that hooked its exit


def _take_slot() -> tuple[_SlotFile, int]:
    for f in _OWN_SLOTS:
        if f.free:
            slot = f.free.pop()
            f.bytes[slot] = 1
            return f, slot
    f = _SlotFile(len(_OWN_SLOTS), torch.UntypedStorage._new_using_fd_cpu(_SLOTS_PER_FILE))
    _OWN_SLOTS.append(f)
    return _take_slot()


def ipc_collect() -> int:
    """Let go of the device memory sent to processes that released it (CUDA's
    ``torch.cuda.ipc_collect``); the number of sends still held by a receiver."""
    with _LOCK:
        keep = []
        for s in _SENT:
            if int(s.slots.bytes[s.slot]) == 0:
                s.slots.free.append(s.slot)
            else:
                keep.append(s)
        _SENT[:] = keep
        return len(keep)


def _segment_freed(ptr: int, nbytes: int) -> None:
    """An allocator returned a segment to the runtime: an opened one clears its slots."""
    shared = _SHARED.pop(ptr, None)
    if shared is not None:
        for f, slot in shared.slots:
            f.bytes[slot] = 0


def _release_all_at_exit() -> None:
    """This process leaves: what it opened goes with it (its allocator frees nothing
    from the exit on), so its senders may let go; what it sent and receivers still hold
    stays mapped in them, its blocks are not returned in a finalizing interpreter."""
    for shared in list(_SHARED.values()):
        for f, slot in shared.slots:
            f.bytes[slot] = 0
    ipc_collect()  # (now, while the allocator still frees)
    for s in _SENT:
        tensors._block_of(s.storage)


def _hook_exit() -> None:
    """Run :func:`_release_all_at_exit` as this process ends: at exit (before the allocator
    stops freeing), and in multiprocessing's own exit of a child it started (a forked or
    fork-server child leaves with ``os._exit``, past ``atexit``)."""
    if _EXIT_HOOKED != [os.getpid()]:  # (a forked child has lost its parent's finalizers)
        from multiprocessing import util

        _EXIT_HOOKED[:] = [os.getpid()]
        atexit.register(_release_all_at_exit)
        util.Finalize(None, _release_all_at_exit, exitpriority=100)


# ---- sending -----------------------------------------------------------------------
def _segment_storage(backend: DeviceBackend, index: int, ptr: int,
                     nbytes: int) -> torch.UntypedStorage:
    """A device storage over a segment the runtime made outside the caching pools, an
    allocated block of ``index``'s allocator (returned to the runtime when it dies)."""
    alloc = backend.allocator(index)
    block = alloc.adopt_segment(ptr, nbytes)
    t = tensors.wrap_block(backend.devices[index], alloc, block, nbytes, torch.uint8,
                           [nbytes], [1])
    return t.untyped_storage()


def _make_shareable(backend: DeviceBackend, storage: torch.UntypedStorage) -> int:
    """Move ``storage`` (in place: every tensor on it follows) into shareable device
    memory, unless it is there; its address."""
    ptr, n = storage.data_ptr(), storage.nbytes()
    shared = _SHARED.get(ptr)
    if shared is not None and shared.nbytes == n:
        return ptr
    index = storage.device.index
    phys = backend.phys(index)
    rt = backend.runtime
    alloc = backend.allocator(index)
    new = rt.malloc_shareable(phys, n) if alloc._within_fraction(n) else None
    if new is None:
        ipc_collect()
        alloc.empty_cache()
        new = rt.malloc_shareable(phys, n) if alloc._within_fraction(n) else None
    if new is None:
        raise torch.OutOfMemoryError(
            f"{storage.device}: no device memory left for {n} bytes of shareable memory to "
            f"send a tensor to another process; free tensors or call "
            f"torch.{backend.name}.ipc_collect()")
    _SHARED[new] = _Shared(n, opened=False)
    fresh = _segment_storage(backend, index, new, n)
    rt.copy_d2d(phys, new, phys, ptr, n)
    tensors.swap_storage_blocks(storage, fresh)
    del fresh  # the old block goes back to the allocator
    return new


def _refusal(device: torch.device, backend: DeviceBackend | None) -> DeviceSharingError:
    runtime = "" if backend is None else f" (runtime {type(backend.runtime).__name__})"
    return DeviceSharingError(
        f"cannot pass a {device} tensor to another process: multiprocessing shares tensor "
        f"memory between processes, which the {device.type!r} backend{runtime} does not "
        f"support; move it to the CPU with .cpu() before passing it (and back with "
        f".to({device.type!r}) in the other process)")


def _reduce_device(storage: torch.UntypedStorage) -> Any:
    device = storage.device
    backend = _BACKEND[0] if _BACKEND else None
    if backend is None or backend.name != device.type or not shares_memory(backend.runtime):
        raise _refusal(device, backend)
    n = storage.nbytes()
    if n == 0:
        return (_rebuild_empty, (device.type, device.index))
    index = device.index
    backend.synchronize(index)  # the receiver sees the work queued so far
    with _LOCK:
        _hook_exit()
        ptr = _make_shareable(backend, storage)
        handle = backend.runtime.ipc_export(backend.phys(index), ptr)
        ipc_collect()
        slots, slot = _take_slot()
        _SENT.append(_Sent(storage, slots, slot))
    return (_rebuild_device, (device.type, index, handle, n, os.getpid(), ptr, slots, slot))


# ---- receiving ---------------------------------------------------------------------
def _backend_for(device_type: str) -> DeviceBackend:
    """The backend of ``device_type`` in this process, registered now if needed (a
    spawned child that has not imported it)."""
    if not _BACKEND:
        try:
            importlib.import_module(f"torchport.{device_type}")
        except ImportError:
            pass
    if not _BACKEND or _BACKEND[0].name != device_type:
        raise DeviceSharingError(
            f"received a {device_type} tensor from another process, but no {device_type!r} "
            f"backend is registered in this one; import the module that registers it "
            f"before receiving")
    return _BACKEND[0]


def _peer_slots(pid: int, key: int, df: Any, size: int) -> _SlotFile:
    """The slots of process ``pid``'s file ``key``, mapped here once."""
    fd = df.detach()  # (always: the sender's descriptor waits for it)
    try:
        f = _PEER_SLOTS.get((pid, key))
        if f is None:
            storage = torch.UntypedStorage._new_shared_fd_cpu(fd, size)
            f = _PEER_SLOTS[(pid, key)] = _SlotFile(key, storage)
            f.free = []
        return f
    finally:
        os.close(fd)


def _rebuild_empty(device_type: str, index: int) -> torch.UntypedStorage:
    _backend_for(device_type)
    return torch.UntypedStorage(0, device=torch.device(device_type, index))


def _rebuild_device(device_type: str, index: int, handle: Any, nbytes: int, pid: int,
                    ptr: int, slots: _SlotFile, slot: int) -> torch.UntypedStorage:
    """The receiver's storage over the memory a sender shared (:func:`_reduce_device`)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    backend = _backend_for(device_type)
    if backend.bad_fork:  # (a child forked after its parent used the device)
        from torchport.device import forking

        raise forking.error(backend)
    phys = backend.phys(index)
    rt = backend.runtime
    with _LOCK:
        _hook_exit()
        local = rt.ipc_open(phys, handle, nbytes)
        key = (pid, index, ptr)
        ref = _OPENED.get(key)
        if ref is not None and not ref.expired():
            storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
            rt.free(phys, local)  # opened already: one storage, as CUDA's handle cache
            local = storage.data_ptr()
        else:
            _SHARED[local] = _Shared(nbytes, opened=True)
            storage = _segment_storage(backend, index, local, nbytes)
            _OPENED[key] = StorageWeakRef(storage)
        _SHARED[local].slots.append((slots, slot))
        if len(_OPENED) > 1024:
            for k in [k for k, r in _OPENED.items() if r.expired()]:
                del _OPENED[k]
    return storage


# ---- installation --------------------------------------------------------------------
def _device_reducer(reduce: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def reduce_storage(storage: Any) -> Any:
        if storage.device.type == _device_type():
            return _reduce_device(storage)
        return reduce(storage)

    reduce_storage.__torchport_original__ = reduce  # type: ignore[attr-defined]
    return reduce_storage


def install() -> None:
    """Route device storages through :func:`_reduce_device` in multiprocessing's pickler
    (PyTorch's reducer keeps every other storage); idempotent."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing.reductions  # noqa: F401  (registers PyTorch's reducers)

    reduce = ForkingPickler._extra_reducers.get(torch.UntypedStorage)
    if reduce is None or hasattr(reduce, "__torchport_original__"):
        return
    ForkingPickler.register(torch.UntypedStorage, _device_reducer(reduce))


def on_register(backend: DeviceBackend, module: Any) -> None:
    """Install the reducer as ``backend`` registers (:mod:`torchport.features`) and add
    ``torch.<device>.ipc_collect``."""
    from torchport.device import device_module

    _BACKEND[:] = [backend]
    if _segment_freed not in _allocator.SEGMENT_FREED:
        _allocator.SEGMENT_FREED.append(_segment_freed)
    def collect() -> None:
        """Free the device memory sent to processes that released it (``torch.cuda.ipc_collect``)."""
        ipc_collect()

    device_module.add(module, ipc_collect=collect)
    install()
