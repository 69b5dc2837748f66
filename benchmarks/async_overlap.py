"""Host/device overlap on the sim: a loop of large matmuls, asynchronous vs blocking.

Each mode runs in a fresh process (the runtime reads its settings at start):

* ``async``: ``TORCHPORT_SIM_ASYNC=1`` -- work is queued on the stream's worker
  thread and the host runs ahead (issue time << total time), so host-side work
  (here: preparing the next batch) overlaps with the device's;
* ``blocking``: ``TORCHPORT_SIM_ASYNC=1 TORCHPORT_LAUNCH_BLOCKING=1`` -- every
  launch completes before returning, as when debugging.

The loop is plain PyTorch on ``sim`` tensors (``torch.tanh(c @ b)``): the kernel
layer allocates each result in the CPU kernel's layout (learned once) and queues the
computation on the current stream through ``Runtime.launch``.

Usage: ``python benchmarks/async_overlap.py [--n 1024] [--iters 20]``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def _child(n: int, iters: int) -> dict[str, float]:
    import torch

    import torchport.sim

    a = torch.randn(n, n, device="sim")
    b = torch.randn(n, n, device="sim")
    torch.tanh(a @ b).sum().item()  # warm up: meta kernels (imported on first use), worker
    torch.sim.synchronize()
    t0 = time.perf_counter()
    host_busy = 0.0
    c = a
    for _ in range(iters):
        c = torch.tanh(c @ b)  # two ATen kernels, queued on the current stream
        h = time.perf_counter()  # host work that can overlap (e.g. waiting on a data loader)
        time.sleep(0.01)
        host_busy += time.perf_counter() - h
    issued = time.perf_counter() - t0
    torch.sim.synchronize()
    total = time.perf_counter() - t0
    return {"issue_s": issued, "total_s": total, "host_work_s": host_busy,
            "asynchronous": float(torchport.sim.runtime.asynchronous)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(args.n, args.iters)))
        return
    results = {}
    for mode, extra in (("async", {}), ("blocking", {"TORCHPORT_LAUNCH_BLOCKING": "1"})):
        env = {**os.environ, "TORCHPORT_SIM_ASYNC": "1", **extra}
        out = subprocess.run([sys.executable, __file__, "--child", "--n", str(args.n),
                              "--iters", str(args.iters)], env=env, check=True,
                             capture_output=True, text=True).stdout
        results[mode] = json.loads(out.strip().splitlines()[-1])
    for mode, r in results.items():
        print(f"{mode:9s} issue {r['issue_s'] * 1e3:8.1f} ms   total {r['total_s'] * 1e3:8.1f} ms"
              f"   (host work {r['host_work_s'] * 1e3:.1f} ms)")
    saved = results["blocking"]["total_s"] - results["async"]["total_s"]
    print(f"overlap saved {saved * 1e3:.1f} ms over {args.iters} matmuls of {args.n}x{args.n}")


if __name__ == "__main__":
    main()
