"""Running programs in worker processes: the CPU reference and each sim mode (or another
backend's device, :func:`add_backend`).

A :class:`Worker` is one long-lived process (:mod:`.worker`) per side; a program that kills
it (a crash) or outlives ``timeout`` (a hang) is reported as such and the worker restarts
for the next one. :func:`run_one` runs a program on the CPU and in the modes asked and
compares the traces.
"""

from __future__ import annotations

import fcntl
import os
import pickle
import re
import select
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from torchport.tools.fuzz import prelude
from torchport.tools.fuzz.program import Program
from torchport.tools.fuzz.worker import write_frame

MODES = {"default": {}, "strict": {"TORCHPORT_SIM_STRICT": "1"},
         "async": {"TORCHPORT_SIM_ASYNC": "1"}}
STARTUP_TIMEOUT = 180.0
# Modes that are another backend's device: mode (the device's name) -> the backend's module.
# Their floating values compare within tolerance (prelude.compare_traces, tolerant).
BACKENDS: dict[str, str] = {}


def add_backend(module: str) -> str:
    """Make backend ``module`` (as ``torchport run -b`` takes it) a mode; the mode's name,
    its device's, asked of a fresh interpreter (this process never loads a backend)."""
    code = ("import sys; from torchport.tools.run import load_backend; "
            "print(load_backend(sys.argv[1]).name)")
    out = subprocess.run([sys.executable, "-c", code, module], capture_output=True, text=True,
                         env=_env(None), timeout=STARTUP_TIMEOUT)
    if out.returncode != 0:
        raise RuntimeError(f"backend {module!r} does not load: {out.stderr.strip()[-1500:]}")
    name = out.stdout.split()[-1]
    if name in MODES:
        raise RuntimeError(f"backend {module!r} registers {name!r}, which is a sim mode's name")
    BACKENDS[name] = module
    return name


def _env(mode: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("TORCHPORT_SIM_STRICT", "TORCHPORT_SIM_ASYNC", "TORCHPORT_AUTOLOAD")}
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONFAULTHANDLER"] = "1"  # a crash leaves its stack in the worker's log
    env.update(MODES.get(mode or "", {}))
    return env


class Worker:
    """One worker process: ``mode`` None is the CPU reference, else a sim mode."""

    def __init__(self, mode: str | None, timeout: float = 60.0) -> None:
        self.mode, self.timeout = mode, timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = tempfile.TemporaryFile()
        fd = self.log.fileno()  # appended to by the worker: truncated per program here
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)
        self.restarts = 0

    def _start(self) -> None:
        self.log.seek(0)
        self.log.truncate()
        role = ["cpu"] if self.mode is None else ["backend", BACKENDS[self.mode]] \
            if self.mode in BACKENDS else ["sim"]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "torchport.tools.fuzz.worker", *role],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=_env(self.mode))
        ready = self._read(STARTUP_TIMEOUT)
        if not isinstance(ready, dict) or not ready.get("ready"):
            tail = self.log_tail()
            self.stop()
            raise RuntimeError(f"fuzz worker ({self.mode or 'cpu'}) did not start: {tail}")

    def _read(self, timeout: float) -> Any:
        """One frame, ``"hang"`` after ``timeout`` seconds, ``"crash"`` at end of output."""
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        buf = b""
        need = 4
        length: int | None = None
        while len(buf) < need:
            left = deadline - time.monotonic()
            if left <= 0:
                return "hang"
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                return "hang"
            chunk = os.read(fd, need - len(buf))
            if not chunk:
                return "crash"
            buf += chunk
            if length is None and len(buf) >= 4:
                (length,) = struct.unpack(">I", buf[:4])
                need = 4 + length
        try:
            return pickle.loads(buf[4:])
        except Exception as e:  # noqa: BLE001 - a trace this process cannot read: reported
            return {"error": f"unreadable reply from the worker: {type(e).__name__}: {e}"}

    def log_tail(self, n: int = 1500) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-n:]

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            self.proc = None

    def run(self, source: str) -> dict[str, Any]:
        """``{"trace": ...}``, ``{"error": text}`` (outside the steps), or
        ``{"crash": log tail}`` / ``{"hang": log tail}``; the worker restarts after those."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        assert self.proc is not None and self.proc.stdin is not None
        self.log.truncate(0)
        try:
            write_frame(self.proc.stdin, {"source": source})
            reply = self._read(self.timeout)
        except (BrokenPipeError, OSError):
            reply = "crash"
        if isinstance(reply, str):
            if reply == "crash":
                self.proc.wait(timeout=30)
            tail = self.log_tail()
            self.stop()
            self.restarts += 1
            code = None if reply == "hang" else "crash"
            return {reply: tail, "code": code}
        return reply

    def close(self) -> None:
        if self.proc is not None and self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.stop()
        self.log.close()


@dataclass
class Result:
    """One program in one mode: its differences (first = the root cause) or why none
    could be computed."""

    program: Program
    mode: str
    diffs: list[dict[str, Any]] = field(default_factory=list)
    skipped: str = ""  # the CPU reference failed: not a device difference


_STEP_RE = re.compile(r"\[fuzz step (\d+) (\S+)\]")


def _failure(reply: dict[str, Any], side: str) -> list[dict[str, Any]]:
    """A worker that died or hung, as a difference on the step it was in (its log says)."""
    kind = "crash" if "crash" in reply else "hang" if "hang" in reply else "harness"
    text = reply.get(kind) or reply.get("error") or ""
    steps = _STEP_RE.findall(text)
    k, tag = (int(steps[-1][0]), steps[-1][1]) if steps else (-1, "?")
    lines = [ln for ln in text.strip().splitlines() if ln.strip() and "[fuzz step" not in ln]
    first = next((ln for ln in lines if "Fatal Python error" in ln or "Error" in ln),
                 lines[-1] if lines else kind)
    return [{"k": k, "tag": tag, "kind": kind, "error": "", "log": text,
             "detail": f"{side}: {kind} in step {k} [{tag}]: {first.strip()[:200]}"}]


def run_one(program: Program, modes: list[str], workers: dict[str | None, Worker],
            cpu_trace: dict[str, Any] | None = None) -> list[Result]:
    """``program`` on the CPU (or ``cpu_trace``, already run) and in each mode."""
    source = program.source()
    if cpu_trace is None:
        reply = workers[None].run(source)
        if "trace" not in reply:
            why = _failure(reply, "cpu")[0]["detail"]
            return [Result(program, m, skipped=why) for m in modes]
        cpu_trace = reply["trace"]
    results = []
    for mode in modes:
        reply = workers[mode].run(source)
        if "trace" not in reply:
            results.append(Result(program, mode, _failure(reply, mode)))
            continue
        results.append(Result(program, mode, prelude.compare_traces(
            cpu_trace, reply["trace"], tolerant=mode in BACKENDS)))
    return results


def cpu_trace(program: Program, worker: Worker) -> dict[str, Any] | None:
    """The CPU reference trace of ``program``, or None where the CPU run failed."""
    reply = worker.run(program.source())
    return reply.get("trace")


def device_diffs(program: Program, mode: str, workers: dict[str | None, Worker]
                 ) -> list[dict[str, Any]] | None:
    """The differences of ``program`` in ``mode``; None where the CPU run failed."""
    (r,) = run_one(program, [mode], workers)
    return None if r.skipped else r.diffs
