"""Transfer beyond ``torch.cuda``'s top level and beyond one process.

``torch.cuda``'s submodules (``random``, ``memory``, ``streams``, ...) forward like
``torch.cuda.*``; processes a ``torchport run`` script starts load the backend and
transfer on ``import torch`` (PyTorch's device-backend autoload); a device tensor passed
to another process raises an error that says to move it to the CPU. Only the
multi-process check starts interpreters with torch; everything else runs in-process.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import types
import warnings
from importlib.metadata import entry_points

import pytest
import torch

from tests.helpers import free_port

pytestmark = pytest.mark.tools


def _cuda_submodules() -> dict[str, types.ModuleType]:
    import pkgutil

    return {i.name: importlib.import_module(f"torch.cuda.{i.name}")
            for i in pkgutil.iter_modules(torch.cuda.__path__) if not i.name.startswith("_")}


# ---- torch.cuda submodules -------------------------------------------------------------
def test_cuda_random_memory_streams_forward(xfer):
    # imported after enable, as a script (or Hugging Face's Trainer) does
    from torch.cuda.memory import mem_get_info, memory_allocated
    from torch.cuda.random import get_rng_state, get_rng_state_all, manual_seed, set_rng_state

    manual_seed(7)
    state = get_rng_state()
    a = torch.randn(4, device="cuda")
    set_rng_state(state)
    assert torch.equal(a.cpu(), torch.randn(4, device="cuda").cpu())
    assert get_rng_state is torch.cuda.get_rng_state  # one stand-in, as one function before
    assert len(get_rng_state_all()) == torch.cuda.device_count()
    torch.cuda.random.set_rng_state_all(get_rng_state_all())

    before = memory_allocated()
    keep = torch.empty(1 << 20, device="cuda")
    assert memory_allocated() > before and keep.device.type == "sim"
    free, total = mem_get_info()
    assert 0 < free <= total

    s = torch.cuda.streams.Stream()
    e = torch.cuda.streams.Event()
    assert isinstance(s, torch.cuda.Stream) and isinstance(s, torch.cuda.streams.Stream)
    with torch.cuda.stream(s):
        keep.fill_(1.0)
        e.record()
    e.synchronize()


def test_cuda_submodules_without_equivalent(xfer):
    graphs = torch.cuda.graphs
    assert isinstance(graphs.CUDAGraph, type)  # annotations, isinstance still work
    assert not isinstance(object(), graphs.CUDAGraph)
    with pytest.raises(xfer.TransferError, match="CUDA graphs"):
        graphs.CUDAGraph()
    assert graphs.is_current_stream_capturing() is False
    x = torch.ones(2, device="cuda")
    assert torch.cuda.nccl.is_available([x]) is False
    with pytest.raises(xfer.TransferError, match="NCCL"):
        torch.cuda.nccl.all_reduce([x])
    with pytest.raises(xfer.TransferError, match="GPUDirect"):
        torch.cuda.gds.GdsFile("f", os.O_RDONLY)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with torch.cuda.profiler.profile():
            x.add_(1)
        torch.cuda.tunable.enable(True)
        assert torch.cuda.tunable.is_enabled() is False
    assert sum("no CUDA profiler" in str(m.message) for m in w) == 1


def test_disable_restores_cuda_submodules():
    tp = importlib.import_module("torchport.transfer")
    tp.disable()  # importing it first enables it
    mods = _cuda_submodules()
    before = {n: dict(vars(m)) for n, m in mods.items()}
    tp.enable()
    try:
        assert torch.cuda.random.get_rng_state is not before["random"]["get_rng_state"]
        assert torch.cuda.memory.mem_get_info is not before["memory"]["mem_get_info"]
        assert torch.cuda.streams.Stream is not before["streams"]["Stream"]
    finally:
        tp.disable()
        torch.sim.set_device(0)
    for n, m in mods.items():
        after = vars(m)
        assert after.keys() == before[n].keys(), n
        assert all(after[k] is v for k, v in before[n].items()), n


# ---- child processes -------------------------------------------------------------------
def test_autoload_entry_point_is_inert_without_the_variable():
    eps = [ep for ep in entry_points(group="torch.backends") if ep.name == "torchport"]
    assert [ep.value for ep in eps] == ["_torchport_autoload:load"]
    # what ``import torch`` runs: without TORCHPORT_AUTOLOAD it imports nothing at all
    env = {k: v for k, v in os.environ.items() if k != "TORCHPORT_AUTOLOAD"}
    out = subprocess.run(
        [sys.executable, "-c", "import sys, _torchport_autoload as a; a.load(); "
         "print(sorted(m for m in sys.modules if 'torch' in m))"],
        env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['_torchport_autoload']"


def test_run_exports_the_child_environment(xfer, tmp_path, monkeypatch, capsys):
    from torchport.tools.run import run_script

    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delenv("TORCHPORT_AUTOLOAD", raising=False)
    monkeypatch.setenv("TORCHPORT_TRANSFER", "0")
    script = tmp_path / "env.py"
    script.write_text("import os\nprint(os.environ['TORCHPORT_AUTOLOAD'], "
                      "os.environ['TORCHPORT_TRANSFER'])\n")
    run_script(str(script), [])
    assert capsys.readouterr().out.strip() == "sim 1"
    assert "TORCHPORT_AUTOLOAD" not in os.environ and os.environ["TORCHPORT_TRANSFER"] == "0"


_SPAWN_SCRIPT = '''
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank, port, out):
    torch.cuda.set_device(rank)
    x = torch.ones(2, device="cuda")
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    y = torch.full((2,), rank + 1.0, device="cuda")
    dist.all_reduce(y)
    with open(f"{out}/rank{rank}", "w") as f:
        f.write(f"{x.device} {dist.get_backend()} {y.sum().item()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(int(sys.argv[1]), sys.argv[2]), nprocs=2)
'''


def test_spawned_workers_run_on_the_device(xfer, tmp_path, monkeypatch):
    """``torch.multiprocessing.spawn`` in a script ``torchport run`` runs (here in this
    process, as the CLI would): each rank re-runs the script in a fresh interpreter,
    selects its device, allocates on "cuda" and all-reduces over "nccl"."""
    import torch.distributed as dist

    from torchport.tools.run import run_script

    if "simccl" not in dist.Backend.backend_list:
        pytest.skip("no simccl distributed backend")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    for k in ("TORCHPORT_AUTOLOAD", "TORCHPORT_TRANSFER"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    script = tmp_path / "spawn_ranks.py"
    script.write_text(_SPAWN_SCRIPT)
    run_script(str(script), [str(free_port()), str(tmp_path)])
    ranks = [(tmp_path / f"rank{r}").read_text() for r in (0, 1)]
    assert ranks == ["sim:0 simccl 6.0", "sim:1 simccl 6.0"]


# ---- device tensors passed to processes ------------------------------------------------
def test_device_tensor_to_another_process_shares_its_memory(sim_backend):
    """Device tensors, their parameters, storages and views pickle for another process
    as CUDA's do: the same memory comes back (tests/test_ipc.py: across processes)."""
    from multiprocessing.reduction import ForkingPickler

    t = torch.arange(4.0, device="sim:1")
    for obj in (t, torch.nn.Parameter(t.clone()), t.untyped_storage(), t[1:]):
        back = ForkingPickler.loads(ForkingPickler.dumps(obj))
        assert back.device == obj.device
    back = ForkingPickler.loads(ForkingPickler.dumps(t[1:]))
    back.add_(1)
    sim_backend.synchronize(1)
    assert t.cpu().tolist() == [0.0, 2.0, 3.0, 4.0]

    # CPU tensors are shared as before: the same memory comes back
    c = torch.arange(4.0)
    back = ForkingPickler.loads(ForkingPickler.dumps(c))
    assert c.is_shared() and back.data_ptr() == c.data_ptr()
