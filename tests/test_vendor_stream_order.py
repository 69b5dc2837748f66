"""The stream rule, both sides: on a runtime that runs its queues only when the host
synchronises (the walkthrough) and on ones with a worker thread per queue (the sim's
asynchronous modes, device-only memory and host memory), every operation that reads or
writes device memory outside a launched kernel -- copies, fills, clones, ``.to()``,
factories, host reads, frees -- issued right behind queued kernels gives the CPU's values
(``tests/stream_order_sweep.py``)."""

import subprocess
import sys

import pytest

from tests.helpers import ROOT, child_env

MODES = {
    "walkthrough": ("examples.vendor_walkthrough.backend", {}),  # queues run at sync only
    "sim-async-device-only": ("sim", {"TORCHPORT_SIM_ASYNC": "1", "TORCHPORT_SIM_STRICT": "1"}),
    "sim-async": ("sim", {"TORCHPORT_SIM_ASYNC": "1"}),
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_nothing_overtakes_queued_work(mode):
    backend, env = MODES[mode]
    size = ["-n", "1024"] if backend != "sim" else []
    r = subprocess.run([sys.executable, "-m", "tests.stream_order_sweep", backend, *size],
                       env=child_env(drop=("TORCHPORT_SIM_ASYNC", "TORCHPORT_SIM_STRICT"),
                                     importable=True, OMP_NUM_THREADS="1", **env),
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr[-3000:]
    assert r.returncode == 0, out
    assert "MISMATCH" not in out, out
    assert "checked " in r.stdout, out
