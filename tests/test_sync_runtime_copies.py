"""Blocking copies on a runtime declared synchronous (``asynchronous = False``) whose kernels
still queue their work on the current stream's queue, as a vendor library that enqueues
does: ``.cpu()``, ``copy_`` from the host and same-device copies made under a side stream
see that stream's queued work, as on CUDA. The runtime is the vendor walkthrough's (queues
run when the host synchronises) declared synchronous, in a process of its own."""

import os
import textwrap
from pathlib import Path

from tests.helpers import run_python

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import torch
    import torchport

    real = torchport.current_backend
    torchport.current_backend = lambda: True        # import the walkthrough unregistered
    import examples.vendor_walkthrough.backend as walk
    torchport.current_backend = real

    class QueuedButSynchronous(walk.WalkRuntime):
        asynchronous = False

    walk.runtime = rt = QueuedButSynchronous()
    torchport.Backend("walk", rt, [walk.kernels]).register()

    x = torch.arange(6.0).to("walk")
    s = torch.walk.Stream()
    with torch.walk.stream(s):
        y = x * 2                                   # queued on s, not run yet
        got = y.cpu()                               # a blocking read on s: after the mul
        z = torch.empty(6, device="walk")
        z.copy_(y)                                  # a same-device copy on s
        w = x + 1                                   # queued on s
        w.copy_(torch.full((6,), 7.0))              # a blocking write: after the add
    torch.walk.synchronize()
    assert torch.equal(got, torch.arange(6.0) * 2), got
    assert torch.equal(z.cpu(), torch.arange(6.0) * 2), z.cpu()
    assert torch.equal(w.cpu(), torch.full((6,), 7.0)), w.cpu()
    print("ok")
""")


def test_blocking_copies_follow_the_current_streams_queue_on_a_synchronous_runtime():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH")]))}
    for k in ("TORCHPORT_SIM_STRICT", "TORCHPORT_SIM_ASYNC", "TORCHPORT_AUTOLOAD"):
        env.pop(k, None)
    run = run_python(SCRIPT, env=env)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout + run.stderr
