"""Distributed training on a torchport device: collectives and the ``<device>ccl`` c10d backend.

PyTorch's collectives reach a device through a c10d backend (NCCL for CUDA, HCCL
for Ascend). This module gives every torchport device one, named ``<device>ccl``
(``simccl`` for sim), registered with :class:`torch.distributed.Backend` when the
backend registers, so ``init_process_group()`` picks it for device tensors.

Two layers:

* :class:`Collectives` -- what a vendor implements (the role of DIPU's diclapis /
  HCCL): all_reduce, broadcast, all_gather, reduce_scatter, all_to_all, reduce,
  gather, scatter, send/recv, barrier, each returning an asynchronous
  :class:`torch.distributed.Work`.
* :class:`HostStagedCollectives` -- the default, used by sim: device tensors go
  through host memory over Gloo. When the runtime's memory is host-addressable
  Gloo works directly on zero-copy host views; otherwise values are copied to
  host, reduced by Gloo and written back through the runtime.

:class:`DeviceProcessGroup` adapts a :class:`Collectives` to c10d. CPU tensors in
the same group go to an internal Gloo backend, so ``backend="sim:simccl,cpu:gloo"``
(or no backend at all) serves both. PyTorch 2.13 cannot subclass the C++
``c10d::Backend`` from Python (it has no Python constructor), so the backend is a
Python ``ProcessGroup`` subclass, as ``torch.testing``'s threaded group is.

On top of it run DDP (bucketing, ``no_sync``), SyncBatchNorm (its CUDA-only kernels
come from the backend, see ``backends/sim/syncbn_kernels.py``), FSDP2
(``fully_shard``; needs the in-place storage resize installed here) and
``torch.distributed.checkpoint``. DDP's ``find_unused_parameters`` / ``static_graph``
need pinned host memory (the C++ Reducer stages its used-parameter map there): they work
where torchport's C++ hooks give it (:mod:`torchport.memory.pinned`), and raise without them.

The package, bottom up: ``work`` (the ``Work`` a collective returns, its future and
callbacks, :class:`CollectiveError`), ``collectives`` (the vendor interface),
``host_staged`` (the default), ``liveness`` (heartbeats naming a dead rank),
``process_group`` (the c10d group, what it keeps until exit) and this module, which
registers ``<device>ccl``; ``parallel_comm`` gives ``nn.DataParallel`` the device's
broadcast/scatter/gather. It imports torchport's contracts, settings, compat and device
module, nothing above them.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from torchport.core import settings
from torchport.core.contracts import BackendError
from torchport.device import device_module
from torchport.distributed.collectives import Collectives, backend_name
from torchport.distributed.host_staged import HostStagedCollectives
from torchport.distributed.process_group import DeviceProcessGroup, set_collectives
from torchport.distributed.work import CollectiveError

if TYPE_CHECKING:
    from torchport.core.contracts import DeviceBackend


__all__ = [
    "Collectives", "CollectiveError", "DeviceProcessGroup", "HostStagedCollectives",
    "backend_name", "init_device_from_env", "register_backend",
    "set_collectives",
]


# ---- registration ---------------------------------------------------------------------
def register_backend(backend: DeviceBackend) -> str:
    """Register ``<device>ccl`` with c10d and make it the default for the device; idempotent."""
    name = backend_name(backend.name)

    def create(store: dist.Store, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroup:
        return DeviceProcessGroup(store, rank, size, timeout, backend)

    if name.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(name, create, devices=[backend.name])
    return name


_BACKEND: DeviceBackend | None = None  # the backend whose device module has these names


def on_register(backend: DeviceBackend, module: Any) -> None:
    """Register the c10d backend and add ``torch.<device>.init_device_from_env`` as
    ``backend`` registers (:mod:`torchport.features`)."""
    global _BACKEND
    register_backend(backend)
    _BACKEND = backend
    device_module.add(module, init_device_from_env=init_device_from_env)


def init_device_from_env() -> torch.device:
    """Select this rank's device: ``LOCAL_RANK % device_count()`` (torchrun sets LOCAL_RANK).

    Device indices are those left visible by ``TORCHPORT_VISIBLE_DEVICES``, so a
    launcher can hand each node (or each process) a subset, as with CUDA.
    """
    b = _BACKEND
    if b is None or not b.registered:
        raise BackendError("no torchport backend is registered; import torchport.sim "
                           "(or your vendor backend) first")
    count = b.device_count()
    if count == 0:
        raise CollectiveError(f"no {b.name} device is visible (TORCHPORT_VISIBLE_DEVICES="
                              f"{settings.raw('TORCHPORT_VISIBLE_DEVICES', 'unset')})")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    b.set_device(local % count)
    return torch.device(b.name, local % count)
