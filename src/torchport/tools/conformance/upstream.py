"""``torchport conformance --upstream DIR``: PyTorch's own device-generic test files, on the
CPU and on the backend's device, compared test by test.

PyTorch writes most of its device tests once, with ``instantiate_device_type_tests``, and
instantiates them per device type: out-of-tree backends check themselves with them. The
files come from a PyTorch source checkout the vendor points at (``DIR/test/``, or ``DIR``
itself; torchport ships none): each runs in two pytest processes, plain PyTorch on the CPU
and the backend's device (:mod:`torchport.tools.conformance.upstream_plugin`), outside the
checkout's own pytest configuration. A test that passes on the CPU and not on the device is
a finding; a test that fails on the CPU too says nothing about the device and is left out
of the count. Writes ``reports/upstream.{json,md}``; exit status 0 when no CPU-passing test
fails or errors on the device.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DEVICE_VARIABLE = "TORCHPORT_UPSTREAM_DEVICE"  # read by the plugin: cpu, or the backend
RESULTS_VARIABLE = "TORCHPORT_UPSTREAM_RESULTS"  # where the plugin writes its JSON lines
DEFAULT_FILES = ("test_view_ops.py", "test_ops.py", "test_modules.py")
_PLUGIN = "torchport.tools.conformance.upstream_plugin"


def test_dir(root: Path) -> Path:
    """Where a checkout keeps its test files: ``root/test`` (PyTorch's layout), or ``root``."""
    return root / "test" if (root / "test").is_dir() else root


def _env(device: str, results: Path) -> dict[str, str]:
    """A run's environment: no backend autoloaded, no device filter of the caller's; this
    torchport, and the working directory (where a ``--backend`` module is found) unless it
    holds a ``torch`` package (a PyTorch checkout) that would shadow the installed one."""
    import torchport

    env = {k: v for k, v in os.environ.items()
           if k not in ("TORCHPORT_AUTOLOAD", "TORCHPORT_OP_STATS",
                        "PYTORCH_TESTING_DEVICE_ONLY_FOR", "PYTORCH_TESTING_DEVICE_EXCEPT_FOR")}
    here = str(Path(torchport.__file__).resolve().parents[1])
    cwd = os.getcwd()
    shadow = (Path(cwd) / "torch" / "__init__.py").exists()
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [here, None if shadow else cwd, env.get("PYTHONPATH")]))
    env.update({DEVICE_VARIABLE: device, RESULTS_VARIABLE: str(results),
                "TORCHPORT_FALLBACK_WARN": "0", "PYTHONDONTWRITEBYTECODE": "1",
                "PYTORCH_PRINT_REPRO_ON_FAILURE": "0"})
    return env


def _has_pytest_timeout() -> bool:
    import importlib.util

    return importlib.util.find_spec("pytest_timeout") is not None


def _command(file: Path, base: Path, work: Path, k: str | None, test_timeout: float
             ) -> list[str]:
    ini = work / "pytest.ini"
    if not ini.exists():  # pins the configuration: the checkout's pytest.ini stays out
        ini.write_text("[pytest]\n" + (f"timeout = {int(test_timeout)}\n"
                                       if test_timeout > 0 and _has_pytest_timeout() else ""))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest",
           "-c", str(ini), f"--rootdir={base}", "-p", _PLUGIN, str(file)]
    return cmd + (["-k", k] if k else [])


def read_results(path: Path) -> dict[str, dict[str, Any]]:
    """nodeid -> ``{"status": pass|fail|error|skip|xfail|crash, "message": ...}`` from a
    run's JSON lines; a test started and never reported crashed its process."""
    out: dict[str, dict[str, Any]] = {}
    if not path.exists():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue  # a line cut by the process's death
        if r["event"] == "start":
            out[r["nodeid"]] = {"status": "crash", "message": "the test process died here"}
        elif r["event"] == "report":
            cur = out.setdefault(r["nodeid"], {"status": "crash"})
            status = "xfail" if r.get("xfail") else \
                {"passed": "pass", "skipped": "skip", "failed": "fail"}[r["outcome"]]
            if r["when"] == "call":
                if cur["status"] != "error":
                    cur["status"] = status
            elif status == "fail":
                status = cur["status"] = "error"  # its setup or teardown failed
            elif status == "skip" and r["when"] == "setup":
                cur["status"] = "skip"
            else:
                continue
            if r.get("message"):
                cur["message"] = r["message"]
            elif status == cur["status"]:
                cur.pop("message", None)
    return out


def device_free(nodeid: str, device: str) -> str:
    """``file::TestFooCPU::test_x_cpu_float32`` -> ``file::TestFoo::test_x_DEV_float32``:
    the name a test has on every device."""
    parts = nodeid.split("::")
    if len(parts) >= 3:
        parts[-2] = re.sub(rf"(CPU|PRIVATEUSE1|{re.escape(device.upper())})$", "", parts[-2])
    tokens = list(re.finditer(rf"_(cpu|{re.escape(device)})(?=_|$)", parts[-1]))
    if tokens:
        t = tokens[-1]
        parts[-1] = parts[-1][:t.start()] + "_DEV" + parts[-1][t.end():]
    return "::".join(parts)


def compare(cpu: dict[str, dict[str, Any]], dev: dict[str, dict[str, Any]], device: str
            ) -> dict[str, Any]:
    """The CPU-passing tests' outcomes on the device (``missing``: not made for it), and
    the tests that run only on the device (skipped or absent on the CPU)."""
    c = {device_free(n, "cpu"): r for n, r in cpu.items()}
    d = {device_free(n, device): r for n, r in dev.items()}
    tests = {}
    for name in sorted(n for n, r in c.items() if r["status"] == "pass"):
        r = d.get(name, {"status": "missing", "message": f"not instantiated for {device}"})
        tests[name] = dict(r)
    only = {n: dict(r) for n, r in sorted(d.items())
            if n not in c or c[n]["status"] in ("skip", "xfail") and r["status"] != "skip"}
    counts = dict.fromkeys(("pass", "fail", "error", "crash", "skip", "xfail", "missing"), 0)
    for r in tests.values():
        counts[r["status"]] += 1
    return {"cpu_tests": len(c), "cpu_passing": len(tests), "device": counts, "tests": tests,
            "device_only": only}


def _run_file(file: Path, base: Path, work: Path, backend: str, device: str,
              k: str | None, timeout: float, test_timeout: float, parallel: bool,
              quiet: bool) -> dict[str, Any]:
    stem = file.name.removesuffix(".py")
    runs = {}
    procs = []
    t0 = time.perf_counter()
    for label, spec in (("cpu", "cpu"), (device, backend)):
        results = work / f"{stem}.{label}.jsonl"
        results.unlink(missing_ok=True)
        log = open(work / f"{stem}.{label}.log", "w", encoding="utf-8")  # noqa: SIM115
        p = subprocess.Popen(_command(file, base, work, k, test_timeout), cwd=work,
                             env=_env(spec, results), stdout=log, stderr=subprocess.STDOUT)
        procs.append((label, p, log, results))
        if not parallel:
            _wait(p, log, timeout)
    rcs = {}
    for label, p, log, results in procs:
        rcs[label] = _wait(p, log, timeout)
        runs[label] = read_results(results)
    out = compare(runs["cpu"], runs[device], device)
    out.update(file=file.name, returncodes=rcs, seconds=round(time.perf_counter() - t0, 1))
    for label, rc in rcs.items():
        if rc not in (0, 1, 5) and not runs[label]:  # 1: tests failed; 5: none collected
            tail = (work / f"{stem}.{label}.log").read_text(errors="replace")[-1500:]
            out.setdefault("process_errors", {})[label] = f"exit {rc}: {tail.strip()}"
    if not quiet:
        n = out["device"]
        print(f"{file.name}: {out['cpu_passing']} of {out['cpu_tests']} tests pass on the CPU; "
              f"on {device}: {n['pass']} pass, {n['fail']} fail, {n['error'] + n['crash']} "
              f"error, {n['skip'] + n['xfail']} skip, {n['missing']} missing; "
              f"{len(out['device_only'])} {device}-only", flush=True)
        for label, err in out.get("process_errors", {}).items():
            print(f"{file.name}: the {label} run failed, {err.splitlines()[0]} (its log: "
                  f"{work / f'{stem}.{label}.log'})", flush=True)
    return out


def _wait(p: subprocess.Popen[Any], log: Any, timeout: float) -> int:
    try:
        rc = p.wait(timeout=timeout if timeout > 0 else None)
    except subprocess.TimeoutExpired:
        p.kill()
        rc = p.wait()
        log.write(f"\n[torchport] killed after {timeout:.0f}s\n")
    log.close()
    return rc


def totals(files: list[dict[str, Any]]) -> dict[str, int]:
    out = {"cpu_tests": 0, "cpu_passing": 0, "device_only": 0}
    for f in files:
        out["cpu_tests"] += f["cpu_tests"]
        out["cpu_passing"] += f["cpu_passing"]
        out["device_only"] += len(f["device_only"])
        for k, v in f["device"].items():
            out[k] = out.get(k, 0) + v
    return out


def summary_line(t: dict[str, int], device: str) -> str:
    return (f"upstream: {t['pass']} of {t['cpu_passing']} CPU-passing tests pass on {device} "
            f"({t['fail']} fail, {t['error'] + t['crash']} error, {t['skip'] + t['xfail']} "
            f"skip, {t['missing']} missing)")


def markdown(meta: dict[str, Any], files: list[dict[str, Any]], t: dict[str, int]) -> str:
    """The report a vendor can publish: the summary, per file, then every CPU-passing test
    that does not pass on the device, with its message."""
    dev = meta["device"]
    lines = [f"# PyTorch's device-generic tests on `{dev}`", "",
             f"PyTorch {meta['torch']}; test files from `{meta['upstream']}`"
             + (f" (`-k {meta['k']}`)" if meta.get("k") else "")
             + f"; backend `{meta['backend']}`. Each test ran on the CPU (plain PyTorch) and on "
             f"`{dev}`; tests that fail on the CPU are left out.", "",
             f"**{summary_line(t, dev)}**", "",
             f"| file | CPU tests | CPU-passing | pass on {dev} | fail | error | skip | "
             f"missing | {dev}-only |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
             "| ---: |"]
    for f in files:
        n = f["device"]
        lines.append(f"| {f['file']} | {f['cpu_tests']} | {f['cpu_passing']} | {n['pass']} | "
                     f"{n['fail']} | {n['error'] + n['crash']} | {n['skip'] + n['xfail']} | "
                     f"{n['missing']} | {len(f['device_only'])} |")
    for f in files:
        bad = [(name, r) for name, r in f["tests"].items() if r["status"] != "pass"]
        for label, rows in ((f"CPU-passing tests that do not pass on {dev}", bad),
                            (f"{dev}-only tests", list(f["device_only"].items()))):
            if not rows:
                continue
            lines += ["", f"## {f['file']}: {label}", "", "| test | result | message |",
                      "| --- | --- | --- |"]
            for name, r in rows:
                msg = (r.get("message") or "").replace("|", "\\|").replace("\n", " ")[:300]
                lines.append(f"| `{name.split('::', 1)[-1]}` | {r['status']} | {msg} |")
        for label, err in f.get("process_errors", {}).items():
            lines += ["", f"{f['file']} on {label}: the pytest process failed: "
                      f"`{err.splitlines()[0] if err else ''}`"]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace, device: str) -> int:
    """The ``--upstream`` run of the parsed command line (backend already loaded)."""
    import torch

    root = Path(args.upstream).expanduser()
    base = test_dir(root)
    names = args.upstream_files or [f for f in DEFAULT_FILES if (base / f).exists()]
    files = [base / n for n in names]
    missing = [str(f) for f in files if not f.is_file()]
    if not names or missing:
        print(f"{args.prog}: no test file {', '.join(missing) or ' / '.join(DEFAULT_FILES)} "
              f"in {base}; point --upstream at a PyTorch source checkout (or its test/ "
              "folder), --upstream-files names the files", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="torchport-upstream-"))
    t0 = time.perf_counter()
    results = [_run_file(f, base, work, args.backend, device, args.upstream_k,
                         args.upstream_timeout, args.op_timeout, args.jobs > 1, args.quiet)
               for f in files]
    t = totals(results)
    name = args.name
    meta = {"command": args.prog + " " + " ".join(args.argv), "torch": torch.__version__,
            "device": device, "backend": args.backend, "upstream": str(root),
            "files": names, "k": args.upstream_k, "work_dir": str(work),
            "seconds": round(time.perf_counter() - t0, 1)}
    (out / f"{name}.json").write_text(json.dumps(
        {"meta": meta, "totals": t, "files": results}, indent=1) + "\n", encoding="utf-8")
    (out / f"{name}.md").write_text(markdown(meta, results, t), encoding="utf-8")
    print(f"{summary_line(t, device)}; reports in {out}/{name}.{{json,md}}; logs in {work}")
    failed = t["fail"] + t["error"] + t["crash"]
    broken = any(r.get("process_errors") for r in results)
    return 1 if failed or broken else 0
