"""The device works until the interpreter's last finaliser, as the CPU does."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.modes

_FINALIZER = """
import torch, torchport.sim

class Holder:
    def __init__(self, device):
        self.t = torch.arange(4.0, device=device)

    def __del__(self):
        print(self.t.device.type, (self.t * 2).sum().item(), flush=True)

on_cpu, on_sim = Holder("cpu"), Holder("sim")
"""


def test_device_ops_in_finalizers_at_exit() -> None:
    r = subprocess.run([sys.executable, "-c", _FINALIZER], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "TORCHPORT_FALLBACK_WARN": "0"})
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.split("\n")[:2]) == ["cpu 12.0", "sim 12.0"], r.stdout + r.stderr
