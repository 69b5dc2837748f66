"""What a porting user reads when something fails: the script's traceback as Python prints
it, short errors naming the op and the fix, warnings pointing at the user's line."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import torchport.sim  # noqa: F401
from torchport import ops

pytestmark = pytest.mark.tools

ROOT = Path(__file__).resolve().parents[1]


def _torchport(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, COLUMNS="80", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "torchport.tools.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=180)


def test_run_prints_the_scripts_traceback_as_python_does(tmp_path: Path) -> None:
    (tmp_path / "bad.py").write_text(
        "import torch\n\n\ndef reshape(x):\n    return x.view(3, 7)\n\n\n"
        "reshape(torch.ones(4, device='cuda'))\n")
    out = _torchport("run", "bad.py", cwd=tmp_path)
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert "Traceback (most recent call last):" in lines, out.stderr
    lines = lines[lines.index("Traceback (most recent call last):"):]  # after build messages
    assert 'bad.py", line 8, in <module>' in lines[1]
    assert 'bad.py", line 5, in reshape' in lines[3]
    assert lines[-1] == "RuntimeError: shape '[3, 7]' is invalid for input of size 4"
    assert len(lines) == 7, out.stderr  # no torchport, runpy or click frames
    assert "╭" not in out.stderr and "│" not in out.stderr


def test_script_exit_code_passes_through(tmp_path: Path) -> None:
    """``sys.exit(7)`` in the script: torchport run exits 7 and prints nothing of its own."""
    (tmp_path / "exit.py").write_text("import sys\nsys.exit(7)\n")
    out = _torchport("run", "exit.py", cwd=tmp_path)
    assert out.returncode == 7 and out.stderr == ""


def test_op_without_any_kernel_says_so_without_a_fallback_warning() -> None:
    """An op PyTorch implements only for CUDA: no "running it on the CPU" warning followed
    by the dispatcher's list of backends; one short error naming the op, dtype and fix."""
    q = torch.randn(1, 4, 2, 8, device="sim")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(NotImplementedError) as err:
            torch.ops.aten._flash_attention_forward(q, q, q, None, None, 4, 4, 0.0, False,
                                                    False)
    assert not [w for w in caught if issubclass(w.category, ops.FallbackWarning)]
    msg = str(err.value)
    assert len(msg.splitlines()) == 1 and len(msg) < 400, msg
    assert "_flash_attention_forward" in msg and "float32" in msg and "sim" in msg
    assert "no CPU kernel" in msg
    # inputs intact, device usable
    assert torch.equal(q.cpu(), q.cpu()) and (q * 2).sum().item() == pytest.approx(
        2 * q.sum().item())


def test_fallback_warning_points_at_the_users_line() -> None:
    ops.fallback._WARNED.discard("kthvalue.values")
    x = torch.arange(5.0, device="sim")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch.kthvalue(x, 2).values.item() == 1.0  # the line the warning names
    w = [w for w in caught if issubclass(w.category, ops.FallbackWarning)]
    assert w and w[0].filename == __file__, (w[0].filename if w else caught)
