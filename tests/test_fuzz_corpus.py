"""Every repro the fuzzer ever minimised (tests/fuzz_corpus/*.py), in each sim mode.

Each script runs a program on the CPU and on sim and compares them step by step
(``check(program)``: the fuzzer's own comparison, copied into the script). A script must
find no difference, except the repros of bugs still open: those are listed in
``torchport.tools.fuzz.known.KNOWN_OPEN`` for the modes they fail in, and are strict xfails
here, so a fix turns them into a failure that says to delete the entry. Scripts marked
``# fuzz-corpus: subprocess`` (a crash) run in a child interpreter, the others in this
process.
"""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

import torchport.sim  # noqa: F401
from torchport.tools.fuzz.known import KNOWN_OPEN

pytestmark = pytest.mark.modes

CORPUS = Path(__file__).resolve().parent / "fuzz_corpus"
SCRIPTS = sorted(CORPUS.glob("*.py"))


def _mode() -> str:
    if os.environ.get("TORCHPORT_SIM_ASYNC", "0") not in ("", "0"):
        return "async"
    if os.environ.get("TORCHPORT_SIM_STRICT", "0") not in ("", "0"):
        return "strict"
    return "default"


def _params() -> list:
    mode, params = _mode(), []
    for path in SCRIPTS:
        entry = next((e for e in KNOWN_OPEN if path.name in e.corpus and mode in e.modes),
                     None)
        marks = [pytest.mark.xfail(strict=True, reason=(
            f"known open bug {entry.id!r}: {entry.symptom}. If this XPASSes the bug is "
            f"fixed in {mode} mode: remove {mode!r} (or the entry) from KNOWN_OPEN in "
            f"src/torchport/tools/fuzz/known.py"))] if entry else []
        params.append(pytest.param(path, marks=marks, id=path.stem))
    return params


def test_the_corpus_is_not_empty() -> None:
    assert SCRIPTS
    named = {name for e in KNOWN_OPEN for name in e.corpus}
    assert named <= {p.name for p in SCRIPTS}, named - {p.name for p in SCRIPTS}


@pytest.mark.parametrize("path", _params())
def test_corpus_script(path: Path) -> None:
    if "# fuzz-corpus: subprocess" in path.read_text():
        r = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                           timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
        return
    ns = runpy.run_path(str(path), run_name="fuzz_corpus")  # not __main__: nothing runs
    found = ns["check"](ns["program"])
    assert not found, "\n".join(f"step {d['k']} [{d['tag']}] {d['kind']}: {d['detail']}"
                                for d in found)
