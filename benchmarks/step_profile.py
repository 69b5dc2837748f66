"""Where a training step's extra time goes: a sampling profile of the sim's step and the CPU's.

``models.py`` says how much slower a step is; this says in what. Each side runs one case
of ``models.py`` in a child process, and Linux ``perf`` samples it (software clock, no call
graphs) once it is warm: ``--rounds`` windows of ``--seconds`` each, the two sides
alternating (the other one stopped), so that a machine changing speed hits both alike.
Printed, in ms per step: the time of each library on the main thread and on PyTorch's
intra-op worker threads (a worker spinning in ``libgomp`` waits for the main thread's next
parallel kernel), then the main thread's symbols whose time differs most.

    .venv/bin/python benchmarks/step_profile.py [--case transformer-large] [--rounds 6]

Needs ``perf`` on PATH and leave to attach to a process (root, or
``kernel.perf_event_paranoid`` <= 1).
"""

from __future__ import annotations

import argparse
import collections
import mmap
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_ROW = re.compile(r"\s*(\d+)\s+(\d+):\S+\s+(\S+)\s+\[.\]\s+(.*)")
_FREQ = 999


def _child(case_name: str, device: str, counter: str) -> None:
    """Warm up, then step until killed, the step count in ``counter`` (8 bytes)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from models import CASES, make_step

    step = make_step(next(c for c in CASES if c.name == case_name), device)
    for _ in range(10):
        step()
    with open(counter, "r+b") as f:
        count = mmap.mmap(f.fileno(), 8)
    n = 1
    while True:  # the parent reads the count while this process is stopped
        step()
        struct.pack_into("q", count, 0, n)
        n += 1


class _Side:
    """One device's child process, stopped between the windows that sample it."""

    def __init__(self, case_name: str, device: str, tmp: str) -> None:
        self.device, self.tmp, self.windows = device, tmp, 0
        path = f"{tmp}/{device}.count"
        Path(path).write_bytes(bytes(8))
        with open(path, "r+b") as f:
            self.count = mmap.mmap(f.fileno(), 8)
        self.proc = subprocess.Popen([sys.executable, __file__, "--child", case_name, device,
                                      path])
        self.steps, self.seconds = 0, 0.0

    def steps_done(self) -> int:
        if self.proc.poll() is not None:
            sys.exit(f"the {self.device} child failed")
        return struct.unpack_from("q", self.count, 0)[0]

    def sample(self, seconds: float) -> None:
        """Run for a window of ``seconds`` under ``perf``, then stop again."""
        before = self.steps_done()
        self.proc.send_signal(signal.SIGCONT)
        t0 = time.perf_counter()
        subprocess.run(["perf", "record", "-q", "-F", str(_FREQ), "-e", "cpu-clock",
                        "-p", str(self.proc.pid), "-o", f"{self.tmp}/{self.device}.{self.windows}",
                        "--", "sleep", str(seconds)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.proc.send_signal(signal.SIGSTOP)
        self.seconds += time.perf_counter() - t0
        self.steps += self.steps_done() - before
        self.windows += 1

    def profile(self) -> collections.Counter:
        """``(thread, library, symbol) -> ms per step`` over the windows: the samples
        scaled so that the main thread's (always running) add up to the mean step."""
        out: collections.Counter = collections.Counter()
        for w in range(self.windows):
            report = subprocess.run(
                ["perf", "report", "-i", f"{self.tmp}/{self.device}.{w}", "--no-children",
                 "-g", "none", "--sort", "pid,dso,sym", "-F", "sample,pid,dso,sym", "--stdio"],
                capture_output=True, text=True, check=True).stdout
            for line in report.splitlines():
                m = _ROW.match(line)
                if m:
                    thread = "main" if int(m.group(2)) == self.proc.pid else "workers"
                    out[(thread, m.group(3), _short(m.group(4)))] += int(m.group(1))
        main = sum(n for key, n in out.items() if key[0] == "main")
        scale = 1e3 * self.seconds / self.steps / main
        return collections.Counter({key: n * scale for key, n in out.items()})


def _short(symbol: str) -> str:
    """A symbol as a line: ATen's elementwise loops (a long template) by their kernel."""
    m = re.search(r"native::(?:\w+::|\(anonymous namespace\)::)*(\w+_kernel\w*)\(", symbol)
    if "callback_fn" in symbol and m:
        return f"elementwise loop of {m.group(1)}"
    return symbol[:100]


def _by(prof: collections.Counter, thread: str, level: int) -> collections.Counter:
    agg: collections.Counter = collections.Counter()
    for key, ms in prof.items():
        if key[0] == thread:
            agg[key[level]] += ms
    return agg


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", default="transformer-large")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--seconds", type=float, default=2.0, help="one window")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        _child(*args.child)
        return
    if shutil.which("perf") is None:
        sys.exit("step_profile.py needs Linux perf on PATH (e.g. apt install linux-tools-generic)")
    with tempfile.TemporaryDirectory() as tmp:
        sides = [_Side(args.case, d, tmp) for d in ("cpu", "sim")]
        try:
            for side in sides:  # warm: the first step counted
                while side.steps_done() == 0:
                    time.sleep(0.05)
                side.proc.send_signal(signal.SIGSTOP)
            for r in range(args.rounds):
                for side in (sides if r % 2 == 0 else sides[::-1]):
                    side.sample(args.seconds)
            cpu, sim = (side.profile() for side in sides)
        finally:
            for side in sides:
                side.proc.kill()
                side.proc.send_signal(signal.SIGCONT)
                side.proc.wait()
    cpu_ms, sim_ms = (1e3 * s.seconds / s.steps for s in sides)
    print(f"{args.case}: step {cpu_ms:.2f} ms on the CPU, {sim_ms:.2f} on the sim "
          f"({sim_ms / cpu_ms:.2f}x) in the sampled windows "
          f"({args.rounds} x {args.seconds:g} s each); ms per step")
    for thread in ("main", "workers"):
        c, s = _by(cpu, thread, 1), _by(sim, thread, 1)
        print(f"\n{thread} thread{'s' if thread == 'workers' else ''}, by library:")
        print(f"{'cpu':>9}{'sim':>9}{'sim-cpu':>9}  library")
        for lib in sorted(set(c) | set(s), key=lambda k: -(c[k] + s[k]))[:10]:
            print(f"{c[lib]:9.2f}{s[lib]:9.2f}{s[lib] - c[lib]:9.2f}  {lib}")
        print(f"{sum(c.values()):9.2f}{sum(s.values()):9.2f}"
              f"{sum(s.values()) - sum(c.values()):9.2f}  (all)")
    c, s = _by(cpu, "main", 2), _by(sim, "main", 2)
    ranked = sorted(set(c) | set(s), key=lambda k: s[k] - c[k])
    print("\nmain thread, symbols with the largest differences:")
    print(f"{'cpu':>9}{'sim':>9}{'sim-cpu':>9}  symbol")
    for sym in ranked[::-1][:args.top] + ranked[:args.top // 3]:
        print(f"{c[sym]:9.2f}{s[sym]:9.2f}{s[sym] - c[sym]:9.2f}  {sym}")


if __name__ == "__main__":
    main()
