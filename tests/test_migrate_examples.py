"""Issue 6 acceptance: ``torchport migrate examples/cuda`` gives scripts that run on the device.

The realistic CUDA examples are migrated offline once; each migrated script then
runs in a fresh interpreter (no ``torchport.transfer``: the rewritten code must
stand on its own) with small arguments, and its printed results are checked
against a CPU run of the *original* script (``--cpu``), the way
``tests/test_transfer.py`` checks ``torchport run``.
"""

from __future__ import annotations

import ast
import runpy
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import torchport.sim  # noqa: F401
from tests.helpers import child_env, example_values, free_port, run_gloo_reference, save_as_cuda
from torchport.tools.migrate import migrate_path

pytestmark = [pytest.mark.asynchronous, pytest.mark.tools]

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "cuda"


@pytest.fixture(scope="module")
def migrated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dst = tmp_path_factory.mktemp("migrated") / "cuda"
    result = migrate_path(EXAMPLES, dst)
    assert sorted(result.files_changed) == sorted(
        ["ddp_nccl.py", "infer_checkpoint.py", "train_amp.py", "train_argparse.py"])
    assert not result.unsupported and not result.failures
    for f in dst.glob("*.py"):
        tree = ast.parse(f.read_text())
        assert any(isinstance(n, ast.Import) and n.names[0].name == "torchport.sim"
                   for n in tree.body)
        for n in ast.walk(tree):  # no CUDA left in the code (docstrings may still say it)
            if isinstance(n, ast.Attribute) and n.attr == "cuda":  # torch.backends.cuda: no effect
                assert ast.unparse(n.value) == "torch.backends", (f, n.lineno)
            assert not (isinstance(n, ast.Constant) and n.value in ("cuda", "nccl")), f
    return dst


def _run(cmd: list[str], cwd: Path, timeout: float = 300, **env: str) -> dict[str, str]:
    """Run a migrated example."""
    env = child_env(drop=["TORCHPORT_TRANSFER"], importable=True, TORCHPORT_FALLBACK_WARN="0",
                    **env)
    out = subprocess.run(cmd, cwd=str(cwd), env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, \
        f"{cmd} exited {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-6000:]}"
    assert "torchport.transfer" not in out.stderr
    return example_values(out.stdout)


def _cpu_original(name: str, args: list[str], capsys: pytest.CaptureFixture[str],
                  monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The unmodified CUDA example with ``--cpu``, in this process (as test_transfer does)."""
    monkeypatch.setattr(sys, "argv", [str(EXAMPLES / name), *args, "--cpu"])
    monkeypatch.setattr(sys, "path", list(sys.path))
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    return example_values(capsys.readouterr().out)


def test_migrated_train_argparse(migrated: Path, capsys, monkeypatch) -> None:
    args = ["--epochs", "2", "--batch-size", "64"]
    dev = _run([sys.executable, str(migrated / "train_argparse.py"), *args], migrated)
    cpu = _cpu_original("train_argparse.py", args, capsys, monkeypatch)
    assert dev.keys() >= {"final loss", "params checksum"}
    assert float(dev["final loss"]) == pytest.approx(float(cpu["final loss"]), rel=1e-4, abs=1e-5)
    assert float(dev["params checksum"]) == pytest.approx(float(cpu["params checksum"]),
                                                          rel=1e-4, abs=1e-4)


def test_migrated_train_amp(migrated: Path, capsys, monkeypatch) -> None:
    args = ["--steps", "4"]
    dev = _run([sys.executable, str(migrated / "train_amp.py"), *args], migrated)
    cpu = _cpu_original("train_amp.py", args, capsys, monkeypatch)
    assert dev["autocast dtype"] in ("torch.float16", "torch.bfloat16", "torch.float32")
    assert float(dev["final loss"]) == pytest.approx(float(cpu["final loss"]), rel=2e-2)


def test_migrated_infer_checkpoint(migrated: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    ns = runpy.run_path(str(EXAMPLES / "infer_checkpoint.py"), run_name="not_main")
    torch.manual_seed(0)
    model = ns["Classifier"]().to("sim:0")
    ckpt = tmp_path / "model.pt"
    save_as_cuda({"model": model.state_dict(), "epoch": 7}, ckpt)  # as a GPU machine wrote it
    dev = _run([sys.executable, str(migrated / "infer_checkpoint.py"), str(ckpt)], migrated)
    cpu = _cpu_original("infer_checkpoint.py", [str(ckpt)], capsys, monkeypatch)
    assert dev["loaded epoch"].startswith("7 on sim")
    assert dev["predictions"] == cpu["predictions"]
    assert float(dev["probs checksum"]) == pytest.approx(float(cpu["probs checksum"]), rel=1e-5)


def test_migrated_ddp_two_ranks(migrated: Path) -> None:
    import torch.distributed as dist

    if "simccl" not in dist.Backend.backend_list:
        pytest.skip("no simccl distributed backend")
    port = str(free_port())
    dev = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                "--master_addr=127.0.0.1", f"--master_port={port}",
                str(migrated / "ddp_nccl.py"), "--steps", "6"], migrated, timeout=400,
               OMP_NUM_THREADS="1")
    assert dev["world size"] == "2 backend simccl"
    # CPU reference: the original with gloo, one rank (same data on every rank)
    cpu = example_values(run_gloo_reference(EXAMPLES / "ddp_nccl.py", ["--steps", "6", "--cpu"],
                                     migrated))
    assert float(dev["params checksum"]) == pytest.approx(float(cpu["params checksum"]), abs=1e-4)
