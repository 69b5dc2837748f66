"""The ``<device>ccl`` c10d process group over a :class:`Collectives`, CPU tensors through an
internal Gloo group; what it keeps alive until exit, and the exit itself."""

from __future__ import annotations

import atexit
import gc
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist

from torchport.distributed.collectives import Collectives, CollectivesFactory, backend_name, op_type
from torchport.distributed.host_staged import HostStagedCollectives, divide
from torchport.distributed.liveness import LIVENESS, Liveness
from torchport.distributed.work import (
    CollectiveError,
    DeviceWork,
    callbacks_pending,
    drain_callbacks,
    future_of,
    then,
    unwrap,
)

if TYPE_CHECKING:
    from torchport.core.contracts import DeviceBackend


Tensor = torch.Tensor
RedOp = dist.ReduceOp.RedOpType


@atexit.register
def _shutdown() -> None:
    """Stop heartbeats, then release Gloo groups from the main thread, before interpreter
    teardown destroys them in arbitrary order. A process that made no group skips the
    collections (0.2 s each with torch loaded)."""
    if not _KEEP_ALIVE and not LIVENESS and not callbacks_pending():
        return
    gc.collect()  # drop finished DDP reducers / works, and with them their callbacks
    # Collectives still in flight end as Gloo's own groups end theirs at destruction: they
    # complete, or fail (a peer that exits closes its connections; a hung one times out).
    # Heartbeats go on meanwhile, so that the peers' diagnoses do not call this rank dead.
    drain_callbacks(timeout=_EXIT_WAIT[0])
    for lv in list(LIVENESS):
        lv.close()
        lv.thread.join(timeout=2 * lv.PERIOD)
    _KEEP_ALIVE.clear()
    gc.collect()


# ---- the c10d process group -----------------------------------------------------------
_FACTORIES: dict[str, CollectivesFactory] = {}
_KEEP_ALIVE: list[Any] = []
# How long exit waits for collectives in flight: the longest timeout of this process's groups.
_EXIT_WAIT = [0.0]


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
                f"{pg.liveness.diagnose()}. Cause: {unwrap(str(e))}") from e

    return DeviceWork(then(future_of(work), check), f"{pg.getBackendName()} {what}")


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
        _EXIT_WAIT[0] = max(_EXIT_WAIT[0], timeout.total_seconds())
        factory = _FACTORIES.get(self.device)
        dstore = dist.PrefixStore("dev/", store)
        if factory is None:
            self.collectives: Collectives = HostStagedCollectives(dstore, rank, size, timeout,
                                                                  backend, gloo=self.gloo)
        else:
            self.collectives = factory(dstore, rank, size, timeout, backend)
        self.liveness = Liveness(dist.PrefixStore("live/", store), rank, size)

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
        if op_type(opts.reduceOp) == RedOp.AVG:
            o = c10d.AllreduceOptions()
            o.reduceOp = dist.ReduceOp.SUM
            w = self.gloo.allreduce(tensors, o)

            def avg(f: torch.futures.Future) -> list[Tensor]:
                for t in f.value():
                    divide(t, self._size)
                return tensors

            return DeviceWork(then(future_of(w), avg))
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

        return DeviceWork(then(future_of(w), unflatten))

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
        if op_type(opts.reduceOp) != RedOp.AVG:
            return self.gloo._reduce_scatter_base(output, input, opts)
        o = c10d.ReduceScatterOptions()
        o.reduceOp = dist.ReduceOp.SUM
        w = self.gloo._reduce_scatter_base(output, input, o)

        def avg(f: torch.futures.Future) -> list[Tensor]:
            f.value()
            divide(output, self._size)
            return [output]

        return DeviceWork(then(future_of(w), avg))

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

    return DeviceWork(then(futs, done))
