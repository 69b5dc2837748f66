"""Where an MLP training step's time goes on the OpenCL backend (device ``ocl``, PoCL's CPU
driver here), against the same step on the CPU: the step of ``opencl_ops.py`` (MLP
256-512-10, batch 128, AdamW, ``loss.backward()`` and ``opt.step()``).

``opencl_ops.py`` says how much slower the step is; this says in what. On a CPU driver the
device's worker threads share the cores with the host's, so the step's wall time is split
by thread CPU time (``/proc/self/task``, each thread's CPU clock): the calling thread, the
autograd engine's device thread (which runs the backward's kernels) and the driver's
threads (the device). Then, in instrumented rounds: the device time of the kernels and
copies (OpenCL queue profiling: each command's start to end), the time the host waits in
the runtime's blocking calls (wall minus thread CPU inside them) and how many it makes;
per ATen op the host time on both host threads (``torch.profiler``, self CPU time); and the
Python time per module (cProfile on both host threads). Plain rounds of ``--steps`` steps
alternate with the CPU's, so that a noisy neighbour hits both alike; figures are medians of
``--repeat`` rounds, ratios the median of the rounds' ocl/CPU ratios.

    OMP_NUM_THREADS=1 python benchmarks/opencl_step_profile.py [--steps 10] [--repeat 7]
        [--top 12]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import os
import pstats
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pyopencl as cl
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from opencl_ops import step_fn  # noqa: E402

import torchport  # noqa: E402
import torchport.opencl  # noqa: E402, F401  (registers ocl)
from torchport.backends.opencl import codegen  # noqa: E402

Step = Callable[[], None]


def thread_clock(tid: int) -> int:
    """The CPU-time clock of Linux thread ``tid`` (``pthread_getcpuclockid``'s encoding:
    CPUCLOCK_SCHED of a thread)."""
    return (~tid << 3) | 6


def threads() -> dict[int, str]:
    """This process's threads: Linux thread id -> name."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                out[int(tid)] = f.read().strip()
        except OSError:  # ended meanwhile
            pass
    return out


def autograd_threads(step: Step) -> set[int]:
    """The Linux ids of the threads that run ``step``'s backward (its saved tensors are
    unpacked there)."""
    seen: set[int] = set()

    def unpack(t: torch.Tensor) -> torch.Tensor:
        seen.add(threading.get_native_id())
        return t
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
        step()
    return seen


class Roles:
    """Which thread is which: the caller, the autograd engine's device thread(s), and the
    rest (the OpenCL driver's workers, on a CPU driver)."""

    def __init__(self, backward: set[int]) -> None:
        self.main = threading.get_native_id()
        self.backward = backward

    def role(self, tid: int) -> str:
        if tid == self.main:
            return "calling thread"
        return "autograd device thread" if tid in self.backward else "driver threads (device)"

    def cpu(self) -> dict[str, float]:
        """Seconds of CPU time per role so far."""
        out: dict[str, float] = collections.defaultdict(float)
        for tid in threads():
            try:
                out[self.role(tid)] += time.clock_gettime(thread_clock(tid))
            except OSError:
                pass
        return out


def plain_rounds(ocl: Step, cpu: Step, roles: Roles, steps: int, repeat: int
                 ) -> tuple[list[float], list[float], list[dict[str, float]]]:
    """Per round: ms per step on ``ocl`` (the queue finished) and on the CPU, the rounds
    alternating, and the ocl rounds' thread CPU ms per step by role."""
    ocl_ms, cpu_ms, split = [], [], []
    for _ in range(repeat):
        torch.ocl.synchronize()
        c0, t0 = roles.cpu(), time.perf_counter()
        for _ in range(steps):
            ocl()
        torch.ocl.synchronize()
        t1, c1 = time.perf_counter(), roles.cpu()
        ocl_ms.append((t1 - t0) / steps * 1e3)
        split.append({k: (c1[k] - c0.get(k, 0.0)) / steps * 1e3 for k in c1})
        t0 = time.perf_counter()
        for _ in range(steps):
            cpu()
        cpu_ms.append((time.perf_counter() - t0) / steps * 1e3)
    return ocl_ms, cpu_ms, split


class Instruments:
    """Queue-profiling events of every kernel, copy and fill, and the time the host spends
    in the runtime's calls that can block, while installed."""

    BLOCKING = ("synchronize_stream", "copy_h2d", "copy_d2h", "copy_d2d", "memset", "launch",
                "synchronize_event")

    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []
        self.waits: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])

    @contextmanager
    def installed(self) -> Iterator[None]:
        rt = torchport.current_backend().runtime
        run, copy, fill = codegen.Programs.run, cl.enqueue_copy, cl.enqueue_fill_buffer
        events = self.events

        def traced_run(programs: codegen.Programs, index: int, queue: Any, source: str,
                       size: Any, args: list[Any], local: Any = None) -> Any:
            k = programs.kernel(index, source)  # Programs.run, keeping the kernel's event
            with programs.lock:
                ev = k(queue, tuple(size), None if local is None else tuple(local), *args)
            events.append((k.function_name, ev))
            return ev

        def traced(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            def call(*args: Any, **kw: Any) -> Any:
                ev = fn(*args, **kw)
                if isinstance(ev, cl.Event):
                    events.append((name, ev))
                return ev
            return call

        def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            row = self.waits[name]

            def call(*args: Any, **kw: Any) -> Any:
                t0, c0 = time.perf_counter(), time.thread_time()
                try:
                    return fn(*args, **kw)
                finally:
                    row[0] += 1
                    row[1] += time.perf_counter() - t0
                    row[2] += time.thread_time() - c0
            return call

        codegen.Programs.run = traced_run  # type: ignore[method-assign]
        cl.enqueue_copy = traced("copy", copy)
        cl.enqueue_fill_buffer = traced("fill", fill)
        for name in self.BLOCKING:
            setattr(rt, name, timed(name, getattr(rt, name)))
        try:
            yield
        finally:
            codegen.Programs.run = run  # type: ignore[method-assign]
            cl.enqueue_copy, cl.enqueue_fill_buffer = copy, fill
            for name in self.BLOCKING:
                delattr(rt, name)

    def device_ms(self) -> dict[str, tuple[int, float]]:
        """Per command kind: count and device ms (start to end), after the queue finished;
        also the span from the first start to the last end (``busy span``)."""
        out: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
        starts, ends = [], []
        for name, ev in self.events:
            try:
                p = ev.profile
                p.start, p.end  # noqa: B018
            except cl.Error:  # a queue without profiling (the error word's reader)
                continue
            out[name][0] += 1
            out[name][1] += (p.end - p.start) / 1e6
            starts.append(p.start)
            ends.append(p.end)
        res = {k: (int(v[0]), v[1]) for k, v in out.items()}
        if starts:
            res["busy span"] = (len(starts), (max(ends) - min(starts)) / 1e6)
        return res


def instrumented(ocl: Step, steps: int) -> tuple[dict[str, tuple[int, float]],
                                                  dict[str, list[float]], float]:
    """Device ms per step of each kind of command, the runtime's blocking calls (count,
    wall ms, CPU ms per step) and the wall ms per step, over ``steps`` steps."""
    ins = Instruments()
    torch.ocl.synchronize()
    with ins.installed():
        t0 = time.perf_counter()
        for _ in range(steps):
            ocl()
        torch.ocl.synchronize()
        wall = (time.perf_counter() - t0) / steps * 1e3
    dev = {k: (n // steps, ms / steps) for k, (n, ms) in ins.device_ms().items()}
    waits = {k: [v[0] / steps, v[1] / steps * 1e3, v[2] / steps * 1e3]
             for k, v in ins.waits.items() if v[0]}
    return dev, waits, wall


def op_profile(step: Step, steps: int, sync: Callable[[], None]) -> dict[str, tuple[int, float]]:
    """Per ATen op: calls and self CPU ms per step on every host thread (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile
    sync()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        sync()
    return {e.key: (e.count // steps, e.self_cpu_time_total / 1e3 / steps)
            for e in prof.key_averages()}


def module_of(filename: str, name: str) -> str:
    """A cProfile entry's group: torchport's module, a package, or the builtin."""
    if "/torchport/" in filename:
        return "torchport/" + filename.split("/torchport/", 1)[1]
    if "site-packages/" in filename:
        return filename.split("site-packages/", 1)[1].split("/", 1)[0]
    if filename.startswith("<generated"):
        return "pyopencl kernel invokers (set args, enqueue)"
    if filename == "~":
        return f"builtin {name}"
    return os.path.basename(filename)


def python_profile(step: Step, steps: int) -> dict[str, float]:
    """Python time (cProfile's own time) per module, ms per step, on the calling thread
    and the autograd device thread (whose profiler starts at its first unpack)."""
    mine = cProfile.Profile()
    others: dict[int, cProfile.Profile] = {}
    stop = [False]

    def unpack(t: torch.Tensor) -> torch.Tensor:
        ident = threading.get_ident()
        if ident == threading.main_thread().ident:
            return t
        p = others.get(ident)
        if p is None and not stop[0]:
            p = others[ident] = cProfile.Profile()
            p.enable()
        elif p is not None and stop[0]:
            p.disable()
        return t
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
        step()  # starts the autograd thread's profiler
        torch.ocl.synchronize()
        mine.enable()
        for _ in range(steps):
            step()
        torch.ocl.synchronize()
        mine.disable()
        stop[0] = True
        step()  # stops it
        torch.ocl.synchronize()
    stats = pstats.Stats(mine)
    for p in others.values():
        stats.add(p)
    out: dict[str, float] = collections.defaultdict(float)
    for (filename, _line, name), (_cc, _nc, tt, _ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        out[module_of(filename, name)] += tt / steps * 1e3
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10, help="steps per round")
    p.add_argument("--repeat", type=int, default=7, help="rounds")
    p.add_argument("--top", type=int, default=12, help="rows of the per-op and per-module tables")
    args = p.parse_args()
    warnings.simplefilter("ignore")
    torchport.ops.set_fallback_warn(False)
    print(f"device: {torch.ocl.get_device_name(0)}; torch threads: {torch.get_num_threads()}; "
          f"cores: {os.cpu_count()}")
    ocl, cpu = step_fn("ocl", False), step_fn("cpu", False)
    for _ in range(3):
        ocl()
        cpu()
    torch.ocl.synchronize()
    roles = Roles(autograd_threads(ocl))
    torch.ocl.synchronize()

    ocl_ms, cpu_ms, split = plain_rounds(ocl, cpu, roles, args.steps, args.repeat)
    ratio = statistics.median(o / c for o, c in zip(ocl_ms, cpu_ms, strict=True))
    print(f"\nMLP 256-512-10, batch 128, AdamW step: ocl {statistics.median(ocl_ms):.2f} ms, "
          f"CPU {statistics.median(cpu_ms):.2f} ms, ratio {ratio:.1f} (medians of "
          f"{args.repeat} rounds of {args.steps} steps)\n")
    print("| ocl step, thread CPU | ms per step |\n|---|---:|")
    keys = sorted({k for s in split for k in s})
    host = 0.0
    for k in keys:
        v = statistics.median(s.get(k, 0.0) for s in split)
        host += v if k != "driver threads (device)" else 0.0
        print(f"| {k} | {v:.2f} |")
    print(f"| host threads together | {host:.2f} |")
    print(f"| wall | {statistics.median(ocl_ms):.2f} |")

    dev, waits, wall = instrumented(ocl, args.steps * 3)
    print(f"\nInstrumented ({args.steps * 3} steps, wall {wall:.2f} ms per step):\n")
    print("| device commands (queue profiling) | per step | device ms per step |\n"
          "|---|---:|---:|")
    total = 0.0
    for k, (n, ms) in sorted(dev.items(), key=lambda kv: -kv[1][1]):
        if k != "busy span":
            total += ms
            print(f"| {k} | {n} | {ms:.2f} |")
    print(f"| all commands | {sum(n for k, (n, _) in dev.items() if k != 'busy span')} | "
          f"{total:.2f} |")
    if "busy span" in dev:
        print(f"| first start to last end | | {dev['busy span'][1]:.2f} |")
    print("\n| runtime call that can block | calls per step | wall ms | CPU ms | "
          "waiting ms |\n|---|---:|---:|---:|---:|")
    for k, (n, w, c) in sorted(waits.items(), key=lambda kv: -kv[1][1]):
        print(f"| {k} | {n:.1f} | {w:.2f} | {c:.2f} | {w - c:.2f} |")
    print(f"| all | {sum(v[0] for v in waits.values()):.1f} | "
          f"{sum(v[1] for v in waits.values()):.2f} | {sum(v[2] for v in waits.values()):.2f} | "
          f"{sum(v[1] - v[2] for v in waits.values()):.2f} |")

    ocl_ops = op_profile(ocl, args.steps, torch.ocl.synchronize)
    cpu_ops = op_profile(cpu, args.steps, lambda: None)
    print("\n| ATen op (torch.profiler, both host threads) | ocl calls | ocl self CPU ms | "
          "CPU calls | CPU self CPU ms |\n|---|---:|---:|---:|---:|")
    rows = sorted(ocl_ops.items(), key=lambda kv: -kv[1][1])
    for k, (n, ms) in rows[: args.top]:
        cn, cms = cpu_ops.get(k, (0, 0.0))
        print(f"| {k} | {n} | {ms:.3f} | {cn} | {cms:.3f} |")
    rest = sum(ms for _, (_, ms) in rows[args.top:])
    print(f"| the other {max(len(rows) - args.top, 0)} ops | | {rest:.3f} | | |")
    print(f"| all ops | | {sum(ms for _, (_, ms) in rows):.3f} | | "
          f"{sum(ms for _, ms in cpu_ops.values()):.3f} |")

    mods = python_profile(ocl, args.steps)
    print("\n| Python time by module (cProfile, both host threads; inflated by the profiler) "
          "| ms per step |\n|---|---:|")
    ranked = sorted(mods.items(), key=lambda kv: -kv[1])
    for k, ms in ranked[: args.top]:
        print(f"| {k} | {ms:.2f} |")
    print(f"| the rest | {sum(ms for _, ms in ranked[args.top:]):.2f} |")


if __name__ == "__main__":
    main()
