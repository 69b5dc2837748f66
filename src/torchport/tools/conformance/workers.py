"""The run in worker processes: a crash or hang of one OpInfo costs that OpInfo; each
worker serves a list of ids and writes its results for the parent to read."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchport.tools.conformance.catalog import apply_known, load_op_db, opinfo_id, select
from torchport.tools.conformance.runner import Runner, load_backend


# ---- workers ---------------------------------------------------------------------
def serve(args: argparse.Namespace, run: Callable[[Any], dict[str, Any]]) -> int:
    """A worker's loop (the OpInfo runners share it): the OpInfos whose keys it was given,
    each one's start and ``run(op)`` result written to ``args.worker_out`` as it goes, so
    that a crash or a hang costs only the OpInfo it happened in."""
    ops = select(load_op_db(), args.ops)
    ids = set(json.loads(Path(args.worker_ids).read_text()))
    with open(args.worker_out, "a") as f:
        for i, op in enumerate(ops):
            key = f"{i}:{opinfo_id(op)}"
            if key not in ids:
                continue
            f.write(json.dumps({"start": key}) + "\n")
            f.flush()
            r = run(op)
            r["key"] = key
            f.write(json.dumps({"result": r}) + "\n")
            f.flush()
    return 0


def _worker(args: argparse.Namespace) -> int:
    device = load_backend(args.backend)  # before op_db: device bases are computed at import
    runner = Runner(device, max_samples=args.max_samples, grad=not args.no_grad,
                    op_timeout=args.op_timeout)
    return serve(args, lambda op: runner.run_opinfo(op, args.dtypes))


def _keys(pattern: str | None) -> list[str]:
    # Listing needs op_db but not the device: a light subprocess-free import here.
    ops = select(load_op_db(), pattern)
    return [f"{i}:{opinfo_id(op)}" for i, op in enumerate(ops)]


def worker_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment of worker processes: the run's sim modes, no op statistics, no
    fallback warnings, this torchport on the path."""
    env = {**os.environ, "TORCHPORT_FALLBACK_WARN": "0"}
    env.pop("TORCHPORT_OP_STATS", None)
    if args.strict:
        env["TORCHPORT_SIM_STRICT"] = "1"
    if args.asynchronous:
        env["TORCHPORT_SIM_ASYNC"] = "1"
    env["PYTHONPATH"] = worker_path(env)
    return env


def run_worker_pool(keys: list[str], jobs: int, command: Callable[[Path, Path], list[str]],
                    died: Callable[[str, str], dict[str, Any]], env: dict[str, str], *,
                    label: str, quiet: bool, progress: Any = None,
                    cwd: Path | None = None) -> list[dict[str, Any]]:
    """Run ``keys`` in ``jobs`` worker processes, each ``command(ids_file, out_file)``
    writing ``{"start": key}`` and ``{"result": r}`` lines for the keys of its ids file. A
    worker that dies costs the key it was running (``died(key, why)`` is its result) and a
    new worker takes the rest of its list; a worker that ends without starting any of its
    keys stops the run. ``progress(results so far)`` every minute; a count of ``label`` on stderr."""
    jobs = max(1, min(jobs, len(keys)))
    tmp = Path(tempfile.mkdtemp(prefix="torchport-conf-"))
    results: dict[str, dict[str, Any]] = {}
    procs: list[tuple[subprocess.Popen, Path, list[str], Path]] = []
    n = 0

    def launch(todo: list[str]) -> None:
        nonlocal n
        n += 1
        ids, out, err = tmp / f"ids{n}.json", tmp / f"out{n}.jsonl", tmp / f"err{n}.txt"
        ids.write_text(json.dumps(todo))
        p = subprocess.Popen(command(ids, out), cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                             stderr=open(err, "w"))
        procs.append((p, out, todo, err))

    for i in range(jobs):
        if keys[i::jobs]:
            launch(keys[i::jobs])
    shown, last_write, last_read = -1, time.monotonic(), time.monotonic()
    while procs:
        time.sleep(0.5)
        for entry in list(procs):
            p, out, todo, err = entry
            if p.poll() is None:
                continue
            procs.remove(entry)
            started = _read_worker(out, results)
            if started is not None and started not in results:  # the worker died on it
                tail = err.read_text(errors="replace").strip().splitlines()[-1:] \
                    if err.exists() else []
                results[started] = died(started, f"worker died (exit status {p.returncode})"
                                        + (f": {tail[0][:200]}" if tail else ""))
            rest = [k for k in todo if k not in results]
            if started is None and rest == todo:  # it ran none of its keys: it would again
                raise SystemExit(f"{label} worker ran none of its keys (exit {p.returncode});"
                                 f" see {tmp}")
            if rest:
                launch(rest)
        if time.monotonic() - last_read > 5:  # results so far of the running workers
            last_read = time.monotonic()
            for _, out, _, _ in procs:
                _read_worker(out, results)
        if progress is not None and time.monotonic() - last_write > 60:
            last_write = time.monotonic()
            progress([results[k] for k in keys if k in results])
        if not quiet and len(results) != shown:
            shown = len(results)
            print(f"\r{shown}/{len(keys)} {label}", end="", file=sys.stderr, flush=True)
    if not quiet:
        print(file=sys.stderr)
    shutil.rmtree(tmp, ignore_errors=True)
    return [results[k] for k in keys if k in results]


def _run_workers(args: argparse.Namespace, keys: list[str],
                 progress: Any = None) -> list[dict[str, Any]]:
    def command(ids: Path, out: Path) -> list[str]:
        cmd = [sys.executable, "-m", "torchport.tools.conformance", "--worker",
               "--backend", args.backend,
               "--worker-ids", str(ids), "--worker-out", str(out),
               "--dtypes", ",".join(args.dtypes), "--op-timeout", str(args.op_timeout)]
        if args.ops:
            cmd += ["--ops", args.ops]
        if args.max_samples is not None:
            cmd += ["--max-samples", str(args.max_samples)]
        if args.no_grad:
            cmd.append("--no-grad")
        return cmd

    def died(key: str, why: str) -> dict[str, Any]:
        oid = key.split(":", 1)[1]
        return apply_known({"id": oid, "name": oid, "dtypes": {}, "grad": {}, "paths": {},
                            "key": key, "error": why})

    return run_worker_pool(keys, args.jobs, command, died, worker_env(args), label="OpInfos",
                           quiet=args.quiet, progress=progress)


def worker_path(env: dict[str, str]) -> str:
    """``PYTHONPATH`` for worker processes: this torchport first, then the current directory
    (where a ``--backend`` module path is found), then the caller's."""
    import torchport

    here = str(Path(torchport.__file__).resolve().parents[1])
    return os.pathsep.join(filter(None, [here, os.getcwd(), env.get("PYTHONPATH")]))


def _read_worker(out: Path, results: dict[str, dict[str, Any]]) -> str | None:
    """Add the finished results of a worker's output file to ``results``; return the key
    of the OpInfo it started last and did not finish (``None`` if none)."""
    started = None
    if not out.exists():
        return None
    for line in out.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line being written
            break
        if "start" in rec:
            started = rec["start"]
        else:
            results[rec["result"]["key"]] = rec["result"]
            started = None
    return started
