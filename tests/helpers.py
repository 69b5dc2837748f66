"""Helpers shared by the test modules, so that no test module imports another.

Sections: child interpreters (a fresh process is how a test sets TORCHPORT_* variables read at
import), worker processes (another backend registered, running the test code sent to them),
sweeps of cases compared with the CPU, two-rank distributed workers, PyTorch's CPU/gloo reference run, the examples' printed
results, and a training loop whose float64 sums are exact (devices must equal the CPU bit
for bit). Nothing here imports torchport: child code imports it after its environment is set.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests import preloaded

ROOT = Path(__file__).resolve().parents[1]
MODE_VARIABLES = ("TORCHPORT_SIM_ASYNC", "TORCHPORT_SIM_STRICT")  # the sim's memory modes
IN_A_MEMORY_MODE = any(os.environ.get(v, "") not in ("", "0") for v in MODE_VARIABLES)
# A test of what the memory modes leave alone (what an import loads, settings read from the
# environment) in a module the modes' stages run: the default stage alone runs it.
mode_independent = pytest.mark.skipif(
    IN_A_MEMORY_MODE, reason="the memory mode changes nothing it checks (the default stage runs it)")


# ---- child interpreters ------------------------------------------------------------------

def child_env(drop: Iterable[str] = (), importable: bool = False, **env: str) -> dict[str, str]:
    """This process's environment without ``drop``, with ``env`` set; ``importable`` puts the
    worktree's ``src`` and the repository root (``tests``) first on PYTHONPATH, for a child
    that runs from another directory."""
    out = {k: v for k, v in os.environ.items() if k not in set(drop)}
    if importable:
        out["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), str(ROOT),
                                                          out.get("PYTHONPATH")]))
    out.update(env)
    return out


def run_python(code: str, *, args: Iterable[str] = (), timeout: float = 300,
               cwd: Path = ROOT, env: dict[str, str] | None = None, fresh: bool = False,
               **overrides: str) -> subprocess.CompletedProcess:
    """``python -c code *args`` (code dedented) in a fresh interpreter with ``env`` (default:
    this process's) plus ``overrides``, from the repository root (``tests`` importable), stdin
    empty; its result, output captured as text. Forked from a preloaded interpreter that has
    imported torch where that is the same (``tests/preloaded.py``), unless ``fresh``."""
    code, args = textwrap.dedent(code), [str(a) for a in args]
    env = {**(os.environ if env is None else env), **overrides}
    r = None if fresh else preloaded.run(code, args, env, str(cwd), timeout)
    if r is None:
        r = subprocess.run([sys.executable, "-c", code, *args], env=env, cwd=str(cwd),
                           stdin=subprocess.DEVNULL, capture_output=True, text=True,
                           timeout=timeout)
    return r


def check_python(code: str, **kw: Any) -> str:
    """:func:`run_python` that must exit 0; its stdout."""
    r = run_python(code, **kw)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    return r.stdout


def free_port() -> int:
    """A TCP port free now on the loopback interface (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- worker processes: test code run where another backend is registered -----------------

class Worker:
    """A process with another backend registered (one backend per process; the test process
    has the sim) that runs the test code sent to it: JSON lines ``{"code": ...}`` in,
    ``{"ok": bool, "error": traceback, "result": ...}`` out (:func:`serve` is that side, or
    tests/opencl_worker.py). ``args`` follow the interpreter; ``name`` names it in errors."""

    def __init__(self, args: list[str], env: dict[str, str], name: str) -> None:
        self.name = name
        self.proc = subprocess.Popen([sys.executable, *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        self._answer()  # {"ready": true}

    def run(self, code: str) -> object:
        """Run ``code`` in the worker; its exception fails the test with its traceback.
        Returns the value the code left in ``result`` (JSON), if any."""
        self.proc.stdin.write(json.dumps({"code": textwrap.dedent(code)}) + "\n")
        self.proc.stdin.flush()
        answer = self._answer()
        if not answer["ok"]:
            pytest.fail(answer["error"], pytrace=False)
        return answer.get("result")

    def _answer(self) -> dict:
        while True:  # skip what else the worker prints
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the {self.name} worker ended (exit {self.proc.wait()})")
            if line.startswith("{"):
                return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def serve(base: dict[str, Any], device: str, label: str,
          reset: Callable[[], None] = lambda: None) -> None:
    """A :class:`Worker`'s side, in the child that registered ``device``: each code sent runs
    in a fresh copy of ``base`` (its tensors die with it), seeded, between two ``reset()``
    calls; every device is synchronised after it, so no queued error goes unreported."""
    import traceback

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        code = json.loads(line)["code"]
        reset()
        namespace = dict(base)
        try:
            torch.manual_seed(0)
            exec(compile(code, label, "exec"), namespace)
            module = getattr(torch, device)
            for i in range(module.device_count()):
                module.synchronize(i)
            answer = {"ok": True, "result": namespace.get("result")}
            namespace.clear()
        except BaseException:  # reported to the test
            answer = {"ok": False, "error": traceback.format_exc()}
        reset()
        print(json.dumps(answer), flush=True)


def backend_worker(code: str, name: str) -> Worker:
    """A :class:`Worker` running ``python -c code`` (which registers a backend and calls
    :func:`serve`) in default memory, ``tests`` importable, one intra-op thread."""
    env = child_env(drop=("TORCHPORT_SIM_STRICT", "TORCHPORT_SIM_ASYNC", "TORCHPORT_AUTOLOAD",
                          "TORCHPORT_LAUNCH_BLOCKING"), importable=True, OMP_NUM_THREADS="1")
    return Worker(["-c", code], env, name)


# ---- sweeps: cases run on the CPU and on a device, differences printed ---------------------

def sweep(cases: dict[str, Callable[[str], Any]], device: str,
          differ: Callable[[Any, Any], str | None], *, rounds: int = 1,
          before: Callable[[], None] = lambda: None, cpu_may_refuse: bool = False) -> None:
    """Each case ``f`` of ``cases`` run as ``f("cpu")`` then ``f(device)`` (``before()``
    ahead of each call: a seed), ``rounds`` times (a later round runs every path already
    learnt); prints ``MISMATCH name: ...`` where the device raises or ``differ(got, want)``
    names a difference, then ``checked N`` (the cases compared, per round) once the device
    has synchronised. With ``cpu_may_refuse``, a case the CPU raises on has no reference
    and is left out; without, that error ends the sweep."""
    checked = 0
    for r in range(rounds):
        label = f" (round {r})" if rounds > 1 else ""
        checked = 0
        for name, f in cases.items():
            try:
                before()
                want = f("cpu")
            except Exception:
                if not cpu_may_refuse:
                    raise
                continue
            checked += 1
            try:
                before()
                got = f(device)
            except Exception as e:  # noqa: BLE001  (reported, then the next case)
                print(f"MISMATCH {name}{label}: raises {type(e).__name__}: {str(e)[:200]}")
                continue
            problem = differ(got, want)
            if problem:
                print(f"MISMATCH {name}{label}: {problem}")
    getattr(torch, device.split(":")[0]).synchronize()
    print(f"checked {checked}")


# ---- two-rank distributed workers ----------------------------------------------------------

WORLD = 2


def launch_workers(script: Path, scenario: str, extra_env: dict[str, str] | None = None,
                   timeout: float = 60.0) -> list[subprocess.CompletedProcess]:
    """Run ``script scenario <rank> <port>`` in WORLD processes; their results by rank. The
    default memory mode unless ``extra_env`` sets one."""
    port = free_port()
    env = child_env(drop=["TORCHPORT_SIM_STRICT"], **(extra_env or {}))
    procs = [subprocess.Popen([sys.executable, str(script), scenario, str(r), str(port)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in range(WORLD)]
    out = []
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            so, se = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{scenario}: workers hung for more than {timeout} s")
        out.append(subprocess.CompletedProcess(p.args, p.returncode, so, se))
    return out


def check_ranks(results: list[subprocess.CompletedProcess], ok_line: str | None = None) -> None:
    """Every rank exited 0 (teardown included) and, if given, printed ``ok_line``."""
    for r, res in enumerate(results):
        assert res.returncode == 0, f"rank {r} failed:\n{res.stdout}\n{res.stderr[-4000:]}"
        assert ok_line is None or ok_line in res.stdout, f"rank {r}: no {ok_line!r}:\n{res.stdout}"


def init_rank(rank: int, port: int, timeout_s: float = 30.0) -> tuple[Any, Any, torch.device]:
    """In a worker: join the sim group (simccl) of WORLD ranks; (torch, torch.distributed,
    this rank's device)."""
    from datetime import timedelta

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    import torch.distributed as dist

    import torchport.sim  # noqa: F401
    from torchport.distributed import init_device_from_env

    dev = init_device_from_env()
    assert dev == torch.device("sim", rank)
    dist.init_process_group(timeout=timedelta(seconds=timeout_s))  # no backend: simccl
    assert dist.get_world_size() == WORLD
    return torch, dist, dev


def ddp_mlp(unused: bool = False) -> nn.Module:
    """The distributed tests' model (seeded); ``unused`` adds a layer forward never calls."""
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 16)
            self.b = nn.Linear(16, 4)
            self.unused = nn.Linear(16, 4) if unused else None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.relu(self.a(x)))

    torch.manual_seed(1234)
    return Net()


def ddp_reference(steps: int, batches: list, unused: bool = False, micro: int = 1) -> nn.Module:
    """Single-process training on the concatenation of all ranks' batches (CPU)."""
    m = ddp_mlp(unused)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    for s in range(steps):
        for k in range(micro):
            x, y = (torch.cat([b[s][k][i] for b in batches]) for i in (0, 1))
            torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()
        opt.zero_grad()
    return m


# ---- PyTorch's CPU/gloo reference run -------------------------------------------------------

def run_gloo_reference(script: Path, args: list[str], cwd: Path, timeout: float = 120) -> str:
    """The stdout of ``python script *args`` (one rank, gloo, CPU, no TORCHPORT_* variable):
    the reference device results are checked against.

    Its teardown races in PyTorch 2.13: now and then it aborts after a complete run
    ("terminate called without an active exception"), or deadlocks (DDP's reducer may drop
    the last reference to the gloo process group while holding the GIL, and the group's
    worker threads then wait for the GIL to release their tensors, pytorch/pytorch#56297).
    So it runs in a subprocess, with a timeout, up to three times."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHPORT_")}
    env.update(MASTER_ADDR="127.0.0.1", PYTHONUNBUFFERED="1")
    for _ in range(3):
        env["MASTER_PORT"] = str(free_port())
        try:
            out = subprocess.run([sys.executable, str(script), *args], cwd=str(cwd), env=env,
                                 capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            continue
        if out.returncode == -signal.SIGABRT:
            continue
        assert out.returncode == 0, (script, out.stdout[-2000:], out.stderr[-4000:])
        return out.stdout
    raise AssertionError(f"the gloo reference run of {script.name} aborted or hung three times")


# ---- the examples' printed results ------------------------------------------------------------

def example_values(s: str) -> dict[str, str]:
    """``key value`` lines printed by the examples."""
    out = {}
    for line in s.splitlines():
        m = re.match(r"^(final loss|params checksum|probs checksum|accuracy|autocast dtype|"
                     r"predictions|world size|loaded epoch) (.*)$", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def save_as_cuda(obj: Any, f: Any) -> None:
    """``torch.save`` with sim storages tagged ``cuda:N``: what a GPU machine writes."""
    entry = (0, lambda s: f"cuda:{s.device.index}" if s.device.type == "sim" else None,
             lambda s, loc: None)
    torch.serialization._package_registry.insert(0, entry)
    try:
        torch.save(obj, f)
    finally:
        torch.serialization._package_registry.remove(entry)


# ---- training whose sums are exact -------------------------------------------------------------

class ExactNet(nn.Module):
    """Two linear layers and a buffer (broadcast to DataParallel's replicas without gradients)."""

    def __init__(self, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 6, dtype=dtype)
        self.fc2 = nn.Linear(6, 2, dtype=dtype)
        self.register_buffer("scale", torch.tensor(0.5, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x))) * self.scale


def exact_net() -> ExactNet:
    """Weights on a grid of 1/256 (see :func:`train_exact`)."""
    net = ExactNet()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randint(-8, 9, p.shape, generator=g) / 8)
    return net


def exact_batches(n: int, batch: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(-3, 4, (batch, 4), generator=g).double(),
             torch.randint(-3, 4, (batch, 2), generator=g).double()) for _ in range(n)]


def train_exact(model: nn.Module, batches: list, device: str,
                grid: bool = True) -> list[torch.Tensor]:
    """SGD steps on inputs moved to ``device``; every step's gradients, then the parameters,
    on the CPU. Integer data and weights put back on a grid of 1/256 after each step keep
    every float64 sum exact, so the order in which the devices' partial sums are added up
    cannot show: the results must equal the CPU's bit for bit."""
    opt = torch.optim.SGD(model.parameters(), lr=1 / 32)
    seen = []
    for x, y in batches:
        out = model(x.to(device, non_blocking=True))
        loss = (out - y.to(out.device, non_blocking=True)).pow(2).mean()  # 16: exact mean
        opt.zero_grad()
        loss.backward()
        seen += [p.grad.cpu() for p in model.parameters()]
        opt.step()
        with torch.no_grad():
            for p in model.parameters() if grid else ():
                p.copy_(torch.round(p * 256) / 256)
    return seen + [p.detach().cpu() for p in model.parameters()]


# ---- view kernels ----------------------------------------------------------------------------

def python_views_serve(backend: str = "active_backend()", device: str = "sim") -> str:
    """Code that checks, in a child process, that the Python view kernels serve, right."""
    return (f"assert not {backend}.view_kernels.native\n"
            f"x = torch.arange(6., device='{device}')\n"
            "assert torch.equal(x.view(2, 3)[1].cpu(), torch.arange(3., 6.))\n")


def python_host_kernels() -> contextlib.AbstractContextManager[None]:
    """Within: the Python host-op kernels serve, as where the C++ ones cannot (strict and
    asynchronous sim, no library), also across recorders (tests of their paths)."""
    from torchport.backend import active_backend

    return active_backend().host_op_kernels.python_only()


@contextlib.contextmanager
def torchport_frames() -> Iterator[list[str]]:
    """Within: the names of torchport's Python functions called (in this thread): a call
    served without entering Python leaves it empty."""
    frames: list[str] = []

    def note(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and "/torchport/" in frame.f_code.co_filename:
            frames.append(frame.f_code.co_qualname)
    sys.setprofile(note)
    try:
        yield frames
    finally:
        sys.setprofile(None)


#: Why a test of the C++ host-op kernels (or the fallback they serve) is skipped.
CPP_HOST_OPS_IDLE = ("the C++ host-op kernels do not compute (strict sim, asynchronous sim: "
                     "they queue, TORCHPORT_NATIVE=0, no compiler)")


def cpp_fallback_serves() -> bool:
    """Does C++'s boxed fallback serve the overloads the Python fallback learnt: with the
    host-op kernels on memory at the device address, or through the runtime's copies on
    device-only memory (``native_staged.cpp``: the strict sim)?"""
    from torchport.ops import fallback

    reg = fallback._DENSE
    return cpp_host_ops_compute() or bool(reg is not None and reg.in_cpp)


def runtime_frame(name: str) -> bool:
    """Is ``name`` (a frame's qualified name) the active runtime's own code: its copies, and
    the caching allocator's calls of its malloc, which C++ calls as it would a vendor's?"""
    from torchport.backend import active_backend

    return name.startswith(type(active_backend().runtime).__name__ + ".") \
        or name == "_copy_bytes"


def cpp_host_ops_compute() -> bool:
    """Do the active backend's C++ host-op kernels compute the calls (an asynchronous
    sim's queue them: tests/test_async.py)?"""
    from torchport.backend import active_backend

    kernels = active_backend().host_op_kernels
    return bool(kernels.native and kernels.direct())


def privateuse1_registrations(name: str) -> list[str]:
    """The dispatcher's registrations of operator ``name`` (``"aten::add.Tensor"``) for
    PrivateUse1, each naming the file that registered it: one where the kernels switch."""
    return [line for line in torch._C._dispatch_dump(name).splitlines()
            if line.startswith("PrivateUse1:")]


# ---- objects the sim made --------------------------------------------------------------
def host_kernels_of(op: torch._ops.OpOverload) -> list:
    """The host-op kernels (``IntoDevice``) made for ``op``, found among the live objects,
    those in the collector's permanent generation included (conftest freezes the heap)."""
    import gc
    import warnings

    from torchport.ops import hostkernels

    frozen = gc.get_freeze_count()
    gc.unfreeze()
    try:
        with warnings.catch_warnings():  # isinstance on every object touches deprecated ones
            warnings.simplefilter("ignore")
            return [o for o in gc.get_objects()
                    if isinstance(o, hostkernels.IntoDevice) and o.op is op]
    finally:
        if frozen:
            gc.freeze()
