"""A process forked after its parent used the device gets CUDA's error (runtimes that do
not survive fork), and can use the device when the parent never did."""

from __future__ import annotations

import os

import pytest

from tests.helpers import mode_independent, run_python

pytestmark = pytest.mark.modes

# Forks after ``used`` ran and reports what the child saw; run in a fresh process so the
# test process (stream worker threads in async mode) is never forked.
_FORK = """
import os, sys, torch, torchport.sim
from torchport.device.forking import ForkedDeviceError
if {survives}:
    torchport.sim.BACKEND.runtime.survives_fork = True
{used}
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    seen = []
    seen.append(f"bad_fork={{torch.sim._is_in_bad_fork()}}")
    try:
        torch.sim.init()
        x = torch.arange(4.0, device="sim") * 2
        seen.append(f"computed={{x.cpu().tolist()}}")
    except ForkedDeviceError as e:
        seen.append(f"error={{type(e).__mro__[1].__name__}}: {{e}}")
    os.write(w, "|".join(seen).encode())
    os._exit(0)
os.close(w)
os.waitpid(pid, 0)
print(os.read(r, 4096).decode())
print("parent", (torch.ones(2, device="sim") + 1).cpu().tolist())
"""


def _child(used: str, survives: bool = False) -> str:
    r = run_python(_FORK.format(used=used, survives=survives), timeout=120,
                   TORCHPORT_FALLBACK_WARN="0")
    assert r.returncode == 0, r.stderr
    assert "parent [2.0, 2.0]" in r.stdout  # the parent is unaffected
    return r.stdout


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
@mode_independent
@pytest.mark.parametrize("used", ["torch.ones(3, device='sim').sum().item()",
                                  "torch.sim.init()"])
def test_a_child_forked_after_use_cannot_reinitialize(used: str) -> None:
    out = _child(used)
    assert "bad_fork=True" in out
    assert ("error=RuntimeError: Cannot re-initialize sim in forked subprocess. To use sim "
            "with multiprocessing, you must use the 'spawn' start method") in out


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_child_forked_before_first_use_uses_the_device() -> None:
    out = _child("assert not torch.sim.is_initialized()")
    assert "bad_fork=False" in out and "computed=[0.0, 2.0, 4.0, 6.0]" in out


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
@pytest.mark.skipif(os.environ.get("TORCHPORT_SIM_ASYNC", "0") != "0",
                    reason="the asynchronous sim's stream threads do not survive fork")
def test_a_runtime_that_survives_fork_serves_the_child() -> None:
    out = _child("torch.ones(3, device='sim').sum().item()", survives=True)
    assert "bad_fork=False" in out and "computed=[0.0, 2.0, 4.0, 6.0]" in out
