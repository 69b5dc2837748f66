"""``python -m torchport.tools.fuzz``: generate, run, compare, summarise, minimise.

    python -m torchport.tools.fuzz --seed 0 --n 200 --modes default,strict,async \\
        --jobs 2 --out fuzz-out --minimise
    python -m torchport.tools.fuzz --backend torchport.backends.reference --n 300

``--backend MODULE`` runs the programs on the device that MODULE registers (as ``torchport
run -b`` takes it) instead of the sim modes. Such a backend computes with kernels of its own
and PyTorch's decompositions, which round otherwise than the CPU's, so there every
floating-point value compares within ``torch.testing.assert_close``'s default tolerances
for its dtype (integers, booleans, shapes, dtypes, strides, errors and warnings still
exactly); sim runs the CPU's kernels and compares bit for bit.

Prints programs run per mode and the differences by class (each marked known-open or
unexplained), writes ``summary.json`` and, with ``--minimise``, one minimised repro script
per class to ``--out``. Exit code 1 when a difference is unexplained.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchport.tools.fuzz.generator import Program, generate
from torchport.tools.fuzz.known import backend_explained, classify, excluder, known_open
from torchport.tools.fuzz.minimise import in_workers, minimise, write_repro
from torchport.tools.fuzz.runner import BACKENDS, MODES, Result, Worker, add_backend, run_one


@dataclass
class Finding:
    """One class of difference in one mode: how often, the first program showing it."""

    mode: str
    cls: str
    known: str | None
    count: int = 0
    first: Program | None = None
    detail: str = ""
    repro: str = ""


@dataclass
class Summary:
    """A fuzzing run's outcome."""

    seed: int
    n: int
    modes: list[str]
    runs: Counter = field(default_factory=Counter)  # mode -> programs compared
    clean: Counter = field(default_factory=Counter)
    skipped: Counter = field(default_factory=Counter)  # the CPU run failed
    findings: dict[tuple[str, str, str | None], Finding] = field(default_factory=dict)
    skips: dict[str, str] = field(default_factory=dict)  # program -> why the CPU run failed
    seconds: float = 0.0

    @property
    def unexplained(self) -> list[Finding]:
        return [f for f in self.findings.values() if f.known is None]

    def add(self, r: Result) -> None:
        if r.skipped:
            self.skipped[r.mode] += 1
            self.skips.setdefault(r.program.name, r.skipped)
            return
        self.runs[r.mode] += 1
        if not r.diffs:
            self.clean[r.mode] += 1
            return
        first = r.diffs[0]
        cls = classify(first)
        entry = known_open(first["tag"], r.mode)
        if entry is None and first["kind"] in ("crash", "hang"):
            # a crash after a step of a known bug (a wrong out= corrupts memory): that bug
            for step in r.program.steps[:first["k"] + 1]:
                entry = entry or known_open(step.tag, r.mode)
        known = entry.id if entry else None
        if known is None and r.mode in BACKENDS:  # by design on a backend of its own kernels
            known = backend_explained(first, [s.tag for s in r.program.steps])
        f = self.findings.setdefault((r.mode, cls, known), Finding(
            r.mode, cls, known, first=r.program,
            detail=f"program {r.program.name} step {first['k']}: {first['detail']}"))
        f.count += 1

    def report(self) -> str:
        lines = [f"fuzz seed={self.seed} n={self.n} modes={','.join(self.modes)} "
                 f"({self.seconds:.0f} s)",
                 f"{'mode':8} {'programs':>8} {'clean':>6} {'differ':>6} {'known':>6} "
                 f"{'unexpl.':>7} {'skipped':>7}"]
        for m in self.modes:
            fs = [f for f in self.findings.values() if f.mode == m]
            known = sum(f.count for f in fs if f.known)
            unexp = sum(f.count for f in fs if not f.known)
            lines.append(f"{m:8} {self.runs[m]:>8} {self.clean[m]:>6} {known + unexp:>6} "
                         f"{known:>6} {unexp:>7} {self.skipped[m]:>7}")
        for name, why in list(self.skips.items())[:5]:
            lines.append(f"  skipped {name}: {why[:300]}")
        if self.findings:
            lines.append("differences by class (first difference of each program):")
            for f in sorted(self.findings.values(), key=lambda f: (f.known is not None,
                                                                   f.mode, -f.count)):
                mark = "UNEXPLAINED" if not f.known else f"explained {f.known}" \
                    if f.mode in BACKENDS else f"known-open {f.known}"
                lines.append(f"  [{f.mode}] {f.cls}  x{f.count}  {mark}")
                lines.append(f"      {f.detail[:300]}")
                if f.repro:
                    lines.append(f"      repro: {f.repro}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {"seed": self.seed, "n": self.n, "modes": self.modes, "runs": dict(self.runs),
                "clean": dict(self.clean), "skipped": dict(self.skipped),
                "seconds": round(self.seconds, 1), "skips": dict(self.skips),
                "findings": [{"mode": f.mode, "class": f.cls, "known": f.known,
                              "count": f.count, "detail": f.detail, "repro": f.repro,
                              "program": f.first.name if f.first else None}
                             for f in self.findings.values()]}


def workers_for(modes: list[str], timeout: float) -> dict[str | None, Worker]:
    """A CPU reference worker and one worker per mode (started on first use)."""
    ws: dict[str | None, Worker] = {None: Worker(None, timeout)}
    ws.update({m: Worker(m, timeout) for m in modes})
    return ws


def fuzz(seed: int, n: int, modes: list[str], jobs: int = 1, timeout: float = 60.0,
         exclude_known: bool = False, start: int = 0, progress: bool = False) -> Summary:
    """Run programs ``start .. start+n-1`` of ``seed`` on the CPU and in ``modes``, with
    ``jobs`` sets of workers side by side. ``exclude_known``: draw no step that an open
    known bug of any of the modes would fail."""
    summary = Summary(seed, n, modes)
    t0 = time.monotonic()
    exclude = excluder(modes[0] if len(modes) == 1 else None) if exclude_known \
        else (lambda tag: False)
    lock = threading.Lock()
    next_index = [start]

    def loop() -> None:
        ws = workers_for(modes, timeout)
        try:
            while True:
                with lock:  # generation runs CPU ops and seeds torch: one at a time
                    i = next_index[0]
                    if i >= start + n:
                        return
                    next_index[0] += 1
                    program = generate(seed, i, exclude)
                results = run_one(program, modes, ws)
                with lock:
                    for r in results:
                        summary.add(r)
                    done = next_index[0] - start
                if progress and done % 50 == 0:
                    differ = {m: summary.runs[m] - summary.clean[m]
                              for m in modes}
                    print(f"  ... {done}/{n} programs, {time.monotonic() - t0:.0f} s; "
                          f"differing: {differ}", file=sys.stderr, flush=True)
        finally:
            for w in ws.values():
                w.close()

    threads = [threading.Thread(target=loop) for _ in range(max(1, jobs))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    summary.seconds = time.monotonic() - t0
    return summary


def minimise_findings(summary: Summary, out: Path, timeout: float = 60.0,
                      unexplained_only: bool = False) -> None:
    """Shrink the first program of each class (one per class whatever the dtype and mode)
    and write its repro under ``out``."""
    modes = sorted({f.mode for f in summary.findings.values()})
    ws = workers_for(modes, timeout)
    seen: set[str] = set()
    try:
        for f in summary.findings.values():
            family = re.sub(r"@\S+", "", f.cls)  # one repro per class, whatever the dtype
            if f.first is None or (unexplained_only and f.known) or family in seen:
                continue
            seen.add(family)
            small = minimise(f.first, f.cls, in_workers(f.mode, ws))
            f.repro = str(write_repro(small, f.mode, f.cls, f.detail, out))
    finally:
        for w in ws.values():
            w.close()


def main(argv: list[str] | None = None) -> int:
    """The command line; exit code 1 when a difference is unexplained."""
    p = argparse.ArgumentParser(prog="python -m torchport.tools.fuzz", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n", type=int, default=200, help="programs per mode")
    p.add_argument("--start", type=int, default=0, help="first program index")
    p.add_argument("--modes", default="default,strict,async",
                   help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--backend", "-b", metavar="MODULE",
                   help="run on this backend's device instead of the sim modes (a "
                        "torchport.backends name or a module path); floating values compare "
                        "within the dtype's default tolerances")
    p.add_argument("--jobs", type=int, default=1, help="worker sets side by side")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per program (hang)")
    p.add_argument("--out", type=Path, default=Path("fuzz-out"))
    p.add_argument("--minimise", action="store_true", help="write a repro per class")
    p.add_argument("--exclude-known", action="store_true",
                   help="draw no steps of open known bugs (fuzz/known.py)")
    p.add_argument("--show", type=int, metavar="INDEX",
                   help="print program INDEX of --seed as a script and exit")
    a = p.parse_args(argv)
    if a.backend:
        try:
            modes = [add_backend(a.backend)]
        except RuntimeError as e:
            p.error(str(e))
    else:
        modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if a.show is not None:
        print(generate(a.seed, a.show).script(mode=modes[0], backend=a.backend))
        return 0
    bad = [m for m in modes if m not in MODES and not a.backend]
    if bad:
        p.error(f"unknown mode(s) {bad}; use {', '.join(MODES)}")
    summary = fuzz(a.seed, a.n, modes, a.jobs, a.timeout, a.exclude_known, a.start,
                   progress=True)
    if a.minimise and summary.findings:
        minimise_findings(summary, a.out, a.timeout)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "summary.json").write_text(json.dumps(summary.to_json(), indent=1))
    print(summary.report())
    return 1 if summary.unexplained else 0
