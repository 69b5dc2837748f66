"""Child interpreters forked from one that has imported torch, for ``helpers.run_python``.

Most of the suite's child interpreters are ``python -c code``, and each spent about 1.4 s
of CPU importing torch before its code ran. A preloaded interpreter (one per pytest
process, started at its first use) imports torch and nothing else, then forks a child per
request (a fork costs the child about 0.4 s of that in copied pages). The child is a
``python -c`` that has already run ``import torch``: its own environment, working
directory, ``__main__``, ``sys.argv``, standard streams and exit (``atexit`` handlers,
finalizers, interpreter teardown) are those of a fresh ``python -c``; torchport is
imported by the child's code, after its environment is set, as in a fresh interpreter.

A request is served only where the fork cannot differ from a fresh interpreter: its
environment differs from the preloaded one's only in torchport's, dynamo's and inductor's
variables that ``import torch`` did not look up (the preloaded interpreter records what
it looked up: ``TORCHPORT_AUTOLOAD``, for torch's backend autoload, and a few of
dynamo's) and in a few that it does not read. Every other request, a ``fresh=True`` one,
and the whole run under ``pytest --fresh-interpreters`` start a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

# Variables that may differ between a child's environment and the preloaded interpreter's,
# unless ``import torch`` looked them up there: torchport's, and those of dynamo and
# inductor (inductor sets TORCHINDUCTOR_CACHE_DIR and _TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR
# in the environment of a process that compiles) ...
_SETTINGS_PREFIXES = ("TORCHPORT_", "TORCHINDUCTOR_", "TORCHDYNAMO_", "_TORCHINDUCTOR_")
# ... and these, which ``import torch`` does not read.
_UNREAD = frozenset({
    "PYTEST_CURRENT_TEST",  # pytest's own, changes every test
    # read by torch.cuda's availability check when called; Lightning and Accelerate set it
    # as they are imported
    "PYTORCH_NVML_BASED_CUDA_CHECK",
    "PYOPENCL_HOME",  # pyopencl's, set as it is imported
})

# The preloaded interpreter: imports torch, answers the names of the variables that import
# looked up in the environment (a JSON list), then forks a child per request line (JSON:
# code, args, env, cwd, out, err), answering the child's pid, then its exit status.
_SERVER = r'''
import json, os, sys
_looked_up, _Environ = set(), type(os.environ)
_plain = _Environ.__getitem__, _Environ.__contains__


def _getitem(self, key, getitem=_plain[0], looked_up=_looked_up):
    looked_up.add(key)
    return getitem(self, key)


def _contains(self, key, contains=_plain[1], looked_up=_looked_up):
    looked_up.add(key)
    return contains(self, key)


_Environ.__getitem__, _Environ.__contains__ = _getitem, _contains
import torch
_Environ.__getitem__, _Environ.__contains__ = _plain
sys.stdout.buffer.write(json.dumps(sorted(_looked_up)).encode() + b"\n")
sys.stdout.flush()
del _looked_up, _Environ, _plain, _getitem, _contains


def _child(req, os=os, sys=sys):
    """Become ``python -c req["code"]``: never returns (the code's exit ends the process
    through the interpreter's usual teardown)."""
    import builtins, importlib, io
    fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)
    for fd, path in ((1, req["out"]), (2, req["err"])):
        f = os.open(path, os.O_WRONLY | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, closefd=False)))
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    sys.argv[:] = ["-c", *req["args"]]
    importlib.invalidate_caches()
    main = sys.modules["__main__"].__dict__
    loader = main["__loader__"]
    main.clear()
    main.update(__name__="__main__", __doc__=None, __package__=None, __loader__=loader,
                __spec__=None, __annotations__={}, __builtins__=builtins)
    code = compile(req["code"], "<string>", "exec")
    try:
        exec(code, main)
    except SystemExit:
        raise
    except BaseException as e:  # what ``python -c`` prints, without this frame
        e.__traceback__ = e.__traceback__.tb_next
        sys.excepthook(type(e), e, e.__traceback__)
        raise SystemExit(1) from None
    raise SystemExit(0)


def _serve(os=os, sys=sys, json=json):
    requests, answers = sys.stdin.buffer, sys.stdout.buffer
    for line in requests:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(req)
        answers.write(b"%d\n" % pid)
        answers.flush()
        _, status = os.waitpid(pid, 0)
        answers.write(b"%d\n" % os.waitstatus_to_exitcode(status))
        answers.flush()


_serve()
'''


class _Preloaded:
    """One preloaded interpreter and the line protocol to it."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL)
        self._buf = b""
        # what ``import torch`` looked up in the environment (and all it holds, where
        # something copied it)
        self.looked_up = frozenset(json.loads(self._line(None)))

    def serves(self, env: dict[str, str]) -> bool:
        """Whether a fork of this interpreter is what a fresh one with ``env`` is."""
        for k in self.env.keys() | env.keys():
            if self.env.get(k) != env.get(k) and k not in _UNREAD and (
                    not k.startswith(_SETTINGS_PREFIXES) or k in self.looked_up):
                return False
        return True

    def _line(self, timeout: float | None) -> bytes | None:
        """The next answer line, or None at ``timeout``; EOFError if the server ended."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            if not select.select([fd], [], [], timeout)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                raise EOFError("the preloaded interpreter ended")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line

    def run(self, code: str, args: list[str], env: dict[str, str], cwd: str,
            timeout: float | None) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory(prefix="tp-child-") as d:
            out, err = Path(d, "out"), Path(d, "err")
            out.touch()
            err.touch()
            req = {"code": code, "args": args, "env": env, "cwd": cwd, "out": str(out), "err": str(err)}
            self.proc.stdin.write(json.dumps(req).encode() + b"\n")
            self.proc.stdin.flush()
            pid = int(self._line(None))
            try:
                line = self._line(timeout)
            except BaseException:  # Ctrl-C: the child goes too, as subprocess.run kills it
                os.kill(pid, signal.SIGKILL)
                raise
            timed_out = line is None
            if timed_out:
                os.kill(pid, signal.SIGKILL)
                line = self._line(None)
            # text mode as subprocess.run(text=True) reads it: locale encoding, universal
            # newlines
            stdout, stderr = (p.read_text() for p in (out, err))
        cmd = [sys.executable, "-c", code, *args]
        if timed_out:
            raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr)
        return subprocess.CompletedProcess(cmd, int(line), stdout, stderr)

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


_BASE_ENV = dict(os.environ)  # at import, before any test changes it
_server: _Preloaded | None = None
_lock = threading.Lock()
enabled = True  # conftest: False under ``pytest --fresh-interpreters``


def _started() -> _Preloaded:
    """The preloaded interpreter, started where none runs (``_lock`` held)."""
    global _server
    if _server is None or _server.proc.poll() is not None:
        _server = _Preloaded(_BASE_ENV)
    return _server


def run(code: str, args: list[str], env: dict[str, str], cwd: str,
        timeout: float | None) -> subprocess.CompletedProcess | None:
    """``python -c code *args`` forked from the preloaded interpreter, or None where it cannot
    stand for a fresh one (then the caller starts one)."""
    global _server
    if not (enabled and sys.platform == "linux"):
        return None
    if not _lock.acquire(blocking=False):  # another thread's child is running
        return None
    try:
        server = _started()
        return server.run(code, args, env, cwd, timeout) if server.serves(env) else None
    except (EOFError, BrokenPipeError):  # it ended: the next call starts another
        _server = None
        return None
    finally:
        _lock.release()


def serves(env: dict[str, str]) -> bool:
    """Whether ``run`` forks a child with ``env``."""
    with _lock:
        return _started().serves(env)


def close() -> None:
    """End the preloaded interpreter (at the end of the pytest run)."""
    global _server
    if _server is not None:
        _server.close()
        _server = None
