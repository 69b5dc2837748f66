"""Distributed training on sim: the simccl backend against Gloo on CPU, DDP, dead peers.

Each test starts two worker processes running this file (``python test_distributed.py
<scenario> <rank> <port>``), so environment variables such as TORCHPORT_SIM_STRICT
are set before torchport is imported. A worker exits non-zero with a message on failure.
"""

from __future__ import annotations

import fcntl
import os
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a worker script: make ``tests`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest  # noqa: E402

from tests.helpers import (  # noqa: E402
    WORLD,
    check_ranks,
    ddp_mlp,
    ddp_reference,
    init_rank,
    launch_workers,
    run_python,
)

HERE = Path(__file__).resolve()


@pytest.mark.parametrize("strict", [False, True], ids=["unified", "strict"])
def test_collectives_match_gloo_cpu(strict: bool) -> None:
    mode = {"TORCHPORT_SIM_STRICT": "1" if strict else "0"}
    check_ranks(launch_workers(HERE, "collectives", mode))


def test_ddp_matches_single_process() -> None:
    check_ranks(launch_workers(HERE, "ddp", timeout=90.0), ok_line="ddp ok")


def test_dead_peer_is_named() -> None:
    t0 = time.monotonic()
    results = launch_workers(HERE, "dead_peer", timeout=60.0)
    assert results[1].returncode == 17  # the rank that dies on purpose
    assert results[0].returncode == 0 and "terminate called" not in results[0].stderr, \
        results[0].stderr[-4000:]
    assert "DEAD-PEER-REPORTED" in results[0].stdout, results[0].stdout
    assert time.monotonic() - t0 < 60


def test_exit_with_collectives_in_flight() -> None:
    # Regression: a communication thread that still held a Python callback when the
    # interpreter finalized took the GIL in a destructor and aborted the process with
    # "terminate called without an active exception" (see torchport.distributed.work.then).
    # Exit waits for them as Gloo's own groups do, however late the peer posts its side.
    for r, res in enumerate(launch_workers(HERE, "exit_in_flight", timeout=60.0)):
        assert res.returncode == 0 and "terminate called" not in res.stderr, \
            f"rank {r} (rc {res.returncode}):\n{res.stderr[-4000:]}"
        assert "exiting" in res.stdout


def test_a_dead_rank_is_diagnosed_once() -> None:
    # Every collective queued behind a dead peer fails; each spent five heartbeat periods
    # re-diagnosing it in a communication thread, so that 20 of them took 25 s to fail.
    from torchport.distributed.liveness import Liveness

    class Store:  # rank 1's counter never moves
        def __init__(self) -> None:
            self.reads = 0

        def add(self, key: str, n: int) -> int:
            self.reads += n == 0
            return 0

    store = Store()
    lv = Liveness(store, 0, 2)  # type: ignore[arg-type]
    lv.PERIOD = 0.01
    try:
        first = lv.diagnose()
        assert "rank(s) 1 stopped responding" in first
        reads = store.reads
        assert lv.diagnose() == first and store.reads == reads
    finally:
        lv.close()


def test_exit_of_a_process_without_groups_skips_the_collections() -> None:
    # The exit handler's two gc.collect() cost 0.4 s at every exit that imports torchport;
    # only a process that made a group has Gloo objects to release.
    code = ("import gc, torch, torchport.sim, torchport.distributed.process_group as d\n"
            "x = (torch.ones(3, device='sim') * 2).sum()\n"
            "calls = []\n"
            "gc.collect = lambda *a: calls.append(a) or 0\n"
            "d._shutdown()\n"
            "print('collections', len(calls))\n")
    res = run_python(code, timeout=120)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "collections 0" in res.stdout, res.stdout


def test_backend_registered_in_process() -> None:
    import torch.distributed as dist

    import torchport.sim  # noqa: F401
    from torchport.distributed import backend_name

    assert backend_name("sim") == "simccl"
    assert dist.Backend.default_device_backend_map["sim"] == "simccl"
    assert "simccl" in dist.Backend.backend_list


# =========================================================================== workers
def _collectives(rank: int, port: int) -> None:
    import warnings

    warnings.simplefilter("ignore")
    torch, dist, dev = init_rank(rank, port)
    import torchport

    strict = os.environ.get("TORCHPORT_SIM_STRICT") == "1"
    assert torchport.active_backend().runtime.host_addressable is not strict
    R = dist.ReduceOp
    W = WORLD

    def data(dtype, n=6, salt=0):
        base = torch.arange(n, dtype=torch.float64) + 1 + 3 * rank + salt
        return base.to(dtype)

    def run(fn, device):
        """fn(device) -> list of tensors; moved to CPU for comparison."""
        return [t.cpu() for t in fn(device)]

    cases = {}
    for dtype in (torch.float32, torch.int64):
        ops = [R.SUM, R.MIN, R.MAX, R.PRODUCT] + ([R.AVG] if dtype.is_floating_point else [])
        for op in ops:
            def ar(d, op=op, dtype=dtype):
                t = data(dtype).to(d)
                dist.all_reduce(t, op=op)
                return [t]
            cases[f"all_reduce_{op}_{dtype}"] = ar

        def bc(d, dtype=dtype):
            t = data(dtype).to(d)
            dist.broadcast(t, src=1)
            return [t]

        def ag(d, dtype=dtype):
            outs = [torch.zeros(6, dtype=dtype, device=d) for _ in range(W)]
            dist.all_gather(outs, data(dtype).to(d))
            return outs

        def agt(d, dtype=dtype):
            out = torch.zeros(6 * W, dtype=dtype, device=d)
            dist.all_gather_into_tensor(out, data(dtype).to(d))
            return [out]

        def rs(d, dtype=dtype):
            out = torch.zeros(3, dtype=dtype, device=d)
            dist.reduce_scatter(out, [data(dtype, 3, salt=i).to(d) for i in range(W)])
            return [out]

        def rst(d, dtype=dtype):
            out = torch.zeros(3, dtype=dtype, device=d)
            dist.reduce_scatter_tensor(out, data(dtype).to(d))
            return [out]

        def a2a(d, dtype=dtype):
            ins = [data(dtype, 2 + i + rank, salt=10 * i).to(d) for i in range(W)]  # unequal
            outs = [torch.zeros(2 + rank + i, dtype=dtype, device=d) for i in range(W)]
            dist.all_to_all(outs, ins)
            return outs

        def a2a_eq(d, dtype=dtype):
            ins = [data(dtype, 3, salt=i).to(d) for i in range(W)]
            outs = [torch.zeros(3, dtype=dtype, device=d) for _ in range(W)]
            dist.all_to_all(outs, ins)
            return outs

        def a2as(d, dtype=dtype):
            out = torch.zeros(6, dtype=dtype, device=d)
            dist.all_to_all_single(out, data(dtype).to(d))
            return [out]

        def a2as_uneq(d, dtype=dtype):
            in_splits = [1, 4] if rank == 0 else [2, 3]
            out_splits = [1, 2] if rank == 0 else [4, 3]
            out = torch.zeros(sum(out_splits), dtype=dtype, device=d)
            dist.all_to_all_single(out, data(dtype, 5).to(d), out_splits, in_splits)
            return [out]

        def red(d, dtype=dtype):
            t = data(dtype).to(d)
            dist.reduce(t, dst=0, op=R.SUM)
            return [t] if rank == 0 else []

        def gat(d, dtype=dtype):
            outs = [torch.zeros(6, dtype=dtype, device=d) for _ in range(W)] if rank == 1 else None
            dist.gather(data(dtype).to(d), outs, dst=1)
            return outs or []

        def sca(d, dtype=dtype):
            out = torch.zeros(6, dtype=dtype, device=d)
            ins = [data(dtype, salt=i).to(d) for i in range(W)] if rank == 0 else None
            dist.scatter(out, ins, src=0)
            return [out]

        def p2p(d, dtype=dtype):
            t = data(dtype).to(d)
            if rank == 0:
                dist.send(t, dst=1)
                return []
            dist.recv(t, src=0)
            return [t]

        def noncontig(d, dtype=dtype):
            t = data(dtype, 12).to(d).view(3, 4).t()
            dist.all_reduce(t)
            return [t]

        for name, fn in [("broadcast", bc), ("all_gather", ag), ("all_gather_into_tensor", agt),
                         ("reduce_scatter", rs), ("reduce_scatter_tensor", rst),
                         ("all_to_all_unequal", a2a), ("all_to_all", a2a_eq),
                         ("all_to_all_single", a2as), ("all_to_all_single_unequal", a2as_uneq),
                         ("reduce", red), ("gather", gat), ("scatter", sca), ("send_recv", p2p),
                         ("all_reduce_noncontiguous", noncontig)]:
            cases[f"{name}_{dtype}"] = fn

    def rst_avg(d):
        out = torch.zeros(3, device=d)
        dist.reduce_scatter_tensor(out, data(torch.float32).to(d), op=R.AVG)
        return [out]

    cases["reduce_scatter_tensor_avg"] = rst_avg

    failures = []
    for name, fn in cases.items():
        got, want = run(fn, dev), run(fn, "cpu")
        if len(got) != len(want) or not all(torch.equal(a, b) for a, b in zip(got, want, strict=True)):
            failures.append(f"{name}: sim {got} != gloo cpu {want}")
        for t in got:
            if t.dtype.is_floating_point and not torch.isfinite(t).all():
                failures.append(f"{name}: non-finite result")

    # Async work handles: wait / is_completed / get_future value on the device.
    t = torch.ones(1000, device=dev)
    work = dist.all_reduce(t, async_op=True)
    fut_val = work.get_future().wait()
    assert work.wait() is True
    assert work.is_completed()
    assert fut_val[0].device == dev, fut_val[0].device
    assert torch.equal(t.cpu(), torch.full((1000,), float(W)))
    dist.barrier()
    # Device tensors and CPU tensors in one op are refused clearly.
    from torchport.distributed import CollectiveError

    try:
        dist.all_gather([torch.zeros(2), torch.zeros(2, device=dev)], torch.zeros(2, device=dev))
    except (CollectiveError, RuntimeError, ValueError) as e:
        assert "device" in str(e) or "cpu" in str(e), e
    else:
        failures.append("mixed cpu/sim all_gather was accepted")
    dist.destroy_process_group()
    if failures:
        raise SystemExit("collective mismatches:\n" + "\n".join(failures))
    print("collectives ok", len(cases))


def _ddp(rank: int, port: int) -> None:
    import warnings

    warnings.simplefilter("ignore")
    torch, dist, dev = init_rank(rank, port)
    from torch.nn.parallel import DistributedDataParallel as DDP

    steps = 20
    gen = torch.Generator().manual_seed(7)
    # batches[rank][step][micro] = (x, y); every rank builds all of them (for the reference).
    batches = [[[(torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen))
                 for _ in range(2)] for _ in range(steps)] for _ in range(WORLD)]

    def train(unused: bool, micro: int, **ddp_kw):
        model = DDP(ddp_mlp(unused).to(dev), **ddp_kw)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for s in range(steps):
            for k in range(micro):
                x, y = (t.to(dev) for t in batches[rank][s][k])
                if k < micro - 1:
                    with model.no_sync():
                        torch.nn.functional.mse_loss(model(x), y).backward()
                else:
                    torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        return model.module

    failures = []
    for label, unused, micro, kw in [
        ("buckets", False, 1, {"bucket_cap_mb": 0.0005}),  # several buckets
        ("no_sync", False, 2, {}),
    ]:
        m = train(unused, micro, **kw)
        flat = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
        gathered = [torch.zeros_like(flat) for _ in range(WORLD)]
        dist.all_gather(gathered, flat)
        if not torch.equal(gathered[0].cpu(), gathered[1].cpu()):
            failures.append(f"{label}: ranks differ")
        # DDP averages over ranks; the reference takes the mean over the whole batch: same.
        ref = ddp_reference(steps, batches, unused, micro)
        for (n, p), q in zip(m.named_parameters(), ref.parameters(), strict=True):
            if not torch.allclose(p.detach().cpu(), q.detach(), atol=1e-5, rtol=1e-4):
                err = (p.detach().cpu() - q).abs().max().item()
                failures.append(f"{label}: {n} differs from single process by {err}")
    # find_unused_parameters / static_graph: see test_distributed_parallel.py (xfail, 2.13).
    dist.destroy_process_group()
    if failures:
        raise SystemExit("\n".join(failures))
    print("ddp ok")


def _dead_peer(rank: int, port: int) -> None:
    torch, dist, dev = init_rank(rank, port, timeout_s=15.0)
    from torchport.distributed import CollectiveError

    # rank 1 holds a lock on a file until it dies: rank 0 waits for its death on that lock
    lock = open(Path(tempfile.gettempdir()) / f"torchport-dead-peer-{port}", "a")  # noqa: SIM115
    if rank == 1:
        fcntl.flock(lock, fcntl.LOCK_EX)
    t = torch.ones(4, device=dev)
    dist.all_reduce(t)  # both ranks are here: rank 1 holds the lock
    if rank == 1:
        sys.stdout.flush()
        os._exit(17)  # dies without a word
    fcntl.flock(lock, fcntl.LOCK_EX)  # granted once rank 1's process has ended
    os.unlink(lock.name)
    try:
        for _ in range(3):
            dist.all_reduce(t)
    except CollectiveError as e:
        msg = str(e)
        print(msg)
        assert "rank(s) 1" in msg, msg
        print("DEAD-PEER-REPORTED")
    else:
        raise SystemExit("all_reduce with a dead peer did not fail")
    for _ in range(8):  # fail in flight at exit, which waits for them and exits cleanly
        dist.all_reduce(t, async_op=True)


def _exit_in_flight(rank: int, port: int) -> None:
    torch, dist, dev = init_rank(rank, port)
    t = torch.ones(1 << 16, device=dev)
    dist.all_reduce(t)
    if rank == 0:
        time.sleep(2.5)  # rank 1 reaches its exit long before rank 0 posts the matching ones
    for _ in range(20):
        dist.all_reduce(t, async_op=True)  # still running when the interpreter exits
    print("exiting")


if __name__ == "__main__":
    _scenario, _rank, _port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    {"collectives": _collectives, "ddp": _ddp, "dead_peer": _dead_peer,
     "exit_in_flight": _exit_in_flight}[_scenario](_rank, _port)
