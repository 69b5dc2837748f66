"""Sparse ``mm`` on the device against the CPU: a 10k x 10k COO matrix, 1% dense, times a
dense 10k x 64 one (``torch.sparse.mm``, and the same with a CSR matrix).

    .venv/bin/python benchmarks/sparse_mm.py [--n 10000] [--density 0.01] [--cols 64]
    TORCHPORT_SIM_STRICT=1 .venv/bin/python benchmarks/sparse_mm.py   # device-only memory

Prints the median time of each and the device/CPU ratio; the results are checked equal.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import torchport.sim  # noqa: F401 -- registers the device


def _time(fn: Callable[[], torch.Tensor], repeats: int, sync: Callable[[], None]) -> float:
    fn()
    sync()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=10_000)
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--cols", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    g = torch.Generator().manual_seed(0)
    nnz = int(a.n * a.n * a.density)
    idx = torch.randint(0, a.n, (2, nnz), generator=g)
    coo = torch.sparse_coo_tensor(idx, torch.randn(nnz, generator=g), (a.n, a.n)).coalesce()
    dense = torch.randn(a.n, a.cols, generator=g)
    print(f"{a.n} x {a.n}, {nnz} non-zeros ({a.density:.2%}), times {a.n} x {a.cols}")
    for name, s in (("coo", coo), ("csr", coo.to_sparse_csr())):
        sd, dd = s.to("sim"), dense.to("sim")
        assert torch.equal(torch.sparse.mm(sd, dd).cpu(), torch.sparse.mm(s, dense))
        cpu = _time(lambda s=s: torch.sparse.mm(s, dense), a.repeats, lambda: None)
        dev = _time(lambda sd=sd, dd=dd: torch.sparse.mm(sd, dd), a.repeats, torch.sim.synchronize)
        print(f"{name}: cpu {cpu * 1e3:8.2f} ms   sim {dev * 1e3:8.2f} ms   "
              f"ratio {dev / cpu:5.2f}x")


if __name__ == "__main__":
    main()
