"""Device tensors passed to other processes: one clear error instead of ``_share_fd_``.

``torch.multiprocessing`` (and ``multiprocessing`` once torch is imported) pickles a
tensor by *sharing* its memory: CUDA memory through CUDA IPC, CPU memory through shared
files. Device memory has neither (a child process runs its own device runtime, and
device-only memory has no host address), and copying instead would silently break
the sharing CUDA code relies on, so pickling device storage for another process raises
:class:`DeviceSharingError`, which says to move the tensor to the CPU first. The hook
sits on the storage reducer, which every tensor, typed storage, sparse and nested
tensor reaches; every other storage is reduced by PyTorch's own reducer, unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["DeviceSharingError", "install", "on_register"]


class DeviceSharingError(RuntimeError):
    """A device tensor or storage cannot be shared with another process."""


def _device_type() -> str:
    return torch._C._get_privateuse1_backend_name()


def _guard(reduce: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def reduce_storage(storage: Any) -> Any:
        device = storage.device
        if device.type == _device_type():
            raise DeviceSharingError(
                f"cannot pass a {device} tensor to another process: multiprocessing shares "
                f"tensor memory between processes, which {device.type!r} memory does not "
                f"support; move it to the CPU with .cpu() before passing it (and back with "
                f".to({device.type!r}) in the other process)")
        return reduce(storage)

    reduce_storage.__torchport_original__ = reduce  # type: ignore[attr-defined]
    return reduce_storage


def install() -> None:
    """Guard the storage reducer PyTorch registers for multiprocessing; idempotent."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing.reductions  # noqa: F401  (registers PyTorch's reducers)

    reduce = ForkingPickler._extra_reducers.get(torch.UntypedStorage)
    if reduce is None or hasattr(reduce, "__torchport_original__"):
        return
    ForkingPickler.register(torch.UntypedStorage, _guard(reduce))


def on_register(backend: Any, module: Any) -> None:
    """Guard the reducer as a backend registers (:mod:`torchport.features`); one guard
    serves every backend, it asks PyTorch for the device type."""
    install()
