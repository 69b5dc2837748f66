"""Asynchronous streams under stress: memory freed while queued work reads it, a bounded
queue, Ctrl-C, failures nobody synchronised, backward in threads on both devices.

Each test runs a fresh interpreter, since the sim's mode is chosen at import."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.helpers import MODE_VARIABLES, ROOT, child_env, run_python
from torchport.core import native

MODES = {"async": {"TORCHPORT_SIM_ASYNC": "1"},
         "strict-async": {"TORCHPORT_SIM_ASYNC": "1", "TORCHPORT_SIM_STRICT": "1"},
         "sync": {}}


def _env(mode: str) -> dict[str, str]:
    variables = {"TORCHPORT_SIM_STRICT": "1"} if mode == "strict" else MODES[mode]
    return child_env(drop=(*MODE_VARIABLES, "TORCHPORT_LAUNCH_BLOCKING"), importable=True,
                     **variables)


def _python(code: str, mode: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return run_python(code, env=_env(mode), timeout=timeout)


# synchronous: make test leaves it to make stress (``slow``), which runs this module and
# tests.stress_async longer in every mode
@pytest.mark.parametrize("mode", [pytest.param(m, marks=pytest.mark.slow) if m == "sync" else m
                                  for m in MODES])
def test_random_programs_in_threads_match_the_cpu(mode: str) -> None:
    """Frees while the queued reads are pending, random factories computed by the host,
    host-computed results, copies and training steps in three threads on two devices:
    every result is the CPU's."""
    r = subprocess.run([sys.executable, "-m", "tests.stress_async", "--threads", "3",
                        "--steps", "150"], env=_env(mode), capture_output=True, text=True,
                       timeout=600, cwd=ROOT)
    assert r.returncode == 0 and "wrong 0 of 450" in r.stdout, r.stdout + r.stderr


def test_a_freed_block_waits_for_the_queued_reads_whatever_writes_it_next() -> None:
    """The one-thread reproduction: a sum still queued reads ``y`` after ``del y``; a
    random factory (computed by the host, written without queueing) must not get that
    memory before the sum ran."""
    r = _python("""
        import torch, torchport.sim
        x = torch.arange(1 << 18, dtype=torch.float32, device="sim") % 7
        want = ((x.cpu() * 3).sum()).item()
        wrong = 0
        for i in range(60):
            big = torch.randn(256, 256, device="sim")
            for _ in range(4):
                big = big @ big  # keep the stream busy
            y = x * 3
            z = y.sum()
            del y
            torch.rand(1 << 18, device="sim")
            wrong += z.item() != want
        print("wrong", wrong)
    """, "strict-async")  # (the default mode adopts a host result's memory: no reuse)
    assert r.returncode == 0 and "wrong 0" in r.stdout, r.stdout + r.stderr


def test_the_host_waits_when_a_stream_holds_too_many_launches() -> None:
    r = _python("""
        import torch, torchport.sim
        from torchport.backends.sim.runtime import MAX_QUEUED
        rt = torchport.sim.BACKEND.runtime
        a = torch.randn(32, 32, device="sim")
        most = 0
        for _ in range(2 * MAX_QUEUED):
            a = (a @ a).tanh()
            most = max(most, rt.queued(0))
        torch.sim.synchronize()
        print("most", most, "limit", MAX_QUEUED)
        assert 0 < most <= MAX_QUEUED + 8, most
    """, "async")
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.skipif(not hasattr(signal, "SIGINT") or sys.platform == "win32",
                    reason="POSIX signals")
def test_ctrl_c_abandons_queued_work() -> None:
    """SIGINT while the host queues slow kernels: the process ends with the interrupt,
    without running what it had queued (it used to run for tens of seconds more)."""
    code = """
        import signal
        # a terminal's Ctrl-C: a shell's background job (make test's stages) starts its
        # children with SIGINT ignored, and Python then installs no handler of its own
        signal.signal(signal.SIGINT, signal.default_int_handler)
        import torch, torchport.sim
        a = torch.randn(384, 384, device="sim")
        for i in range(10 ** 6):
            a = (a @ a).tanh()
            if i == 300:
                print("queued", flush=True)
    """
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=_env("async"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "queued"
        time.sleep(3.0)
        p.send_signal(signal.SIGINT)
        # the loop queues without end: a process that ran what it queued would never end
        _, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode != 0 and "KeyboardInterrupt" in err, err[-2000:]


# Ctrl-C (a KeyboardInterrupt the runtime raises once, as a SIGINT arriving there would)
# inside Python that the C++ library called: a block's free from a storage's deleter (an
# event recorded), an allocation, an event wait, the profiler's event, a fallback call's copy.
# Each loop must stop with KeyboardInterrupt, and the memory of what it made must all return.
_INTERRUPTED_CALLBACK = """
    import signal, sys, torch
    from torch.profiler import ProfilerActivity, profile
    from torchport.backends.sim import SimRuntime
    signal.signal(signal.SIGINT, signal.default_int_handler)  # (a background job ignores it)
    where, scenario = sys.argv[1], sys.argv[2]
    armed, calls = [False], [0]
    def raising_once(original):
        def once(*args):
            calls[0] += armed[0]
            if calls[0] == 2:
                raise KeyboardInterrupt
            return original(*args)
        return once
    # the C++ library takes the runtime's copies as the device registers (its Python ones:
    # the strict sim's C copies would call no Python)
    owner = SimRuntime if scenario == "fallback" else None
    if owner is not None:
        original = getattr(owner, where)
        setattr(owner, where, raising_once(original))
        SimRuntime.native_copies = lambda self: None
    import torchport.sim
    rt = torchport.sim.BACKEND.runtime
    if owner is None:
        owner, original = rt, getattr(rt, where)
        setattr(rt, where, raising_once(original))
    if scenario == "fallback":  # its first call teaches C++'s fallback, which serves the rest
        torch.hypot(torch.ones(3, device="sim"), torch.ones(3, device="sim"))
    armed[0] = True
    a = torch.randn(64, 64, device="sim")
    side = torch.sim.Stream()
    try:
        for i in range(300):
            if scenario == "side-steps":
                with torch.sim.stream(side):
                    a = (a @ a).tanh()
            elif scenario == "grow":
                b = torch.ones(1 << (10 + i % 10), device="sim")
            elif scenario == "fallback":
                b = torch.hypot(a, a)
            elif scenario == "event":
                e = torch.Event(device="sim")
                e.record()
                e.synchronize()
            elif scenario == "profile":
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]):
                    (a + 1).sum()
        print("not interrupted")
    except KeyboardInterrupt as e:
        print("interrupted", type(e.__context__).__name__)
    setattr(owner, where, original)
    a = b = e = None
    torch.sim.synchronize()
    print("allocated", torch.sim.memory_allocated())
"""


# (callback, scenario, the sim modes it is checked in): make test checks each callback in its
# first mode, make stress in all of them (the later ones are marked slow)
_CALLBACK_CASES = [
    # a storage's deleter frees its block: the stream is queried, an event made and recorded
    # (through the stream layer on a side stream; on a default stream whose queue is C++'s
    # the block keeps the queue's last ticket, without Python)
    ("query_stream", "side-steps", ("async",)),
    ("record_event", "side-steps", ("async", "strict-async")),
    ("malloc", "grow", ("sync", "async")),
    ("synchronize_event", "event", ("sync", "async")),
    ("record_event", "profile", ("sync",)),
    # a warm CPU-fallback call on device-only memory: C++ copies through the runtime
    ("copy_d2h", "fallback", ("strict",)),
    ("copy_h2d", "fallback", ("strict",)),
]


@pytest.mark.skipif(native.loaded() is None, reason="callbacks of the C++ library")
@pytest.mark.parametrize("where,scenario,mode", [
    pytest.param(where, scenario, mode, marks=[pytest.mark.slow] if i else [],
                 id=f"{where}-{scenario}-{mode}")
    for where, scenario, modes in _CALLBACK_CASES for i, mode in enumerate(modes)])
def test_ctrl_c_inside_a_callback_of_the_cpp_library_stops_the_program(
        where: str, scenario: str, mode: str) -> None:
    """The interrupt is raised again once the callback has returned, where the caller's
    Python runs (it used to become a RuntimeError, or, in a deleter, to be printed and
    lost: the program went on, the freed block neither in use nor free)."""
    r = run_python(_INTERRUPTED_CALLBACK, args=[where, scenario], env=_env(mode))
    assert r.returncode == 0, mode + r.stdout + r.stderr
    assert "interrupted NoneType" in r.stdout and "allocated 0" in r.stdout \
        and "Exception ignored" not in r.stderr, mode + r.stdout + r.stderr


# SIGINT arriving as the C++ library enters a Python callback: after any check C++ can make,
# before the callback's first bytecode, where Python would raise it and the C function
# pointer's caller (ctypes) could only print and drop it. A profile function (it runs as a
# frame starts, before its first bytecode) raises the real signal there, once.
_SIGNAL_AT_CALLBACK_ENTRY = """
    import signal, sys, torch, torchport.sim
    signal.signal(signal.SIGINT, signal.default_int_handler)
    filename, name, scenario = sys.argv[1], sys.argv[2], sys.argv[3]
    a = torch.randn(64, 64, device="sim")
    fired = []
    def at_entry(frame, event, arg):
        code = frame.f_code
        if event == "call" and not fired and code.co_name == name \\
                and code.co_filename.endswith(filename):
            fired.append(code.co_name)
            signal.raise_signal(signal.SIGINT)
    side = torch.sim.Stream()
    try:
        sys.setprofile(at_entry)
        for i in range(300):
            if scenario == "side-steps":
                with torch.sim.stream(side):
                    a = (a @ a).tanh()
            elif scenario == "grow":
                b = torch.ones(1 << (10 + i % 10), device="sim")
        sys.setprofile(None)
        print("not interrupted", fired)
    except KeyboardInterrupt:
        sys.setprofile(None)
        print("interrupted", fired)
    a = b = None
    torch.sim.synchronize()
    print("allocated", torch.sim.memory_allocated())
"""


@pytest.mark.skipif(native.loaded() is None, reason="callbacks of the C++ library")
@pytest.mark.parametrize("filename,name,scenario,mode", [
    # the stream layer's entry (a deleter's free: the stream queried, an event recorded)
    ("streams.py", "call", "side-steps", "async"),
    # the C++ caching allocator's segment allocation
    ("native_allocator.py", "call", "grow", "sync"),
])
def test_ctrl_c_as_the_cpp_library_enters_a_callback_stops_the_program(
        filename: str, name: str, scenario: str, mode: str) -> None:
    """The signal is held until the callback has returned, then raised in the caller's
    Python (it was raised at the callback's first bytecode: printed as "Exception ignored
    on calling ctypes callback function" and lost, the loop went on)."""
    r = run_python(_SIGNAL_AT_CALLBACK_ENTRY, args=[filename, name, scenario], env=_env(mode))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"interrupted ['{name}']" in r.stdout and "allocated 0" in r.stdout \
        and "Exception ignored" not in r.stderr, r.stdout + r.stderr


def test_a_failure_nobody_synchronised_is_reported_at_exit() -> None:
    r = _python("""
        import torch, torchport.sim
        x = torch.randn(4, device="sim")
        y = x.index_select(0, torch.tensor([10], device="sim"))  # fails on the stream
        print("queued")
    """, "async")
    assert r.returncode == 0 and "queued" in r.stdout, r.stdout + r.stderr
    assert "index_select" in r.stderr and "failed asynchronously" in r.stderr \
        and "IndexError" in r.stderr, r.stderr


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_backward_in_threads_on_both_devices(mode: str) -> None:
    import torchport.sim  # noqa: F401
    from torchport.core import native
    if native.loaded() is None:
        pytest.skip("the C++ device guard is not built: autograd's device threads "
                    "serve device 0 only")
    r = _python("""
        import threading, torch, torchport.sim
        results = {}
        def work(dev):
            x = torch.randn(32, 32, generator=torch.Generator().manual_seed(0))
            xd = x.to(dev).requires_grad_()
            (xd.tanh() * xd).sum().backward()
            xc = x.clone().requires_grad_()
            (xc.tanh() * xc).sum().backward()
            results[dev] = torch.equal(xd.grad.cpu(), xc.grad)
        ts = [threading.Thread(target=work, args=(d,)) for d in ("sim:1", "sim:0", "sim:1")]
        for t in ts: t.start()
        for t in ts: t.join()
        print(results)
        assert results == {"sim:0": True, "sim:1": True}
    """, mode)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("processes", [3, pytest.param(12, marks=pytest.mark.slow)])
def test_processes_ending_right_after_backward_exit_cleanly(processes: int) -> None:
    """The last backward's device threads may still hold its Python objects when the
    script ends (PyTorch's engine; an abort in finalization without torchport's exit
    handler, about 1 run in 8 here): every process exits 0 (make stress runs 12)."""
    import torchport.sim  # noqa: F401
    from torchport.core import native
    if native.loaded() is None:
        pytest.skip("the C++ device guard is not built: backward runs in the calling thread")
    code = textwrap.dedent("""
        import sys, torch, torchport.sim
        x = torch.randn(64, 64, device="sim:1", requires_grad=True)
        y = torch.randn(64, 64, device="sim:0", requires_grad=True)
        sys.setswitchinterval(1000)  # this thread keeps the GIL to the end
        for _ in range(3):
            ((x.tanh() * x).sum() + (y * y).sum().to("sim:1")).backward()
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code], env=_env("sync"), cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(processes)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
