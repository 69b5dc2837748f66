"""What a vendor implements for a device type's collectives (:class:`Collectives`), and the
names and reduce-op types they share."""

from __future__ import annotations

import abc
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torchport.core.contracts import DeviceBackend


Tensor = torch.Tensor
RedOp = dist.ReduceOp.RedOpType


GLOO_OPS = {RedOp.SUM, RedOp.PRODUCT, RedOp.MIN, RedOp.MAX, RedOp.BAND, RedOp.BOR, RedOp.BXOR}

def backend_name(device: str) -> str:
    """The c10d backend name of a device type: ``<device>ccl`` (``simccl``)."""
    return f"{device}ccl"


def op_type(op: Any) -> Any:
    """``ReduceOp`` / ``RedOpType`` -> ``RedOpType``."""
    return getattr(op, "op", op) if not isinstance(op, RedOp) else op


# ---- the vendor interface -------------------------------------------------------------
class Collectives(abc.ABC):
    """Collective communication on one device type for one group of ranks.

    A vendor subclasses this (backed by its own library, like HCCL or CNCL) and
    installs it with :func:`set_collectives`. Every method is asynchronous: it
    returns a :class:`torch.distributed.Work` whose future yields the output
    tensors. Tensors are device tensors of this process's device; ``op`` is a
    ``torch.distributed.ReduceOp``; ranks are group ranks.
    """

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta,
                 backend: DeviceBackend) -> None:
        self.store = store
        self.rank = rank
        self.size = size
        self.timeout = timeout
        self.backend = backend

    @abc.abstractmethod
    def all_reduce(self, tensor: Tensor, op: Any) -> dist.Work:
        """Reduce ``tensor`` over all ranks in place (SUM, AVG, MIN, MAX, PRODUCT, ...)."""

    @abc.abstractmethod
    def broadcast(self, tensor: Tensor, src: int) -> dist.Work:
        """Copy rank ``src``'s ``tensor`` into every rank's ``tensor``."""

    @abc.abstractmethod
    def all_gather(self, outputs: list[Tensor], tensor: Tensor) -> dist.Work:
        """``outputs[r]`` receives rank ``r``'s ``tensor``."""

    @abc.abstractmethod
    def all_gather_into_tensor(self, output: Tensor, tensor: Tensor) -> dist.Work:
        """``output`` (``size`` times larger along dim 0) receives all ranks' ``tensor``."""

    @abc.abstractmethod
    def reduce_scatter(self, output: Tensor, inputs: list[Tensor], op: Any) -> dist.Work:
        """``output`` receives the reduction over ranks of their ``inputs[rank]``."""

    @abc.abstractmethod
    def reduce_scatter_tensor(self, output: Tensor, tensor: Tensor, op: Any) -> dist.Work:
        """``output`` receives this rank's chunk of the reduction of ``tensor``."""

    @abc.abstractmethod
    def all_to_all(self, outputs: list[Tensor], inputs: list[Tensor]) -> dist.Work:
        """``outputs[r]`` receives rank ``r``'s ``inputs[rank]`` (sizes may differ)."""

    @abc.abstractmethod
    def all_to_all_single(self, output: Tensor, tensor: Tensor,
                          output_splits: list[int] | None,
                          input_splits: list[int] | None) -> dist.Work:
        """All-to-all over dim 0 of one tensor; ``None`` splits mean equal chunks."""

    @abc.abstractmethod
    def reduce(self, tensor: Tensor, dst: int, op: Any) -> dist.Work:
        """Reduce into rank ``dst``'s ``tensor``."""

    @abc.abstractmethod
    def gather(self, outputs: list[Tensor], tensor: Tensor, dst: int) -> dist.Work:
        """On ``dst``, ``outputs[r]`` receives rank ``r``'s ``tensor`` (others pass ``[]``)."""

    @abc.abstractmethod
    def scatter(self, output: Tensor, inputs: list[Tensor], src: int) -> dist.Work:
        """``output`` receives ``src``'s ``inputs[rank]`` (non-src ranks pass ``[]``)."""

    @abc.abstractmethod
    def send(self, tensor: Tensor, dst: int, tag: int) -> dist.Work:
        """Send ``tensor`` to rank ``dst``."""

    @abc.abstractmethod
    def recv(self, tensor: Tensor, src: int, tag: int) -> dist.Work:
        """Receive into ``tensor`` from rank ``src``."""

    @abc.abstractmethod
    def barrier(self) -> dist.Work:
        """Complete once every rank reached the barrier."""

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release communicators (optional)."""


CollectivesFactory = Callable[[dist.Store, int, int, timedelta, "DeviceBackend"], Collectives]
