"""Heartbeats in the store, so that a failed collective names the ranks that stopped
responding."""

from __future__ import annotations

import threading
import time
import weakref
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    pass


Tensor = torch.Tensor
RedOp = dist.ReduceOp.RedOpType


# ---- liveness: name the dead rank -----------------------------------------------------
class Liveness:
    """Heartbeat counters in the store, so a failed collective can name dead ranks."""

    PERIOD = 0.5

    def __init__(self, store: dist.Store, rank: int, size: int) -> None:
        self.store = store
        self.rank = rank
        self.size = size
        self.stop = threading.Event()
        self._diagnosing = threading.Lock()
        self._dead: str | None = None
        self.thread = threading.Thread(target=self._beat, name=f"torchport-hb-{rank}",
                                       daemon=True)
        self.thread.start()
        LIVENESS.add(self)

    def _beat(self) -> None:
        while not self.stop.wait(self.PERIOD):
            try:
                self.store.add(f"hb/{self.rank}", 1)
            except Exception:
                return

    def _counts(self) -> list[int]:
        return [int(self.store.add(f"hb/{r}", 0)) for r in range(self.size)]

    def diagnose(self) -> str:
        """Which peers stopped beating (takes a few heartbeat periods). A rank found dead
        stays dead: the collectives that fail after it reuse that finding, one at a time, so
        that a queue of failed collectives does not spend a diagnosis each."""
        with self._diagnosing:
            if self._dead is not None:
                return self._dead
            try:
                before = self._counts()
                time.sleep(self.PERIOD * 5)
                after = self._counts()
            except Exception as e:
                self._dead = (f"the rendezvous store is unreachable ({type(e).__name__}: {e}); "
                              f"the process hosting it (rank 0 or the torchrun agent) has "
                              f"probably died")
                return self._dead
            dead = [r for r in range(self.size) if r != self.rank and after[r] == before[r]]
            if dead:
                self._dead = (f"rank(s) {', '.join(map(str, dead))} stopped responding "
                              f"(process died?)")
                return self._dead
            return "all ranks are alive: a timeout or mismatched collectives across ranks"

    def close(self) -> None:
        self.stop.set()


LIVENESS: weakref.WeakSet[Liveness] = weakref.WeakSet()
