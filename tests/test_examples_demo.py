"""``make demo`` (examples/train_cnn.py): the sim's run matches the CPU's, and the time it
prints is a steady-state step on both sides, not a cold run against a warm one."""

import re
import runpy
import sys
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[1] / "examples" / "train_cnn.py"


def test_the_demo_times_steady_state_steps_on_both_sides(monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "argv", [str(DEMO), "--steps", "20"])
    runpy.run_path(str(DEMO), run_name="__main__")  # raises SystemExit on a failed check
    out = capsys.readouterr().out
    assert "loss curves identical to CPU: True" in out
    line = next(s for s in out.splitlines() if s.startswith("time per training step"))
    assert "median of steps 10-19" in line and "in turn" in line
    sim, cpu, ratio = map(float, re.search(
        r"sim ([\d.]+) ms, cpu ([\d.]+) ms, sim/cpu ([\d.]+)x", line).groups())
    assert sim > 0 and cpu > 0 and ratio == pytest.approx(sim / cpu, abs=0.01)
    assert re.search(r"first step, left out .*: sim \d+ ms, cpu \d+ ms", out)
