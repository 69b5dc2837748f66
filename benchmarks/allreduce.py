"""all_reduce bandwidth: sim tensors over simccl vs CPU tensors over Gloo, same run.

    .venv/bin/python benchmarks/allreduce.py [--strict] [--repeats N]

Spawns two local processes; prints, per size, the median time and the bus bandwidth
(2*(n-1)/n * bytes / time, NCCL-tests' definition) for both paths.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.multiprocessing as mp

SIZES = [1 << k for k in range(10, 27, 2)]  # 1 KiB .. 64 MiB


def _fmt(n: int) -> str:
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n // div} {unit}"
    return f"{n} B"


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _worker(rank: int, world: int, port: int, strict: bool, repeats: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      TORCHPORT_SIM_STRICT="1" if strict else "0")
    import torch.distributed as dist

    import torchport.sim  # noqa: F401
    from torchport.distributed import init_device_from_env

    dev = init_device_from_env()
    dist.init_process_group(backend="sim:simccl,cpu:gloo")
    rows = []
    for nbytes in SIZES:
        n = nbytes // 4
        reps = repeats if nbytes < (8 << 20) else max(3, repeats // 4)
        ts = torch.ones(n, device=dev)
        tc = torch.ones(n)
        t_sim = _time(lambda t=ts: dist.all_reduce(t), reps)
        t_cpu = _time(lambda t=tc: dist.all_reduce(t), reps)
        rows.append((nbytes, t_sim, t_cpu))
    if rank == 0:
        factor = 2 * (world - 1) / world
        mode = "strict (copy through runtime)" if strict else "unified (zero-copy host views)"
        print(f"all_reduce, {world} processes, float32, sim memory: {mode}, median of repeats")
        print(f"{'size':>8} | {'sim us':>10} {'sim GB/s':>9} | {'gloo cpu us':>11} "
              f"{'cpu GB/s':>9} | {'sim/cpu':>7}")
        for nbytes, a, b in rows:
            print(f"{_fmt(nbytes):>8} | {a * 1e6:10.1f} {factor * nbytes / a / 1e9:9.3f} | "
                  f"{b * 1e6:11.1f} {factor * nbytes / b / 1e9:9.3f} | {a / b:7.2f}")
    dist.destroy_process_group()


def main() -> None:
    """Parse arguments and spawn the two ranks."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strict", action="store_true", help="TORCHPORT_SIM_STRICT=1 in workers")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--world", type=int, default=2)
    a = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(a.world, port, a.strict, a.repeats), nprocs=a.world)


if __name__ == "__main__":
    main()
