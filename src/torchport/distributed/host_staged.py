"""The default collectives: device tensors staged through host memory over Gloo (zero-copy
host views where the runtime's memory is host-addressable, copies otherwise)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist

from torchport.distributed.collectives import GLOO_OPS, Collectives, backend_name, op_type
from torchport.distributed.work import CollectiveError, DeviceWork, future_of, then

if TYPE_CHECKING:
    from torchport.core.contracts import DeviceBackend


Tensor = torch.Tensor
RedOp = dist.ReduceOp.RedOpType


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


def divide(t: Tensor, n: int) -> None:
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
        t = op_type(op)
        if t == RedOp.AVG:
            return dist.ReduceOp.SUM, True
        if t not in GLOO_OPS:
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

        return DeviceWork(then(future_of(work), complete))

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
        return self._done(w, s, [tensor], (lambda: divide(h, self.size)) if avg else None)

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
        return self._done(w, s, [output], (lambda: divide(h, self.size)) if avg else None)

    def reduce_scatter_tensor(self, output: Tensor, tensor: Tensor, op: Any) -> dist.Work:
        red, avg = self._reduce_op(op)
        s = _Staging(self.backend)
        h = s.out(output)
        w = self.gloo._reduce_scatter_base(h, s.host(tensor),
                                           self._opts(c10d.ReduceScatterOptions, reduceOp=red))
        return self._done(w, s, [output], (lambda: divide(h, self.size)) if avg else None)

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
        after = (lambda: divide(h, self.size)) if avg and self.rank == dst else None
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
