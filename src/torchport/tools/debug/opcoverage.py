"""Op coverage: which ATen overloads a script or code block uses on the device, and how they ran.

Porting a model starts with one question: which of its ops have no device
kernel and fall back to the CPU? ``with torchport.tools.debug.opcoverage() as cov:``
records a code block (``torchport coverage script.py args`` a whole script) with
the op statistics of :mod:`torchport.ops.stats` and reports every overload with
its calls, dtypes, path and host time, fallback ops first. Paths: ``fallback`` (the CPU),
``decomposed`` (by torchport, into ops with kernels), ``composite`` (PyTorch's generic
composite kernel computed it above the backend: the op never reached the device's kernels
under its name, its pieces did), ``native`` (the backend's kernels), ``torchport``
(torchport's own kernels: allocation, copies, ``resize_``, ``set_``, its device routes),
``view`` (metadata only). ``static=True`` (``--static``) answers the
same question without running anything on the device (see
:mod:`torchport.tools.debug.static`). Results render as a rich table, JSON and a
self-contained HTML page.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchport.tools.debug.coverage_paths import PATH_COLOR as PATH_COLOR  # re-exported
from torchport.tools.debug.coverage_paths import PATH_ORDER, PATH_STYLE
from torchport.tools.debug.report_html import render_html

EXIT_NO_DEVICE_OPS = 4  # torchport coverage's exit code when no op ran on the device


@dataclass
class OpCoverage:
    """One ATen overload: how often it ran and on which path(s)."""

    name: str  # "add.Tensor" (overload name as the op statistics write it)
    calls: int
    paths: dict[str, int]
    dtypes: list[str]
    host_time_s: float = 0.0
    declined: int = 0

    @property
    def path(self) -> str:
        """The worst path any call took (an op that fell back once is a fallback op)."""
        for p in PATH_ORDER:
            if self.paths.get(p):
                return p
        return next(iter(self.paths), "native")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "path": self.path, "calls": self.calls,
                "paths": dict(self.paths), "dtypes": list(self.dtypes),
                "host_time_s": self.host_time_s, "declined": self.declined}


@dataclass
class CoverageResult:
    """What :func:`coverage` / ``torchport coverage`` found; filled when the block ends."""

    ops: list[OpCoverage] = field(default_factory=list)
    mode: str = "run"  # "run" (recorded on the device) or "static" (traced on fake tensors)
    backend: str = ""
    script: str | None = None
    args: list[str] = field(default_factory=list)
    exit_code: int = 0
    error: str | None = None  # the script's exception, when it failed
    stopped_at: str | None = None  # static mode: where the trace needed real data
    forced_fallback: list[str] = field(default_factory=list)
    wall_time_s: float = 0.0
    child_processes: int = 0  # processes the script started whose ops are included

    # ---- queries ---------------------------------------------------------------
    def rows(self) -> list[OpCoverage]:
        """Ops grouped by path (fallback, decomposed, native, view), most host time first."""
        rank = {p: i for i, p in enumerate(PATH_ORDER)}
        return sorted(self.ops, key=lambda o: (rank.get(o.path, len(rank)), -o.host_time_s,
                                               -o.calls, o.name))

    def op(self, name: str) -> OpCoverage | None:
        """The entry for overload ``name`` (``"addmm"``, ``"add.Tensor"``), if it ran."""
        return next((o for o in self.ops if o.name == name), None)

    def path_of(self, name: str) -> str | None:
        o = self.op(name)
        return None if o is None else o.path

    @property
    def device_ops(self) -> int:
        """Calls recorded on the device (0: the script computed on the CPU; nothing measured)."""
        return sum(o.calls for o in self.ops)

    @property
    def fallback_ops(self) -> list[OpCoverage]:
        """Overloads that fell back to the CPU at least once (what to write kernels for)."""
        return [o for o in self.rows() if o.paths.get("fallback")]

    def calls_per_path(self) -> dict[str, int]:
        out = dict.fromkeys(PATH_ORDER, 0)
        for o in self.ops:
            for p, n in o.paths.items():
                out[p] = out.get(p, 0) + n
        return out

    def ops_per_path(self) -> dict[str, int]:
        out = dict.fromkeys(PATH_ORDER, 0)
        for o in self.ops:
            out[o.path] = out.get(o.path, 0) + 1
        return out

    def time_per_path(self) -> dict[str, float]:
        """Host seconds per path (an op's time is split over its paths by calls)."""
        out = dict.fromkeys(PATH_ORDER, 0.0)
        for o in self.ops:
            for p, n in o.paths.items():
                out[p] = out.get(p, 0.0) + o.host_time_s * n / max(o.calls, 1)
        return out

    def summary(self) -> str:
        """One line: ops, calls, fallbacks (and how the script ended)."""
        fb = self.fallback_ops
        text = (f"{len(self.ops)} overloads, {sum(o.calls for o in self.ops)} calls, "
                f"{len(fb)} fall back to CPU")
        if fb:
            text += " (" + ", ".join(o.name for o in fb[:8]) + (", ..." if len(fb) > 8 else "") \
                + ")"
        composite = [o for o in self.rows() if o.paths.get("composite")]
        if composite:
            text += f", {len(composite)} computed by PyTorch's composites"
        if self.stopped_at:
            text += f"; static trace {self.stopped_at}"
        if self.child_processes:
            text += f"; {self.child_processes} child processes included"
        if self.exit_code:
            text += f"; script exited {self.exit_code}"
        return text

    # ---- output -----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode, "backend": self.backend, "script": self.script,
            "args": list(self.args), "exit_code": self.exit_code, "error": self.error,
            "stopped_at": self.stopped_at, "forced_fallback": list(self.forced_fallback),
            "wall_time_s": self.wall_time_s, "child_processes": self.child_processes,
            "totals": {"calls": self.calls_per_path(), "ops": self.ops_per_path(),
                       "host_time_s": self.time_per_path()},
            "ops": [o.to_dict() for o in self.rows()],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CoverageResult:
        """Read back :meth:`to_dict` (e.g. the ``--json`` file of a subprocess)."""
        ops = [OpCoverage(name=o["name"], calls=o["calls"], paths=dict(o["paths"]),
                          dtypes=list(o.get("dtypes", [])), host_time_s=o.get("host_time_s", 0.0),
                          declined=o.get("declined", 0)) for o in d.get("ops", [])]
        return cls(ops=ops, mode=d.get("mode", "run"), backend=d.get("backend", ""),
                   script=d.get("script"), args=list(d.get("args", [])),
                   exit_code=d.get("exit_code", 0), error=d.get("error"),
                   stopped_at=d.get("stopped_at"),
                   forced_fallback=list(d.get("forced_fallback", [])),
                   wall_time_s=d.get("wall_time_s", 0.0),
                   child_processes=d.get("child_processes", 0))

    def merge_ops(self, ops: list[OpCoverage]) -> None:
        """Add another process's records of the same run (calls, paths, dtypes, time)."""
        mine = {o.name: o for o in self.ops}
        for o in ops:
            m = mine.get(o.name)
            if m is None:
                mine[o.name] = m = OpCoverage(o.name, 0, {}, [])
                self.ops.append(m)
            m.calls += o.calls
            for p, n in o.paths.items():
                m.paths[p] = m.paths.get(p, 0) + n
            m.dtypes = sorted(set(m.dtypes) | set(o.dtypes))
            m.host_time_s += o.host_time_s
            m.declined += o.declined

    def write_json(self, path: str | os.PathLike[str]) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(self.to_json() + "\n", encoding="utf-8")
        return p

    def write_html(self, path: str | os.PathLike[str]) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(render_html(self), encoding="utf-8")
        return p

    def rich_table(self, limit: int | None = None) -> Any:
        """A rich Table of :meth:`rows`, one section per path."""
        from rich import box
        from rich.table import Table

        title = ("torchport op coverage" + (" (static: traced on fake tensors, not run)"
                                            if self.mode == "static" else ""))
        t = Table(title=title, box=box.SIMPLE_HEAD)
        t.add_column("path")
        t.add_column("overload")
        t.add_column("calls", justify="right")
        t.add_column("dtypes")
        static = self.mode == "static"
        if not static:
            t.add_column("host ms", justify="right")
        t.add_column("note")
        rows = self.rows()
        shown = rows if limit is None else rows[:limit]
        last = None
        for o in shown:
            if last is not None and o.path != last:
                t.add_section()
            last = o.path
            mixed = " ".join(f"{p}:{n}" for p, n in sorted(o.paths.items())) \
                if len(o.paths) > 1 else ""
            note = ", ".join(x for x in (mixed, f"declined:{o.declined}" if o.declined else "")
                             if x)
            timing = [] if static else [f"{o.host_time_s * 1e3:.3f}"]
            t.add_row(f"[{PATH_STYLE.get(o.path, '')}]{o.path}[/]", o.name, str(o.calls),
                      ",".join(o.dtypes), *timing, note)
        if limit is not None and len(rows) > limit:
            t.caption = f"... {len(rows) - limit} more (see --json/--html)"
        return t

    def print(self, console: Any = None, limit: int | None = None) -> None:
        """Print the table and a per-path summary with rich."""
        from rich import box
        from rich.console import Console
        from rich.table import Table

        con = console or Console()
        con.print(self.rich_table(limit))
        calls, nops, secs = self.calls_per_path(), self.ops_per_path(), self.time_per_path()
        totals = Table("path", "overloads", "calls", box=box.SIMPLE_HEAD, title="per path")
        if self.mode != "static":
            totals.add_column("host ms", justify="right")
        for p in PATH_ORDER:
            row = [f"[{PATH_STYLE[p]}]{p}[/]", str(nops[p]), str(calls[p])]
            totals.add_row(*row, *([] if self.mode == "static" else [f"{secs[p] * 1e3:.1f}"]))
        con.print(totals)
        if self.forced_fallback:
            con.print(f"forced to fallback: {', '.join(self.forced_fallback)}")
        if self.stopped_at:
            con.print(f"[yellow]static trace {self.stopped_at}[/]")
        if self.error:
            con.print(f"[red]script failed (exit {self.exit_code}):[/] {self.error}",
                      soft_wrap=True)
        elif not self.device_ops:
            con.print(f"[yellow]{self.no_device_ops_text()}[/]")

    def no_device_ops_text(self) -> str:
        """Why a report with no device op measured nothing, and what to check."""
        return (f"no op ran on the {self.backend or 'torchport'} device: the script computed on "
                f"the CPU (does it choose its device from an API torchport does not answer, "
                f"or is transfer off?)")

    def text(self, width: int = 120) -> str:
        """The terminal report as plain text (for logs and tests)."""
        from rich.console import Console

        con = Console(width=width, record=True, force_terminal=False, color_system=None,
                      file=open(os.devnull, "w"))  # noqa: SIM115
        try:
            self.print(con)
            return con.export_text()
        finally:
            con.file.close()


# ---- collecting -------------------------------------------------------------------
def _op_coverage(name: str, s: Any) -> OpCoverage:
    """An overload's record (:class:`torchport.ops.stats.OpStat`), torchport's own kernels'
    calls (sub-path ``native:torchport``) on the path ``torchport``."""
    paths = dict(s.paths)
    own = s.subpaths.get("native:torchport", 0)
    if own:
        paths["native"] = paths.get("native", 0) - own
        if paths["native"] <= 0:
            del paths["native"]
        paths["torchport"] = own
    return OpCoverage(name=name, calls=s.calls, paths=paths, dtypes=sorted(s.dtypes),
                      host_time_s=s.host_time_s, declined=s.declined)


class _Session:
    """The context manager behind :func:`coverage`."""

    def __init__(self, static: bool, script: str | None, composites: bool = True) -> None:
        self.static = static
        self.composites = composites
        self.result = CoverageResult(mode="static" if static else "run", script=script)
        self._rec: Any = None
        self._trace: Any = None
        self._t0 = 0.0

    def __enter__(self) -> CoverageResult:
        import torchport
        from torchport.ops import force_fallback_patterns, stats

        b = torchport.active_backend()
        self.result.backend = b.name
        self.result.forced_fallback = force_fallback_patterns()
        self._t0 = time.perf_counter()
        if self.static:
            from torchport.tools.debug.static import trace

            self._rec = stats.Recorder()
            self._trace = trace(self._rec, b.name)
            self._tracer = self._trace.__enter__()
        else:
            self._rec = stats.record(composites=self.composites).__enter__()
        return self.result

    def __exit__(self, et: Any, ev: BaseException | None, tb: Any) -> bool:
        suppress = False
        if self.static:
            self._trace.__exit__(None, None, None)
            if ev is not None and isinstance(ev, Exception):
                from torchport.tools.debug.static import is_trace_limit, stop_info

                info = stop_info(ev, self._tracer.current, self.result.script)
                self.result.stopped_at = str(info).removeprefix("stopped").strip() or "stopped"
                suppress = is_trace_limit(ev)
        else:
            self._rec.__exit__(et, ev, tb)
        self.result.wall_time_s = time.perf_counter() - self._t0
        self.result.ops = [_op_coverage(n, s) for n, s in self._rec.ops.items() if s.calls]
        return suppress


def coverage(static: bool = False, script: str | None = None, composites: bool = True) -> Any:
    """``with coverage() as cov:`` records the block's device ops into ``cov`` (a CoverageResult).

    ``composites`` lists the ops PyTorch's composite kernels compute on the device (path
    ``composite``; see :func:`torchport.ops.stats.record`: ``torch.compile`` runs eagerly
    under it); without it they are invisible, only their pieces show.

    With ``static=True`` device tensors created in the block are fake (nothing is
    allocated or computed on the device); an operation that needs real device data
    ends the block early and ``cov.stopped_at`` says where (the exception is
    swallowed then, since the analysis, not the computation, is the point).
    """
    return _Session(static, script, composites)


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def run_coverage(script: str, args: list[str] | None = None, *, static: bool = False,
                 transfer: bool | None = None, backend: str = "sim",
                 module: bool = False, composites: bool = True) -> CoverageResult:
    """Run ``script args`` in this process as ``__main__`` under :func:`coverage`.

    ``transfer=None`` enables :mod:`torchport.transfer`, as ``torchport run`` does: a
    CUDA script then runs on the device, and code written against ``torch.accelerator``
    or a library choosing the device runs as on a CUDA machine (transfer changes nothing
    else).
    The script's failure does not raise: it is in ``exit_code``/``error``.
    """
    import tempfile

    from torchport.tools.run import child_environment, exec_main, load_backend

    args = list(args or [])
    load_backend(backend)
    prior = sys.modules.get("torchport.transfer")
    was_enabled = prior is not None and prior.is_enabled()
    from torchport import transfer as xfer  # importing it enables it: put it back below

    if transfer is None:
        transfer = True
    if transfer:
        xfer.enable()
    elif xfer.is_enabled():
        xfer.disable()
    code, error = 0, None
    session = coverage(static=static, script=None if module else os.path.abspath(script),
                       composites=composites)
    result = session.result
    children = tempfile.TemporaryDirectory(prefix="torchport-cov-children-")
    try:
        with session, child_environment(backend, transfer, extra={} if static else {
                CHILDREN_VARIABLE: children.name}):
            exec_main(script, args, module=module, restore=True)
    except SystemExit as e:
        code = _exit_code(e.code)
        if code:
            error = f"SystemExit({e.code!r})"
    except KeyboardInterrupt:
        raise
    except Exception as e:
        traceback.print_exc()
        code, error = 1, f"{type(e).__name__}: {e}"
    finally:
        if xfer.is_enabled() and not was_enabled:
            xfer.disable()
        elif was_enabled and not xfer.is_enabled():
            xfer.enable()
    with children:
        for f in sorted(Path(children.name).glob("*.json")):
            try:
                child = CoverageResult.from_dict(json.loads(f.read_text(encoding="utf-8")))
            except (OSError, ValueError, KeyError):
                continue  # a child killed while writing: its ops are lost, not the report
            result.merge_ops(child.ops)
            result.child_processes += 1
    result.script, result.args = script, args
    result.exit_code, result.error = code, error
    return result


CHILDREN_VARIABLE = "TORCHPORT_COVERAGE_CHILDREN"


def record_child_process(directory: str) -> None:
    """Record this process's device ops and write them to ``directory/<pid>.json`` when it
    ends, for the ``torchport coverage`` run that started its parent. Multiprocessing
    children end through ``os._exit`` (no ``atexit``), so a multiprocessing finalizer
    writes too; whichever runs first writes."""
    import atexit
    import multiprocessing.util

    from torchport.ops import stats

    rec = stats.record(composites=True).__enter__()
    done: list[bool] = []

    def write() -> None:
        if done:
            return
        done.append(True)
        rec.__exit__(None, None, None)
        ops = [_op_coverage(n, s) for n, s in rec.ops.items() if s.calls]
        path = Path(directory) / f"{os.getpid()}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(CoverageResult(ops=ops).to_json(), encoding="utf-8")
        tmp.replace(path)

    atexit.register(write)
    multiprocessing.util.Finalize(None, write, exitpriority=100)


# ---- many scripts, in subprocesses (torchport migrate --analyse) --------------------
_MAIN_RE = re.compile(r"""__name__\s*==\s*['"]__main__['"]""")
_NOT_ENTRY = re.compile(r"(^|/)(test_[^/]*|[^/]*_test|conftest|setup|__init__)\.py$")


def find_entry_scripts(root: str | os.PathLike[str]) -> list[Path]:
    """Python files under ``root`` that run as scripts (``if __name__ == "__main__"``)."""
    base = Path(root)
    files = [base] if base.is_file() else sorted(base.rglob("*.py"))
    out = []
    for f in files:
        rel = f.name if base.is_file() else f.relative_to(base).as_posix()
        if _NOT_ENTRY.search(rel) or any(part in ("tests", "test") for part in Path(rel).parts):
            continue
        try:
            if _MAIN_RE.search(f.read_text(encoding="utf-8", errors="replace")):
                out.append(f)
        except OSError:
            continue
    return out


@dataclass
class ScriptAnalysis:
    """The coverage analysis of one script run in a subprocess."""

    script: Path
    args: list[str]
    exit_code: int
    result: CoverageResult | None = None
    error: str | None = None  # why it failed (stderr tail, timeout)
    json_path: Path | None = None
    html_path: Path | None = None

    @property
    def ok(self) -> bool:
        """The script ran to the end (possibly without a device op: see its summary)."""
        return self.exit_code in (0, EXIT_NO_DEVICE_OPS) and self.result is not None

    @property
    def fallback_ops(self) -> list[OpCoverage]:
        return [] if self.result is None else self.result.fallback_ops

    def __str__(self) -> str:
        if self.result is None:
            return f"failed (exit {self.exit_code}): {self.error or 'no result'}"
        text = self.result.summary()
        if self.exit_code == EXIT_NO_DEVICE_OPS:
            return f"{text}: no op ran on the device"
        if self.exit_code and self.error:
            text += f": {self.error.strip().splitlines()[-1] if self.error.strip() else ''}"
        return text


def _pythonpath_env() -> dict[str, str]:
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2])  # the directory holding torchport/
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    env.setdefault("TORCHPORT_FALLBACK_WARN", "0")
    return env


def run_script_coverage(script: str | os.PathLike[str], args: list[str] | None = None, *,
                        report_dir: str | os.PathLike[str] | None = None, static: bool = False,
                        cwd: str | os.PathLike[str] | None = None, timeout: float = 600,
                        backend: str = "sim", name: str | None = None,
                        transfer: bool | None = None) -> ScriptAnalysis:
    """Coverage of ``script args`` in a fresh interpreter (its crash or ``sys.exit`` stays there).

    With ``report_dir`` the JSON and HTML reports are kept there as
    ``coverage_<name>.json/.html``; otherwise only the parsed result is returned.
    ``transfer`` as for :func:`run_coverage` (``False`` for migrated scripts, which
    must run on the device without it).
    """
    import tempfile

    script = Path(script)
    args = list(args or [])
    stem = name or script.stem
    with tempfile.TemporaryDirectory(prefix="torchport-cov-") as tmp:
        out_dir = Path(report_dir) if report_dir is not None else Path(tmp)
        out_dir.mkdir(parents=True, exist_ok=True)
        jpath = out_dir / f"coverage_{stem}.json"
        hpath = out_dir / f"coverage_{stem}.html" if report_dir is not None else None
        cmd = [sys.executable, "-m", "torchport.tools.debug.cli_coverage", "--backend", backend,
               "--json", str(jpath)]
        if hpath is not None:
            cmd += ["--html", str(hpath)]
        if static:
            cmd.append("--static")
        if transfer is not None:
            cmd.append("--transfer" if transfer else "--no-transfer")
        cmd += ["--quiet", str(script.resolve()), *args]
        try:
            proc = subprocess.run(cmd, cwd=str(cwd or script.resolve().parent), env=_pythonpath_env(),
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return ScriptAnalysis(script, args, 124, error=f"timed out after {timeout:g}s")
        result = None
        if jpath.exists():
            try:
                result = CoverageResult.from_dict(json.loads(jpath.read_text(encoding="utf-8")))
            except (ValueError, KeyError):
                result = None
        err = None
        if proc.returncode != 0:
            err = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-15:])
        return ScriptAnalysis(script, args, proc.returncode, result=result, error=err,
                              json_path=jpath if report_dir is not None and jpath.exists()
                              else None,
                              html_path=hpath if hpath is not None and hpath.exists() else None)
