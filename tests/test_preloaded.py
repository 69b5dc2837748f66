"""The test suite's preloaded child interpreters (tests/preloaded.py) behave as fresh ones.

``helpers.run_python`` forks children from an interpreter that has imported torch; what a
test's child code can see must be what ``python -c`` shows it, or the tests that run code
in a fresh process would test something else."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests import preloaded
from tests.helpers import ROOT, child_env, mode_independent, run_python

pytestmark = [pytest.mark.skipif(not preloaded.enabled, reason="--fresh-interpreters"),
              mode_independent]

# What a child sees of its process: printed one value a line.
_PROBE = """
import atexit, io, os, sys
class Last:
    def __del__(self):
        print("finalized at teardown", flush=True)
last = Last()  # a global: finalized as the interpreter tears __main__ down
atexit.register(lambda: print("atexit ran", flush=True))
print(sys.argv, __name__, repr(sys.path[0]), os.getcwd())
print(sorted(k for k in globals() if k.startswith("__")), "__file__" in globals())
print(os.environ.get("TORCHPORT_PROBE"), "PROBE_ONLY" in os.environ)
print(repr(sys.stdin.read()), sys.stdout.isatty(), sys.stdout.encoding)
print("torchport" in sys.modules, sum(m.startswith("torch._dynamo") for m in sys.modules))
print("to stderr", file=sys.stderr)
"""


def _both(code: str, **kw) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    return run_python(code, **kw), run_python(code, fresh=True, **kw)


def _parent(r: subprocess.CompletedProcess) -> int:
    return int(r.stdout.split()[-1])


def test_a_forked_child_sees_what_a_fresh_one_sees(tmp_path) -> None:
    env = child_env(TORCHPORT_PROBE="on")
    forked, fresh = _both(_PROBE, env=env, cwd=tmp_path)
    assert forked.returncode == fresh.returncode == 0, forked.stderr + fresh.stderr
    assert forked.stdout == fresh.stdout, (forked.stdout, fresh.stdout)
    assert forked.stderr == fresh.stderr == "to stderr\n"
    assert forked.stdout.splitlines()[-2:] == ["finalized at teardown", "atexit ran"] or \
        forked.stdout.splitlines()[-2:] == ["atexit ran", "finalized at teardown"]
    # and it was forked: its parent is the preloaded interpreter, not this process
    parent = "import os; print(os.getppid())"
    assert _parent(run_python(parent)) != os.getpid() == _parent(run_python(parent, fresh=True))


def test_exit_codes_errors_and_timeouts_are_a_fresh_ones() -> None:
    for code in ("import sys; sys.exit(3)", "raise SystemExit('bye')",
                 "import os; os._exit(7)", "x = 1\nraise ValueError('boom')",
                 "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"):
        forked, fresh = _both(code)
        assert (forked.returncode, forked.stdout, forked.stderr) == (
            fresh.returncode, fresh.stdout, fresh.stderr), code
    r = run_python("x = 1\nraise ValueError('boom')")
    assert r.stderr.splitlines() == ["Traceback (most recent call last):",
                                     '  File "<string>", line 2, in <module>',
                                     "ValueError: boom"], r.stderr
    with pytest.raises(subprocess.TimeoutExpired) as e:
        run_python("import time; print('started', flush=True); time.sleep(60)", timeout=3)
    assert e.value.output == "started\n"
    assert run_python("print('after a timeout')").stdout == "after a timeout\n"


@pytest.mark.parametrize("variable", ["TORCHPORT_AUTOLOAD", "TORCHDYNAMO_TRANSLATION_VALIDATION",
                                      "OMP_NUM_THREADS", "PYTHONPATH"])
def test_an_environment_torchs_import_reads_starts_a_fresh_interpreter(variable) -> None:
    """The variables ``import torch`` looked up (torch's backend autoload reads
    TORCHPORT_AUTOLOAD; a few of dynamo's are read as torch imports), and any but
    torchport's, dynamo's and inductor's."""
    env = child_env(**{variable: os.environ.get(variable, "") + "0"})
    assert not preloaded.serves(env)
    r = run_python("import os; print(os.getppid())", env=env, cwd=ROOT)
    assert _parent(r) == os.getpid()
    assert preloaded.serves(child_env(TORCHPORT_PROBE="on", TORCHINDUCTOR_PROBE="on",
                                      PYTEST_CURRENT_TEST="x"))
