"""Importing torchport changes nothing for code that does not use the device: PyTorch's
functions stay PyTorch's own (TorchScript, ``inspect``, lazy modules, pickling and
``torch.overrides`` see no difference)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# Every public attribute of these namespaces, by identity, before and after the import.
_SNAPSHOT = """
import torch, torch.nn.functional
spaces = {"torch": torch, "torch.Tensor": torch.Tensor, "torch.nn.functional": torch.nn.functional,
          "torch.nn.Module": torch.nn.Module, "torch.autograd": torch.autograd,
          "torch.jit": torch.jit, "torch.overrides": torch.overrides}
def snapshot():
    return {(s, n): id(getattr(ns, n)) for s, ns in spaces.items() for n in dir(ns)
            if not n.startswith("__")}
before = snapshot()
import gc
full = gc.get_stats()[2]["collections"]
import torchport.sim
print("full collections", gc.get_stats()[2]["collections"] - full, "collector", gc.isenabled())
after = snapshot()
changed = sorted(f"{s}.{n}" for (s, n), i in before.items() if after.get((s, n), i) != i)
print("changed", changed)
"""


def _run(code: str, tmp_path: Path) -> str:
    script = tmp_path / "cpu_code.py"  # TorchScript reads the source of what it compiles
    script.write_text(code)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "TORCHPORT_FALLBACK_WARN": "0"})
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.fixture(scope="module")
def snapshot_run(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _run(_SNAPSHOT, tmp_path_factory.mktemp("snapshot"))


def test_no_pytorch_function_is_replaced(snapshot_run: str) -> None:
    assert "changed []" in snapshot_run


def test_the_import_walks_no_heap_and_leaves_the_collector_on(snapshot_run: str) -> None:
    # Building and registering the backend's ~10^5 objects triggered full collections of
    # torch's whole heap in every interpreter that imported torchport.sim (a third of the
    # import's time); the collector pauses meanwhile and is back on after it.
    assert "full collections 0 collector True" in snapshot_run, snapshot_run


def test_cpu_code_runs_as_without_torchport(tmp_path: Path) -> None:
    out = _run("""
import inspect, pickle, torch
import torchport.sim

@torch.jit.script
def scripted(x: torch.Tensor) -> torch.Tensor:
    return x + torch.tensor([1.0, 2.0])

assert torch.equal(scripted(torch.ones(2)), torch.tensor([2.0, 3.0]))
import torch.distributed.optim  # scripts functional optimizers calling torch.tensor

lazy = torch.nn.LazyLinear(4).to(torch.float64)
assert lazy(torch.ones(2, 3, dtype=torch.float64)).shape == (2, 4)

for f in (torch.tensor, torch.as_tensor, torch.asarray, torch.Tensor.to,
          torch.Tensor.new_tensor):
    assert pickle.loads(pickle.dumps(f)) is f
    assert not hasattr(f, "__wrapped__"), f
assert inspect.isbuiltin(torch.tensor) and inspect.ismethoddescriptor(torch.Tensor.to)
assert torch.tensor in torch.overrides.get_ignored_functions()
assert torch.overrides.is_tensor_method_or_property(torch.Tensor.to)
print("ok")
""", tmp_path)
    assert out.strip().endswith("ok")
