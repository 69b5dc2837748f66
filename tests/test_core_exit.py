"""The device works until the interpreter's last finaliser, as the CPU does."""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers import run_python
from torchport.core import native

pytestmark = pytest.mark.modes

_FINALIZER = """
import torch, torchport.sim

class Holder:
    def __init__(self, device):
        self.t = torch.arange(4.0, device=device)

    def __del__(self):
        print(self.t.device.type, (self.t * 2).sum().item(), flush=True)

on_cpu, on_sim = Holder("cpu"), Holder("sim")
"""


# each tensor of TENSORS shown at exit by a __del__ (a module global's: during the teardown),
# then also by a generator's finally and a weakref.finalize callback (the script defines
# show(where, t) and TENSORS)
_AT_EXIT_DEL = """
class Holder:
    def __init__(self, t):
        self.t = t

    def __del__(self):
        show("del", self.t)

holders = [Holder(t) for t in TENSORS]
"""
_AT_EXIT = _AT_EXIT_DEL + """
def gen(t):
    try:
        yield 1
    finally:
        show("finally", t)

gens = [gen(h.t) for h in holders]
for g in gens:
    next(g)
for h in holders:
    weakref.finalize(h, show, "finalize", h.t)
"""

_FINALIZERS_DIMLESS = """
import weakref
import torch, torchport.sim

def show(where, t):
    # whole-tensor reductions (no dim), large enough to be handed to the Python kernels
    print(where, t.device.type, t.sum().item(), (t * 2).mean().item(), t.max().item(),
          flush=True)

TENSORS = [torch.arange(90000.0, device=d).reshape(300, 300) / 1000 for d in ("cpu", "sim")]
""" + _AT_EXIT


_FINALIZERS_STREAMS = """
import weakref
import torch, torchport.sim

def show(where, t):
    # work on a side stream, a block used there freed (the allocator keeps it until the
    # stream's event completed), new blocks allocated, an event waited for
    side = torch.sim.Stream()
    side.wait_stream(torch.sim.current_stream())
    u = t + 1
    with torch.sim.stream(side):
        y = (u * 3).sum()
        done = torch.sim.Event()
        done.record()
    u.record_stream(side)
    del u
    more = [t * k for k in range(8)]
    torch.sim.current_stream().wait_event(done)
    done.synchronize()
    # the same through PyTorch's device-generic API, which reaches the streams from C++
    generic = torch.Event(device="sim")
    generic.record(torch.Stream(device="sim"))
    generic.synchronize()
    torch.accelerator.synchronize()
    torch.sim.synchronize()
    print(where, y.item(), sum(m.sum().item() for m in more), done.query(), flush=True)

side_stream_before_exit = torch.sim.Stream()
TENSORS = [torch.arange(1000.0, device="sim").reshape(10, 100)]
""" + _AT_EXIT


def test_streams_and_events_in_finalizers_at_exit() -> None:
    r = run_python(_FINALIZERS_STREAMS, timeout=120, TORCHPORT_FALLBACK_WARN="0")
    assert r.returncode == 0, r.stderr
    assert not r.stderr.strip(), r.stderr
    t = torch.arange(1000.0).reshape(10, 100)
    y, more = float((t + 1).mul(3).sum()), sum(float((t * k).sum()) for k in range(8))
    assert sorted(r.stdout.splitlines()) == sorted(
        f"{where} {y} {more} True" for where in ("del", "finally", "finalize")), r.stdout


_FINALIZER_RESULTS = """
import torch, torchport.sim

class Holder:
    def __init__(self, device):
        self.device = device
        self.a = (torch.arange(30.0).reshape(6, 5) * 0.37).sin().to(device)
        self.b = (torch.arange(20.0).reshape(5, 4) * 0.53).cos().to(device)
        self.i = torch.tensor([0, 2, 5], device=device)

    def __del__(self):
        # results of the device's Python kernels handed back to C++ (no views of
        # temporaries: PyTorch aborts on those at teardown on the CPU as well)
        a, b, i = self.a, self.b, self.i
        for name, f in [("cpu", lambda: a.cpu()), ("double", lambda: a.double()),
                        ("mul", lambda: a * 2), ("mm", lambda: a @ b), ("index", lambda: a[i]),
                        ("sort", lambda: a.sort(dim=1).values), ("max", lambda: a.max(0).values),
                        ("cat", lambda: torch.cat([a, b.t()])), ("sum", lambda: a.sum().item())]:
            v = f()
            v = v.cpu().tolist() if isinstance(v, torch.Tensor) else v
            print(self.device, name, v, flush=True)

holders = [Holder("sim"), Holder("cpu")]
"""


def test_kernel_results_in_finalizers_during_teardown() -> None:
    r = run_python(_FINALIZER_RESULTS, timeout=120, TORCHPORT_FALLBACK_WARN="0")
    assert r.returncode == 0, r.stderr[-2000:]
    assert not r.stderr.strip(), r.stderr
    lines = [ln.split(" ", 2) for ln in r.stdout.splitlines()]
    by_device = {d: {name: v for dev, name, v in lines if dev == d} for d in ("cpu", "sim")}
    assert len(by_device["cpu"]) == 9 and by_device["sim"] == by_device["cpu"], r.stdout


_FALLBACK_OPS = """
import os, weakref
import torch, torchport.sim

def show(where, t):
    # ops the sim runs through the CPU fallback (no sim kernel): functional, out=, in-place,
    # results to grow, several results, and the sparse and quantized fallbacks
    for name, f in [("pdist", lambda: torch.pdist(t[:1].reshape(1, 1))),  # a float argument
                    ("bessel_j0", lambda: torch.special.bessel_j0(t)),
                    ("bessel_j1_out", lambda: torch.special.bessel_j1(t, out=torch.empty_like(t))),
                    ("polygamma_", lambda: t.clone().polygamma_(1)),
                    ("histc", lambda: torch.histc(t, 4)),
                    ("kthvalue", lambda: torch.kthvalue(t, 2)),
                    ("frexp", lambda: torch.frexp(t)),
                    ("nanmedian", lambda: torch.nanmedian(t)),
                    ("sparse", lambda: (t.to_sparse() * 2).to_dense()),
                    ("quantized", lambda: torch.quantize_per_tensor(t, 0.1, 0, torch.quint8)
                     .int_repr())]:
        v = f()
        v = [x.cpu().tolist() for x in v] if isinstance(v, tuple) else v.cpu().tolist()
        print(where, t.device.type, name, v, flush=True)

TENSORS = [torch.arange(1.0, 7.0, device=d) / 7 for d in ("cpu", "sim")]
if os.environ.get("WARM_UP"):
    show("before", TENSORS[1])
"""


@pytest.mark.skipif(native.load() is None, reason=f"no C++ library: {native.UNAVAILABLE}")
@pytest.mark.parametrize("sites,warm_up", [
    ("del", False),  # each op first met during the teardown
    ("all", True),
])
def test_fallback_ops_in_finalizers_during_teardown(sites: str, warm_up: bool) -> None:
    script = _FALLBACK_OPS + (_AT_EXIT if sites == "all" else _AT_EXIT_DEL)
    env = {**os.environ, "TORCHPORT_FALLBACK_WARN": "0", "WARM_UP": "1" if warm_up else "",
           "PYTHONWARNINGS": "ignore"}
    r = run_python(script, timeout=180, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not r.stderr.strip(), r.stderr[-3000:]
    lines = [ln.split(" ", 3) for ln in r.stdout.splitlines()]
    for where in ("del", "finally", "finalize") if sites == "all" else ("del",):
        by_device = {d: {name: v for w, dev, name, v in lines if w == where and dev == d}
                     for d in ("cpu", "sim")}
        assert len(by_device["cpu"]) == 10 and by_device["sim"] == by_device["cpu"], r.stdout


_FLOAT_ARGUMENT = """
import torch, torchport.sim

class Holder:
    def __init__(self, device):
        self.t = torch.ones(1, 1, device=device)  # no Python float met before the exit

    def __del__(self):
        # pdist's Python kernel calls _pdist_forward(t, 2.0): a float argument
        print(self.t.device.type, torch.pdist(self.t).shape, flush=True)

holders = [Holder("cpu"), Holder("sim")]
"""


def test_float_arguments_in_finalizers_during_teardown() -> None:
    r = run_python(_FLOAT_ARGUMENT, timeout=120, TORCHPORT_FALLBACK_WARN="0")
    assert r.returncode == 0, r.stderr[-2000:]
    assert not r.stderr.strip(), r.stderr[-2000:]
    assert sorted(r.stdout.splitlines()) == ["cpu torch.Size([0])", "sim torch.Size([0])"]


def test_whole_tensor_reductions_in_finalizers_at_exit() -> None:
    r = run_python(_FINALIZERS_DIMLESS, timeout=120, TORCHPORT_FALLBACK_WARN="0")
    assert r.returncode == 0, r.stderr
    lines = [ln.split() for ln in r.stdout.splitlines() if ln.strip()]
    assert not r.stderr.strip(), r.stderr
    for where in ("del", "finally", "finalize"):
        mine = {ln[1]: ln[2:] for ln in lines if ln[0] == where}
        assert set(mine) == {"cpu", "sim"} and mine["cpu"] == mine["sim"], r.stdout


def test_device_ops_in_finalizers_at_exit() -> None:
    r = run_python(_FINALIZER, timeout=120, TORCHPORT_FALLBACK_WARN="0")
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.split("\n")[:2]) == ["cpu 12.0", "sim 12.0"], r.stdout + r.stderr
