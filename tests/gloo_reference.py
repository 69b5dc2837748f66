"""PyTorch's own CPU/gloo run of the DDP example: the reference device results are checked against.

Its teardown races in PyTorch 2.13. Now and then it aborts after a complete run
("terminate called without an active exception"). It can also deadlock: DDP's reducer
may drop the last reference to the gloo process group while holding the GIL, and the
group's worker threads then wait for the GIL to release their tensors
(pytorch/pytorch#56297). So it runs in a subprocess, with a timeout, up to three times.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_gloo_reference(script: Path, args: list[str], cwd: Path, timeout: float = 120) -> str:
    """The stdout of ``python script *args`` (one rank, gloo, CPU), run again when its
    teardown aborts or hangs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHPORT_")}
    env.update(MASTER_ADDR="127.0.0.1", PYTHONUNBUFFERED="1")
    for _ in range(3):
        env["MASTER_PORT"] = str(free_port())
        try:
            out = subprocess.run([sys.executable, str(script), *args], cwd=str(cwd), env=env,
                                 capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            continue
        if out.returncode == -signal.SIGABRT:
            continue
        assert out.returncode == 0, (script, out.stdout[-2000:], out.stderr[-4000:])
        return out.stdout
    raise AssertionError(f"the gloo reference run of {script.name} aborted or hung three times")
