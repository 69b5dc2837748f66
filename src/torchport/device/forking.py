"""A process forked after its parent used the device gets CUDA's error, not stale memory.

A runtime whose state does not survive ``fork()`` (driver contexts, worker threads,
memory mappings: :attr:`~torchport.runtime.Runtime.survives_fork` is False, as for CUDA)
cannot serve a child forked after the parent took device memory or initialised the
device. In such a child, ``torch.<device>.init()`` and every allocation, copy and
synchronisation raise :class:`ForkedDeviceError`; a child forked before first use, or from
a runtime that survives fork, uses the device normally.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from torchport.core import native

if TYPE_CHECKING:
    from torchport.core.contracts import DeviceBackend


class ForkedDeviceError(RuntimeError):
    """The device was initialised in the parent of this forked process."""


def error(backend: DeviceBackend) -> ForkedDeviceError:
    n = backend.name
    return ForkedDeviceError(
        f"Cannot re-initialize {n} in forked subprocess. To use {n} with multiprocessing, "
        f"you must use the 'spawn' start method")


def used(backend: DeviceBackend) -> bool:
    """Has this process initialised the device or taken device memory from the runtime?"""
    return backend.initialized or any(a.reserved() for a in backend.allocators)


def _refuse(backend: DeviceBackend) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise error(backend)
    return refuse


def after_fork_in_child(backend: DeviceBackend) -> None:
    """Mark the child and cut its paths to the runtime when the parent's device state
    cannot be inherited."""
    if getattr(backend.runtime, "survives_fork", False) or not used(backend):
        return
    backend.bad_fork = True
    refuse = _refuse(backend)
    for a in backend.allocators:
        a.malloc = refuse  # every new tensor, every op's output
        a.adopt = refuse
        a.adopt_segment = refuse  # (memory another process shared: torchport.device.sharing)
        a.new_tensor = refuse
    cpp = native.loaded()
    if cpp is not None and hasattr(cpp, "torchport_caching_detach"):
        cpp.torchport_caching_detach()  # C++'s own allocations ask Python (refused) again
    for name in ("to_host", "write_tensor", "synchronize", "host_sync", "to_device"):
        setattr(backend, name, refuse)


def install(backend: DeviceBackend) -> None:
    os.register_at_fork(after_in_child=lambda: after_fork_in_child(backend))
