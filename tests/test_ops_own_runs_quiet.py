"""The CPU kernels the op layer runs for its own purposes (a refusal learnt on stand-ins,
an ``out=`` trial, an aliasing check) warn nobody: a device op warns as the CPU's does."""

from __future__ import annotations

import pytest

from tests.helpers import run_python

pytestmark = pytest.mark.modes

# in a fresh process, each its first call (what the op layer learns, it learns once)
_CALLS = [
    "F.adaptive_max_pool3d(t(2, 3, 6, 6, 6), 3)",
    "F.pad(t(1, 3), (1, 2), mode='replicate')",
    "F.pad(t(2, 3, 7), (2, 1), mode='reflect')",
    "F.pad(t(2, 3, 7), (2, 1), mode='circular')",
    "F.interpolate(t(2, 3, 4), size=(3,), mode='nearest-exact')",
    "F.interpolate(t(2, 3, 4, 4), scale_factor=1.7, mode='nearest-exact')",
    "F.interpolate(t(2, 3, 4, 4, 4), size=(3, 3, 3), mode='nearest-exact')",
    "F.interpolate(t(2, 3, 7), scale_factor=2, mode='linear')",
    "F.interpolate(t(1, 2, 3, 4, 5), size=(4, 5, 6), mode='trilinear')",
]

_SCRIPT = """
import sys, warnings, torch, torchport.sim
import torch.nn.functional as F
device = sys.argv[1]
def t(*shape):
    n = torch.Size(shape).numel()
    return (torch.arange(float(n)).reshape(shape) * 0.37).sin().to(device)
for call in sys.argv[2:]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        r = eval(call)
    r = r[0] if isinstance(r, tuple) else r
    print(call, r.cpu().sum().item(), [f"{w.category.__name__}: {w.message}" for w in seen])
"""


def test_device_ops_warn_as_the_cpus_do() -> None:
    out = {}
    for device in ("cpu", "sim"):
        r = run_python(_SCRIPT, args=[device, *_CALLS], TORCHPORT_FALLBACK_WARN="0")
        assert r.returncode == 0, r.stderr
        out[device] = r.stdout.splitlines()
    assert len(out["cpu"]) == len(_CALLS)
    for cpu, sim in zip(out["cpu"], out["sim"], strict=True):
        assert sim == cpu
