"""Host/device overlap on the sim: a loop of large matmuls, asynchronous vs blocking.

Each mode runs in a fresh process (the runtime reads its settings at start):

* ``async``: ``TORCHPORT_SIM_ASYNC=1`` -- work is queued on the stream's worker
  thread and the host runs ahead (issue time << total time), so host-side work
  (here: preparing the next batch) overlaps with the device's;
* ``blocking``: ``TORCHPORT_SIM_ASYNC=1 TORCHPORT_LAUNCH_BLOCKING=1`` -- every
  launch completes before returning, as when debugging.

The matmuls are launched through ``SimRuntime.launch`` on device memory, which is
what every sim kernel does once the kernel registry launches through the runtime.

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

    from torchport.backends.sim.runtime import SimRuntime

    rt = SimRuntime(num_devices=1, memory=(3 * n * n * 4) * 2 + (1 << 20))
    nbytes = n * n * 4
    ptrs = [rt.malloc(0, nbytes) for _ in range(3)]
    a, b, c = (rt.device_tensor(0, p, nbytes).view(torch.float32).view(n, n) for p in ptrs)
    a.normal_()
    b.normal_()
    stream = rt.create_stream(0)
    t0 = time.perf_counter()
    host_busy = 0.0
    for _ in range(iters):
        rt.launch(0, stream, lambda: torch.mm(a, b, out=c), "mm")
        h = time.perf_counter()  # host work that can overlap (e.g. waiting on a data loader)
        time.sleep(0.01)
        host_busy += time.perf_counter() - h
    issued = time.perf_counter() - t0
    rt.synchronize_stream(0, stream)
    total = time.perf_counter() - t0
    for p in ptrs:
        rt.free(0, p)
    return {"issue_s": issued, "total_s": total, "host_work_s": host_busy,
            "asynchronous": float(rt.asynchronous)}


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
