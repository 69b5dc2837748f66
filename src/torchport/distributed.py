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
where torchport's C++ hooks give it (:mod:`torchport.pinned`), and raise without them.
"""

from __future__ import annotations

import abc
import atexit
import gc
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist

from torchport import device_module, settings
from torchport.contracts import BackendError

if TYPE_CHECKING:
    from torchport.contracts import DeviceBackend

__all__ = [
    "Collectives", "CollectiveError", "DeviceProcessGroup", "HostStagedCollectives",
    "backend_name", "init_device_from_env", "register_backend",
    "set_collectives",
]

Tensor = torch.Tensor
RedOp = dist.ReduceOp.RedOpType
_GLOO_OPS = {RedOp.SUM, RedOp.PRODUCT, RedOp.MIN, RedOp.MAX, RedOp.BAND, RedOp.BOR, RedOp.BXOR}


class CollectiveError(RuntimeError):
    """A collective failed: a timeout, a dead peer, or arguments the backend cannot serve."""


def backend_name(device: str) -> str:
    """The c10d backend name of a device type: ``<device>ccl`` (``simccl``)."""
    return f"{device}ccl"


def _op_type(op: Any) -> Any:
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


_WAITER: Any = None


_CALLBACK_PREFIX = "Got the following error when running the callback: "


def _unwrap(msg: str) -> str:
    """Drop the prefixes torch futures put on an error raised in a callback."""
    while msg.startswith(_CALLBACK_PREFIX):
        msg = msg[len(_CALLBACK_PREFIX):]
    if msg.startswith("CollectiveError: "):
        msg = msg[len("CollectiveError: "):]
    return msg.split("\n\nAt:\n")[0]


class DeviceWork(dist.Work):
    """An asynchronous collective: ``wait()`` re-raises its error (PyTorch's
    future-wrapping Work swallows it) and honours a timeout instead of hanging."""

    def __init__(self, fut: torch.futures.Future, what: str = "collective") -> None:
        super().__init__()
        self.fut = fut
        self.what = what

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        if timeout is not None:
            secs = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
            if secs > 0:
                deadline = time.monotonic() + secs
                while not self.fut.done():
                    if time.monotonic() > deadline:
                        raise CollectiveError(f"{self.what} did not complete within {secs:g} s")
                    time.sleep(0.001)
        try:
            self.fut.wait()
        except CollectiveError:
            raise
        except RuntimeError as e:
            raise CollectiveError(_unwrap(str(e))) from None
        return True

    def is_completed(self) -> bool:
        return self.fut.done()

    def is_success(self) -> bool:
        if not self.fut.done():
            return False
        try:
            self.fut.value()
        except Exception:
            return False
        return True

    def exception(self) -> BaseException | None:
        try:
            self.fut.value()
        except Exception as e:
            return e
        return None

    def get_future(self) -> torch.futures.Future:
        return self.fut

    def result(self) -> list[Tensor]:
        return self.fut.wait()

    def synchronize(self) -> None:
        self.wait()


def future_of(work: Any) -> torch.futures.Future:
    """``work.get_future()``, or a future completed by a waiter thread for Work types
    that have none (Gloo's reduce_scatter_tensor in 2.13)."""
    global _WAITER
    try:
        return work.get_future()
    except RuntimeError:
        pass
    if _WAITER is None:
        from concurrent.futures import ThreadPoolExecutor

        _WAITER = ThreadPoolExecutor(1, thread_name_prefix="torchport-work")
    fut: torch.futures.Future = torch.futures.Future()

    def wait() -> None:
        try:
            work.wait()
            fut.set_result([])
        except Exception as e:
            fut.set_exception(e)

    _WAITER.submit(wait)
    return fut


# Callbacks still held by C++ futures. After running a callback, the communication thread
# (Gloo's worker, a C++ thread) drops it in ``~PythonFunctionGuard``, which takes the GIL
# inside a destructor (torch/csrc/jit/python/pybind_utils.h). If the interpreter is already
# finalizing, taking the GIL ends the thread with pthread_exit, whose forced unwind through
# that noexcept destructor calls std::terminate: "terminate called without an active
# exception" after an otherwise successful run. Counting live callbacks lets the exit
# handler wait (GIL released) until those threads are done with Python.
_CALLBACKS = [0]
_CALLBACKS_LOCK = threading.Lock()


def _callback_released() -> None:
    with _CALLBACKS_LOCK:
        _CALLBACKS[0] -= 1


def _then(fut: torch.futures.Future, fn: Callable[[torch.futures.Future], Any]
          ) -> torch.futures.Future:
    """``fut.then(fn)``, counted until the C++ side releases ``fn`` (see above)."""
    with _CALLBACKS_LOCK:
        _CALLBACKS[0] += 1
    weakref.finalize(fn, _callback_released).atexit = False
    return fut.then(fn)


def _drain_callbacks(timeout: float) -> None:
    """Wait, without holding the GIL, until communication threads dropped every callback."""
    deadline = time.monotonic() + timeout
    while _CALLBACKS[0] > 0 and time.monotonic() < deadline:
        time.sleep(0.002)


# ---- the default: host staging over Gloo ---------------------------------------------
class _Staging:
    """Host tensors for device tensors of one collective, and what to write back."""

    def __init__(self, backend: DeviceBackend) -> None:
        self.backend = backend
        self.zero_copy = backend.runtime.host_addressable
        self.writeback: list[tuple[Tensor, Tensor]] = []
        self._synced: set[int] = set()

    def _sync(self, t: Tensor) -> None:
        i = t.device.index
        if i not in self._synced:
            self.backend.synchronize(i)  # asynchronous runtimes: finish queued kernels first
            self._synced.add(i)

    def host(self, t: Tensor, read: bool = True, write: bool = False) -> Tensor:
        if t.device.type != self.backend.name:
            return t
        self._sync(t)
        if self.zero_copy and t.is_contiguous():
            return self.backend.to_host(t)
        if read:
            h = self.backend.to_host(t)
            h = h.clone(memory_format=torch.contiguous_format) if self.zero_copy \
                else h.contiguous()
        else:
            h = torch.empty(t.shape, dtype=t.dtype)
        if write:
            self.writeback.append((t, h))
        return h

    def out(self, t: Tensor) -> Tensor:
        return self.host(t, read=False, write=True)

    def inout(self, t: Tensor) -> Tensor:
        return self.host(t, read=True, write=True)

    def finish(self) -> None:
        for dev, h in self.writeback:
            self.backend.write_tensor(dev, h)


def _divide(t: Tensor, n: int) -> None:
    if t.is_floating_point() or t.is_complex():
        t.div_(n)
    else:
        t.div_(n, rounding_mode="trunc")


class HostStagedCollectives(Collectives):
    """Collectives that stage device tensors through host memory over Gloo.

    Any runtime works with it; it is how sim communicates and a starting point
    for a vendor before its native collective library is wired in.
    """

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta,
                 backend: DeviceBackend, *, gloo: Any = None) -> None:
        super().__init__(store, rank, size, timeout, backend)
        self.gloo = gloo if gloo is not None else dist.ProcessGroupGloo(store, rank, size,
                                                                        timeout)

    # -- helpers --
    def _reduce_op(self, op: Any) -> tuple[dist.ReduceOp, bool]:
        t = _op_type(op)
        if t == RedOp.AVG:
            return dist.ReduceOp.SUM, True
        if t not in _GLOO_OPS:
            raise CollectiveError(f"{backend_name(self.backend.name)}: reduce op {t} is not "
                                  f"supported (use SUM, AVG, PRODUCT, MIN, MAX or bitwise ops)")
        return dist.ReduceOp(t), False

    def _done(self, work: Any, stage: _Staging, result: list[Tensor],
              after: Callable[[], None] | None = None) -> dist.Work:
        def complete(fut: torch.futures.Future) -> list[Tensor]:
            fut.value()  # re-raises Gloo's error
            if after is not None:
                after()
            stage.finish()
            return result

        return DeviceWork(_then(future_of(work), complete))

    @staticmethod
    def _opts(cls_: Any, **kw: Any) -> Any:
        o = cls_()
        for k, v in kw.items():
            setattr(o, k, v)
        return o

    # -- collectives --
    def all_reduce(self, tensor: Tensor, op: Any) -> dist.Work:
        red, avg = self._reduce_op(op)
        s = _Staging(self.backend)
        h = s.inout(tensor)
        w = self.gloo.allreduce([h], self._opts(c10d.AllreduceOptions, reduceOp=red))
        return self._done(w, s, [tensor], (lambda: _divide(h, self.size)) if avg else None)

    def broadcast(self, tensor: Tensor, src: int) -> dist.Work:
        s = _Staging(self.backend)
        h = s.inout(tensor) if self.rank != src else s.host(tensor)
        w = self.gloo.broadcast([h], self._opts(c10d.BroadcastOptions, rootRank=src,
                                                rootTensor=0))
        return self._done(w, s, [tensor])

    def all_gather(self, outputs: list[Tensor], tensor: Tensor) -> dist.Work:
        s = _Staging(self.backend)
        hs = [s.out(o) for o in outputs]
        w = self.gloo.allgather([hs], [s.host(tensor)], c10d.AllgatherOptions())
        return self._done(w, s, outputs)

    def all_gather_into_tensor(self, output: Tensor, tensor: Tensor) -> dist.Work:
        # Like NCCL, only sizes count: SyncBatchNorm gathers [2C+1] into [1, W*(2C+1)];
        # Gloo splits along dim 0, so both sides go flat.
        if output.numel() != tensor.numel() * self.size:
            raise CollectiveError(f"all_gather_into_tensor: output has {output.numel()} elements, "
                                  f"expected {self.size} x {tensor.numel()}")
        s = _Staging(self.backend)
        w = self.gloo._allgather_base(s.out(output).reshape(-1), s.host(tensor).reshape(-1),
                                      c10d.AllgatherOptions())
        return self._done(w, s, [output])

    def reduce_scatter(self, output: Tensor, inputs: list[Tensor], op: Any) -> dist.Work:
        red, avg = self._reduce_op(op)
        s = _Staging(self.backend)
        h = s.out(output)
        w = self.gloo.reduce_scatter([h], [[s.host(i) for i in inputs]],
                                     self._opts(c10d.ReduceScatterOptions, reduceOp=red))
        return self._done(w, s, [output], (lambda: _divide(h, self.size)) if avg else None)

    def reduce_scatter_tensor(self, output: Tensor, tensor: Tensor, op: Any) -> dist.Work:
        red, avg = self._reduce_op(op)
        s = _Staging(self.backend)
        h = s.out(output)
        w = self.gloo._reduce_scatter_base(h, s.host(tensor),
                                           self._opts(c10d.ReduceScatterOptions, reduceOp=red))
        return self._done(w, s, [output], (lambda: _divide(h, self.size)) if avg else None)

    def all_to_all(self, outputs: list[Tensor], inputs: list[Tensor]) -> dist.Work:
        # Gloo has no list all-to-all: flatten into one buffer with split sizes.
        s = _Staging(self.backend)
        dtype = inputs[0].dtype
        if any(t.dtype != dtype for t in (*inputs, *outputs)):
            raise CollectiveError("all_to_all: all tensors must have the same dtype")
        flat_in = torch.cat([s.host(i).reshape(-1) for i in inputs]) if inputs else \
            torch.empty(0, dtype=dtype)
        out_splits = [o.numel() for o in outputs]
        flat_out = torch.empty(sum(out_splits), dtype=dtype)
        w = self.gloo.alltoall_base(flat_out, flat_in, out_splits,
                                    [i.numel() for i in inputs], c10d.AllToAllOptions())

        def unpack() -> None:
            for o, piece in zip(outputs, flat_out.split(out_splits), strict=True):
                s.writeback.append((o, piece.view(o.shape))) if o.device.type != "cpu" \
                    else o.copy_(piece.view(o.shape))

        return self._done(w, s, outputs, unpack)

    def all_to_all_single(self, output: Tensor, tensor: Tensor,
                          output_splits: list[int] | None,
                          input_splits: list[int] | None) -> dist.Work:
        s = _Staging(self.backend)
        w = self.gloo.alltoall_base(s.out(output), s.host(tensor), list(output_splits or []),
                                    list(input_splits or []), c10d.AllToAllOptions())
        return self._done(w, s, [output])

    def reduce(self, tensor: Tensor, dst: int, op: Any) -> dist.Work:
        red, avg = self._reduce_op(op)
        s = _Staging(self.backend)
        h = s.inout(tensor) if self.rank == dst else s.host(tensor).clone()
        w = self.gloo.reduce([h], self._opts(c10d.ReduceOptions, reduceOp=red, rootRank=dst,
                                             rootTensor=0))
        after = (lambda: _divide(h, self.size)) if avg and self.rank == dst else None
        return self._done(w, s, [tensor], after)

    def gather(self, outputs: list[Tensor], tensor: Tensor, dst: int) -> dist.Work:
        s = _Staging(self.backend)
        outs = [[s.out(o) for o in outputs]] if self.rank == dst else []
        w = self.gloo.gather(outs, [s.host(tensor)], self._opts(c10d.GatherOptions, rootRank=dst))
        return self._done(w, s, outputs)

    def scatter(self, output: Tensor, inputs: list[Tensor], src: int) -> dist.Work:
        s = _Staging(self.backend)
        ins = [[s.host(i) for i in inputs]] if self.rank == src else []
        w = self.gloo.scatter([s.out(output)], ins, self._opts(c10d.ScatterOptions, rootRank=src))
        return self._done(w, s, [output])

    def send(self, tensor: Tensor, dst: int, tag: int) -> dist.Work:
        s = _Staging(self.backend)
        h = s.host(tensor)
        if s.zero_copy:  # the caller may reuse the tensor once send() returned
            h = h.clone()
        return self._done(self.gloo.send([h], dst, tag), s, [tensor])

    def recv(self, tensor: Tensor, src: int, tag: int) -> dist.Work:
        s = _Staging(self.backend)
        return self._done(self.gloo.recv([s.out(tensor)], src, tag), s, [tensor])

    def barrier(self) -> dist.Work:
        return self.gloo.barrier(c10d.BarrierOptions())


# ---- liveness: name the dead rank -----------------------------------------------------
class _Liveness:
    """Heartbeat counters in the store, so a failed collective can name dead ranks."""

    PERIOD = 0.5

    def __init__(self, store: dist.Store, rank: int, size: int) -> None:
        self.store = store
        self.rank = rank
        self.size = size
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._beat, name=f"torchport-hb-{rank}",
                                       daemon=True)
        self.thread.start()
        _LIVENESS.add(self)

    def _beat(self) -> None:
        while not self.stop.wait(self.PERIOD):
            try:
                self.store.add(f"hb/{self.rank}", 1)
            except Exception:
                return

    def _counts(self) -> list[int]:
        return [int(self.store.add(f"hb/{r}", 0)) for r in range(self.size)]

    def diagnose(self) -> str:
        """Which peers stopped beating (takes a few heartbeat periods)."""
        try:
            before = self._counts()
            time.sleep(self.PERIOD * 5)
            after = self._counts()
        except Exception as e:
            return (f"the rendezvous store is unreachable ({type(e).__name__}: {e}); the process "
                    f"hosting it (rank 0 or the torchrun agent) has probably died")
        dead = [r for r in range(self.size) if r != self.rank and after[r] == before[r]]
        if dead:
            return f"rank(s) {', '.join(map(str, dead))} stopped responding (process died?)"
        return "all ranks are alive: a timeout or mismatched collectives across ranks"

    def close(self) -> None:
        self.stop.set()


_LIVENESS: weakref.WeakSet[_Liveness] = weakref.WeakSet()


@atexit.register
def _shutdown() -> None:
    """Stop heartbeats, then release Gloo groups from the main thread, before interpreter
    teardown destroys them in arbitrary order. A process that made no group skips the
    collections (0.2 s each with torch loaded)."""
    if not _KEEP_ALIVE and not _LIVENESS and not _CALLBACKS[0]:
        return
    for lv in list(_LIVENESS):
        lv.close()
        lv.thread.join(timeout=2 * lv.PERIOD)
    gc.collect()  # drop finished DDP reducers / works, and with them their callbacks
    _drain_callbacks(timeout=2.0)
    _KEEP_ALIVE.clear()
    gc.collect()


# ---- the c10d process group -----------------------------------------------------------
_FACTORIES: dict[str, CollectivesFactory] = {}
_KEEP_ALIVE: list[Any] = []


def set_collectives(device: str, factory: CollectivesFactory) -> None:
    """Use ``factory(store, rank, size, timeout, backend)`` for ``device``'s collectives
    (a vendor's native library instead of host staging). Affects groups created later."""
    _FACTORIES[device] = factory


def _wrap_errors(work: dist.Work, what: str, pg: DeviceProcessGroup) -> dist.Work:
    def check(fut: torch.futures.Future) -> Any:
        try:
            return fut.value()
        except Exception as e:
            raise CollectiveError(
                f"{pg.getBackendName()} {what} failed on rank {pg.rank()} of {pg.size()}: "
                f"{pg.liveness.diagnose()}. Cause: {_unwrap(str(e))}") from e

    return DeviceWork(_then(future_of(work), check), f"{pg.getBackendName()} {what}")


class DeviceProcessGroup(dist.ProcessGroup):
    """The ``<device>ccl`` process group: device tensors via :class:`Collectives`, CPU via Gloo.

    Errors (timeouts, dead peers) surface from ``wait()`` as :class:`CollectiveError`
    naming the operation, this rank and the ranks that stopped responding.
    """

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta,
                 backend: DeviceBackend) -> None:
        super().__init__(rank, size)
        self._rank, self._size, self.timeout = rank, size, timeout
        self.device_backend = backend
        self.device = backend.name
        self.gloo = dist.ProcessGroupGloo(dist.PrefixStore("cpu/", store), rank, size, timeout)
        # Gloo must not be destroyed by its own worker thread (a callback dropping the last
        # reference aborts the process): keep it until interpreter exit.
        _KEEP_ALIVE.append(self.gloo)
        factory = _FACTORIES.get(self.device)
        dstore = dist.PrefixStore("dev/", store)
        if factory is None:
            self.collectives: Collectives = HostStagedCollectives(dstore, rank, size, timeout,
                                                                  backend, gloo=self.gloo)
        else:
            self.collectives = factory(dstore, rank, size, timeout, backend)
        self.liveness = _Liveness(dist.PrefixStore("live/", store), rank, size)

    # -- identity --
    # The C++ name lookup goes through a registered C++ backend, which this group has not.
    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_name(self) -> str:
        name = getattr(self, "_name", None)
        if name is None:
            raise CollectiveError(f"{self.getBackendName()}: the process group has no name yet")
        return name

    def _set_group_desc(self, desc: str) -> None:
        self._desc = desc

    @property
    def group_desc(self) -> str:
        return getattr(self, "_desc", "undefined")

    # ``init_process_group(device_id=...)`` (what current DDP scripts and Lightning pass)
    # asks the group for the device's backend, to connect it eagerly where it can split.
    supports_splitting = False

    def _get_backend(self, device: torch.device) -> Any:
        """The group's backend for ``device``: the group itself for the device; other
        devices as the C++ lookup answers (no backend)."""
        if torch.device(device).type == self.device:
            return self
        return super()._get_backend(device)

    def getBackendName(self) -> str:  # noqa: N802 - c10d's name
        return backend_name(self.device)

    def name(self) -> str:
        return self.getBackendName()

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    def __repr__(self) -> str:
        return f"DeviceProcessGroup({self.getBackendName()}, rank={self._rank}, size={self._size})"

    # -- routing --
    def _on_device(self, what: str, tensors: Sequence[Any]) -> bool:
        flat: list[Tensor] = []
        for t in tensors:
            if isinstance(t, Tensor):
                flat.append(t)
            elif isinstance(t, (list, tuple)):
                flat.extend(x for x in t if isinstance(x, Tensor))
        kinds = {t.device.type for t in flat}
        if len(kinds) > 1:
            raise CollectiveError(f"{self.getBackendName()} {what}: tensors on {sorted(kinds)}; "
                                  f"one collective takes tensors of one device type")
        if kinds and kinds != {"cpu"} and kinds != {self.device}:
            raise CollectiveError(f"{self.getBackendName()} {what}: tensors on {kinds.pop()} "
                                  f"cannot be served (only {self.device} and cpu)")
        if kinds == {self.device}:
            dev = {t.device.index for t in flat}
            if len(dev) > 1:
                raise CollectiveError(f"{self.getBackendName()} {what}: tensors on several "
                                      f"{self.device} devices {sorted(dev)}; use one per rank")
        return kinds == {self.device}

    def _run(self, what: str, tensors: Sequence[Any], on_device: Callable[[], dist.Work],
             on_cpu: Callable[[], dist.Work]) -> dist.Work:
        dev = self._on_device(what, tensors)
        try:
            work = on_device() if dev else on_cpu()
        except CollectiveError:
            raise
        except RuntimeError as e:
            raise CollectiveError(f"{self.getBackendName()} {what} on rank {self._rank}: "
                                  f"{e}") from e
        return _wrap_errors(work, what, self)

    @staticmethod
    def _one(what: str, tensors: list[Tensor]) -> Tensor:
        if len(tensors) != 1:
            raise CollectiveError(f"{what}: expected one tensor per rank, got {len(tensors)}")
        return tensors[0]

    # -- c10d methods --
    def allreduce(self, tensors: list[Tensor], opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else c10d.AllreduceOptions()
        c = self.collectives
        if self._on_device("all_reduce", tensors) and len(tensors) > 1:
            return self.allreduce_coalesced(tensors, opts)
        return self._run("all_reduce", tensors,
                         lambda: c.all_reduce(self._one("all_reduce", tensors), opts.reduceOp),
                         lambda: self._cpu_allreduce(tensors, opts))

    def _cpu_allreduce(self, tensors: list[Tensor], opts: Any) -> dist.Work:
        if _op_type(opts.reduceOp) == RedOp.AVG:
            o = c10d.AllreduceOptions()
            o.reduceOp = dist.ReduceOp.SUM
            w = self.gloo.allreduce(tensors, o)

            def avg(f: torch.futures.Future) -> list[Tensor]:
                for t in f.value():
                    _divide(t, self._size)
                return tensors

            return DeviceWork(_then(future_of(w), avg))
        return self.gloo.allreduce(tensors, opts)

    def allreduce_coalesced(self, tensors: list[Tensor], opts: Any = None) -> dist.Work:
        """Several tensors in one reduction: flattened into one buffer, then split back."""
        o = c10d.AllreduceOptions()
        if opts is not None:
            o.reduceOp = opts.reduceOp
        if not tensors:
            return self.barrier()
        flat = torch.cat([t.reshape(-1) for t in tensors])
        w = self.allreduce([flat], o)

        def unflatten(f: torch.futures.Future) -> list[Tensor]:
            f.value()
            off = 0
            for t in tensors:
                n = t.numel()
                t.copy_(flat[off:off + n].view(t.shape))
                off += n
            return tensors

        return DeviceWork(_then(future_of(w), unflatten))

    def broadcast(self, tensors: list[Tensor], opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else c10d.BroadcastOptions()
        return self._run("broadcast", tensors,
                         lambda: self.collectives.broadcast(self._one("broadcast", tensors),
                                                            opts.rootRank),
                         lambda: self.gloo.broadcast(tensors, opts))

    def allgather(self, output_tensors: list[list[Tensor]], input_tensors: list[Tensor],
                  opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else c10d.AllgatherOptions()
        return self._run("all_gather", [*output_tensors, input_tensors],
                         lambda: self.collectives.all_gather(
                             output_tensors[0], self._one("all_gather", input_tensors)),
                         lambda: self.gloo.allgather(output_tensors, input_tensors, opts))

    def _allgather_base(self, output: Tensor, input: Tensor, opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else c10d.AllgatherOptions()
        return self._run("all_gather_into_tensor", [output, input],
                         lambda: self.collectives.all_gather_into_tensor(output, input),
                         lambda: self.gloo._allgather_base(output, input, opts))

    def allgather_into_tensor_coalesced(self, outputs: list[Tensor], inputs: list[Tensor],
                                        opts: Any = None) -> dist.Work:
        works = [self._allgather_base(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return _join(works, outputs)

    def reduce_scatter(self, output_tensors: list[Tensor], input_tensors: list[list[Tensor]],
                       opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else c10d.ReduceScatterOptions()
        return self._run("reduce_scatter", [output_tensors, *input_tensors],
                         lambda: self.collectives.reduce_scatter(
                             self._one("reduce_scatter", output_tensors), input_tensors[0],
                             opts.reduceOp),
                         lambda: self.gloo.reduce_scatter(output_tensors, input_tensors, opts))

    def _reduce_scatter_base(self, output: Tensor, input: Tensor,
                             opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else c10d.ReduceScatterOptions()
        return self._run("reduce_scatter_tensor", [output, input],
                         lambda: self.collectives.reduce_scatter_tensor(output, input,
                                                                        opts.reduceOp),
                         lambda: self._cpu_reduce_scatter_base(output, input, opts))

    def _cpu_reduce_scatter_base(self, output: Tensor, input: Tensor, opts: Any) -> dist.Work:
        if _op_type(opts.reduceOp) != RedOp.AVG:
            return self.gloo._reduce_scatter_base(output, input, opts)
        o = c10d.ReduceScatterOptions()
        o.reduceOp = dist.ReduceOp.SUM
        w = self.gloo._reduce_scatter_base(output, input, o)

        def avg(f: torch.futures.Future) -> list[Tensor]:
            f.value()
            _divide(output, self._size)
            return [output]

        return DeviceWork(_then(future_of(w), avg))

    def reduce_scatter_tensor_coalesced(self, outputs: list[Tensor], inputs: list[Tensor],
                                        opts: Any = None) -> dist.Work:
        works = [self._reduce_scatter_base(o, i, opts)
                 for o, i in zip(outputs, inputs, strict=True)]
        return _join(works, outputs)

    def alltoall_base(self, output: Tensor, input: Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else c10d.AllToAllOptions()
        return self._run("all_to_all_single", [output, input],
                         lambda: self.collectives.all_to_all_single(
                             output, input, output_split_sizes, input_split_sizes),
                         lambda: self.gloo.alltoall_base(output, input, output_split_sizes,
                                                         input_split_sizes, opts))

    def alltoall(self, output_tensors: list[Tensor], input_tensors: list[Tensor],
                 opts: Any = None) -> dist.Work:
        cpu_coll = HostStagedCollectives.__new__(HostStagedCollectives)
        cpu_coll.gloo, cpu_coll.backend, cpu_coll.size = self.gloo, self.device_backend, self._size
        return self._run("all_to_all", [*output_tensors, *input_tensors],
                         lambda: self.collectives.all_to_all(output_tensors, input_tensors),
                         lambda: cpu_coll.all_to_all(output_tensors, input_tensors))

    def reduce(self, tensors: list[Tensor], opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else c10d.ReduceOptions()
        return self._run("reduce", tensors,
                         lambda: self.collectives.reduce(self._one("reduce", tensors),
                                                         opts.rootRank, opts.reduceOp),
                         lambda: self.gloo.reduce(tensors, opts))

    def gather(self, output_tensors: list[list[Tensor]], input_tensors: list[Tensor],
               opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else c10d.GatherOptions()
        return self._run("gather", [*output_tensors, input_tensors],
                         lambda: self.collectives.gather(
                             output_tensors[0] if output_tensors else [],
                             self._one("gather", input_tensors), opts.rootRank),
                         lambda: self.gloo.gather(output_tensors, input_tensors, opts))

    def scatter(self, output_tensors: list[Tensor], input_tensors: list[list[Tensor]],
                opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else c10d.ScatterOptions()
        return self._run("scatter", [output_tensors, *input_tensors],
                         lambda: self.collectives.scatter(
                             self._one("scatter", output_tensors),
                             input_tensors[0] if input_tensors else [], opts.rootRank),
                         lambda: self.gloo.scatter(output_tensors, input_tensors, opts))

    def send(self, tensors: list[Tensor], dstRank: int, tag: int = 0) -> dist.Work:  # noqa: N803
        return self._run("send", tensors,
                         lambda: self.collectives.send(self._one("send", tensors), dstRank, tag),
                         lambda: self.gloo.send(tensors, dstRank, tag))

    def recv(self, tensors: list[Tensor], srcRank: int, tag: int = 0) -> dist.Work:  # noqa: N803
        return self._run("recv", tensors,
                         lambda: self.collectives.recv(self._one("recv", tensors), srcRank, tag),
                         lambda: self.gloo.recv(tensors, srcRank, tag))

    def barrier(self, opts: Any = None) -> dist.Work:
        return _wrap_errors(self.gloo.barrier(c10d.BarrierOptions()), "barrier", self)

    def all_to_all_single(self, output: Tensor, input: Tensor, output_split_sizes: list[int],
                          input_split_sizes: list[int], opts: Any = None,
                          timeout: timedelta | None = None) -> dist.Work:
        return self.alltoall_base(output, input, output_split_sizes, input_split_sizes,
                                  opts if isinstance(opts, c10d.AllToAllOptions) else None)

    # PyTorch 2.13's Python API calls these names; older code and C++ the ones above.
    all_gather_single = _allgather_base
    reduce_scatter_single = _reduce_scatter_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced


def _join(works: list[dist.Work], result: list[Tensor]) -> dist.Work:
    futs = torch.futures.collect_all([future_of(w) for w in works])

    def done(f: torch.futures.Future) -> list[Tensor]:
        for x in f.value():
            x.value()
        return result

    return DeviceWork(_then(futs, done))


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
