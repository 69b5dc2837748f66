"""Distributed training on sim: the simccl backend against Gloo on CPU, DDP, dead peers.

Each test starts two worker processes running this file (``python test_distributed.py
<scenario> <rank> <port>``), so environment variables such as TORCHPORT_SIM_STRICT
are set before torchport is imported. A worker exits non-zero with a message on failure.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()
WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(scenario: str, extra_env: dict[str, str] | None = None,
            timeout: float = 60.0, script: Path = HERE) -> list[subprocess.CompletedProcess]:
    """Run ``script scenario <rank> <port>`` in WORLD processes; their results by rank."""
    port = _free_port()
    env = dict(os.environ)
    env.pop("TORCHPORT_SIM_STRICT", None)
    env.update(extra_env or {})
    procs = [subprocess.Popen([sys.executable, str(script), scenario, str(r), str(port)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in range(WORLD)]
    out = []
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            so, se = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{scenario}: workers hung for more than {timeout} s")
        out.append(subprocess.CompletedProcess(p.args, p.returncode, so, se))
    return out


def _check(results: list[subprocess.CompletedProcess], ok_line: str | None = None) -> None:
    """Every rank exited 0 (teardown included) and, if given, printed ``ok_line``."""
    for r, res in enumerate(results):
        assert res.returncode == 0, f"rank {r} failed:\n{res.stdout}\n{res.stderr[-4000:]}"
        assert ok_line is None or ok_line in res.stdout, f"rank {r}: no {ok_line!r}:\n{res.stdout}"


@pytest.mark.parametrize("strict", [False, True], ids=["unified", "strict"])
def test_collectives_match_gloo_cpu(strict: bool) -> None:
    _check(_launch("collectives", {"TORCHPORT_SIM_STRICT": "1" if strict else "0"}))


def test_ddp_matches_single_process() -> None:
    _check(_launch("ddp", timeout=90.0), ok_line="ddp ok")


def test_dead_peer_is_named() -> None:
    t0 = time.monotonic()
    results = _launch("dead_peer", timeout=60.0)
    assert results[1].returncode == 17  # the rank that dies on purpose
    assert results[0].returncode == 0, results[0].stderr[-4000:]
    assert "DEAD-PEER-REPORTED" in results[0].stdout, results[0].stdout
    assert time.monotonic() - t0 < 60


def test_exit_with_collectives_in_flight() -> None:
    # Regression: a communication thread that still held a Python callback when the
    # interpreter finalized took the GIL in a destructor and aborted the process with
    # "terminate called without an active exception" (see distributed._then).
    for r, res in enumerate(_launch("exit_in_flight", timeout=60.0)):
        assert res.returncode == 0 and "terminate called" not in res.stderr, \
            f"rank {r} (rc {res.returncode}):\n{res.stderr[-4000:]}"
        assert "exiting" in res.stdout


def test_exit_of_a_process_without_groups_skips_the_collections() -> None:
    # The exit handler's two gc.collect() cost 0.4 s at every exit that imports torchport;
    # only a process that made a group has Gloo objects to release.
    code = ("import gc, torch, torchport.sim, torchport.distributed as d\n"
            "x = (torch.ones(3, device='sim') * 2).sum()\n"
            "calls = []\n"
            "gc.collect = lambda *a: calls.append(a) or 0\n"
            "d._shutdown()\n"
            "print('collections', len(calls))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
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
def _init(rank: int, port: int, timeout_s: float = 30.0):
    from datetime import timedelta

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    import torch
    import torch.distributed as dist

    import torchport.sim  # noqa: F401
    from torchport.distributed import init_device_from_env

    dev = init_device_from_env()
    assert dev == torch.device("sim", rank)
    dist.init_process_group(timeout=timedelta(seconds=timeout_s))  # no backend: simccl
    assert dist.get_world_size() == WORLD
    return torch, dist, dev


def _collectives(rank: int, port: int) -> None:
    import warnings

    warnings.simplefilter("ignore")
    torch, dist, dev = _init(rank, port)
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


def _mlp(torch, unused: bool = False):
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(8, 16)
            self.b = torch.nn.Linear(16, 4)
            self.unused = torch.nn.Linear(16, 4) if unused else None

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    torch.manual_seed(1234)
    return Net()


def _reference(torch, steps: int, batches, unused: bool = False, micro: int = 1):
    """Single-process training on the concatenation of all ranks' batches (CPU)."""
    m = _mlp(torch, unused)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    for s in range(steps):
        for k in range(micro):
            x, y = (torch.cat([b[s][k][i] for b in batches]) for i in (0, 1))
            torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()
        opt.zero_grad()
    return m


def _ddp(rank: int, port: int) -> None:
    import warnings

    warnings.simplefilter("ignore")
    torch, dist, dev = _init(rank, port)
    from torch.nn.parallel import DistributedDataParallel as DDP

    steps = 20
    gen = torch.Generator().manual_seed(7)
    # batches[rank][step][micro] = (x, y); every rank builds all of them (for the reference).
    batches = [[[(torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen))
                 for _ in range(2)] for _ in range(steps)] for _ in range(WORLD)]

    def train(unused: bool, micro: int, **ddp_kw):
        model = DDP(_mlp(torch, unused).to(dev), **ddp_kw)
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
        ref = _reference(torch, steps, batches, unused, micro)
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
    torch, dist, dev = _init(rank, port, timeout_s=15.0)
    from torchport.distributed import CollectiveError

    t = torch.ones(4, device=dev)
    dist.all_reduce(t)
    if rank == 1:
        sys.stdout.flush()
        os._exit(17)  # dies without a word
    time.sleep(0.5)
    try:
        for _ in range(3):
            dist.all_reduce(t)
    except CollectiveError as e:
        msg = str(e)
        print(msg)
        assert "rank(s) 1" in msg, msg
        print("DEAD-PEER-REPORTED")
        sys.stdout.flush()
        os._exit(0)  # the group cannot be destroyed cleanly with a dead member
    raise SystemExit("all_reduce with a dead peer did not fail")


def _exit_in_flight(rank: int, port: int) -> None:
    torch, dist, dev = _init(rank, port)
    t = torch.ones(1 << 16, device=dev)
    dist.all_reduce(t)
    for _ in range(20):
        dist.all_reduce(t, async_op=True)  # still running when the interpreter exits
    print("exiting")


if __name__ == "__main__":
    _scenario, _rank, _port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    {"collectives": _collectives, "ddp": _ddp, "dead_peer": _dead_peer,
     "exit_in_flight": _exit_in_flight}[_scenario](_rank, _port)
