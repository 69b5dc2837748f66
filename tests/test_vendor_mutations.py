"""Arguments an op writes reach device memory whichever path the op takes
(``tests/mutation_sweep.py``): BatchNorm's running statistics, GradScaler's counters,
embedding renorm, foreach lists, fused and foreach optimizer steps, ``out=`` and in-place
calls of decomposed ops, on a backend with no kernels at all (every op on the CPU fallback,
device-only memory), on the walkthrough (decompositions into its four kernels taken) and
on the kernel-light reference backend (asynchronous queues)."""

import subprocess
import sys

import pytest

from tests.helpers import ROOT, child_env

BACKENDS = ["bare", "walk", "torchport.backends.reference"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_written_arguments_match_the_cpu(backend):
    r = subprocess.run([sys.executable, "-m", "tests.mutation_sweep", backend],
                       env=child_env(drop=("TORCHPORT_SIM_ASYNC", "TORCHPORT_SIM_STRICT"),
                                     importable=True, OMP_NUM_THREADS="1"),
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr[-3000:]
    assert r.returncode == 0, out
    assert "MISMATCH" not in out, out
    assert "checked " in r.stdout, out
