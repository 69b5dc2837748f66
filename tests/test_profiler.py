"""torch.profiler on the device: per-op device time from the PrivateUse1 profiler stubs."""

from __future__ import annotations

import gc
import json
import warnings

import pytest
import torch
from torch.autograd.profiler import profile as autograd_profile
from torch.profiler import ProfilerActivity, profile, record_function

import torchport.sim  # noqa: F401
from tests.helpers import mode_independent, run_python
from torchport.core import native
from torchport.device import profiling

pytestmark = pytest.mark.modes

B = torch.sim.backend
RT = B.runtime
DEVICE = B.name.upper()  # the table's column names: "Self SIM", "SIM total"
BACKTRACE = ("Exception raised from", "frame #", "not enabled", "Exception in RecordFunction")

needs_cpp = pytest.mark.skipif(native.loaded() is None, reason="the profiler stubs are C++")


def _model(device: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor,
                                  torch.Tensor]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(),
                            torch.nn.Linear(256, 10)).to(device)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x = torch.randn(64, 128, device=device)
    y = torch.randint(0, 10, (64,), device=device)
    return m, opt, x, y


def _step(m: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
          y: torch.Tensor) -> None:
    with record_function("train_step"):
        loss = torch.nn.functional.cross_entropy(m(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


def _profiled_step(form: str, device: str = "sim") -> tuple[object, object]:
    m, opt, x, y = _model(device)
    _step(m, opt, x, y)  # warm-up: lazy state out of the profile
    if form == "torch.profiler":
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]) as p:
            _step(m, opt, x, y)
        return p, p.profiler
    with autograd_profile(use_device=B.name) as p:
        _step(m, opt, x, y)
    return p, p


def _no_backtrace(err: str) -> None:
    for text in BACKTRACE:
        assert text not in err, err[:2000]


@needs_cpp
@pytest.mark.parametrize("form", ["torch.profiler", "use_device"])
def test_training_step_table_has_device_time(form: str, capfd: pytest.CaptureFixture) -> None:
    capfd.readouterr()
    p, inner = _profiled_step(form)
    assert inner.profiler_kind == torch._C._profiler.ProfilerState.KINETO_PRIVATEUSE1_FALLBACK
    averages = p.key_averages()
    table = averages.table(sort_by="self_device_time_total", row_limit=-1)
    for column in (f"Self {DEVICE}", f"{DEVICE} total", f"Self {DEVICE} %"):
        assert column in table
    for e in averages:
        assert e.self_device_time_total >= 0 and e.device_time_total >= 0, (e.key, table)
    by_key = {e.key: e for e in averages}
    assert by_key["aten::addmm"].device_time_total > 0, table
    assert by_key["aten::mm"].device_time_total > 0, table  # backward's matmuls
    step = by_key["train_step"]
    assert step.device_time_total >= max(e.device_time_total for e in averages)
    _no_backtrace(capfd.readouterr().err)


@needs_cpp
def test_device_time_is_the_runtime_events_elapsed_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each op's device time is the runtime's elapsed time between its two events, in µs."""
    monkeypatch.setattr(RT, "event_elapsed_time", lambda index, start, end: 2.5)
    a = torch.randn(32, 32, device="sim")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]) as p:
        torch.mm(a, a)
        a.add_(1)
    events = p.events()
    assert {"aten::mm", "aten::add_"} <= {e.name for e in events}
    assert {e.device_time_total for e in events} == {2500}  # each op its own range
    assert {e.self_device_time_total for e in events if not e.cpu_children} == {2500}


@needs_cpp
def test_record_function_range_and_chrome_trace(tmp_path) -> None:
    a = torch.randn(128, 128, device="sim")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]) as p:
        with record_function("my_range"):
            for _ in range(3):
                a = a @ a.tanh()
        B.synchronize(0)
    events = p.events()
    (rng,) = [e for e in events if e.name == "my_range"]
    inner = rng.cpu_children
    assert [e.name for e in inner].count("aten::matmul") == 3
    assert rng.device_time_total >= sum(e.device_time_total for e in inner)
    assert rng.device_time_total > 0 and rng.self_device_time_total >= 0
    path = tmp_path / "trace.json"
    p.export_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"my_range", "aten::mm"} <= names


@needs_cpp
def test_events_on_current_device_and_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """As CUDA's stubs: each event is recorded on the current device's current stream."""
    recorded: list[tuple[int, object]] = []
    record_event = RT.record_event

    def spy(index: int, event: object, stream: object) -> None:
        recorded.append((index, stream))
        record_event(index, event, stream)

    monkeypatch.setattr(RT, "record_event", spy)
    s = torch.sim.Stream(device="sim:1")
    with torch.sim.device(1), torch.sim.stream(s):
        b = torch.randn(64, 64, device="sim")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]) as p:
            b @ b
    assert recorded and all(i == B.visible[1] and h is s.handle for i, h in recorded)
    mm = [e for e in p.key_averages() if e.key == "aten::mm"]
    assert mm and mm[0].device_time_total > 0


@needs_cpp
def test_training_step_on_sim1(capfd: pytest.CaptureFixture) -> None:
    capfd.readouterr()
    with torch.sim.device(1):
        p, _ = _profiled_step("torch.profiler", "sim:1")
    averages = p.key_averages()
    assert all(e.self_device_time_total >= 0 for e in averages)
    assert {e.key: e for e in averages}["aten::addmm"].device_time_total > 0
    _no_backtrace(capfd.readouterr().err)


class _CountingRuntime:
    """Counts the timing events created and destroyed (the sim's destroy is a no-op)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.created: list[object] = []
        self.destroyed: list[object] = []
        create, destroy = RT.create_event, RT.destroy_event

        def create_event(index: int, enable_timing: bool = False,
                         blocking: bool = False) -> object:
            ev = create(index, enable_timing, blocking)
            if enable_timing:  # the allocator's events (asynchronous mode) have none
                self.created.append(ev)
            return ev

        def destroy_event(index: int, ev: object) -> None:
            self.destroyed.append(ev)
            destroy(index, ev)

        monkeypatch.setattr(RT, "create_event", create_event)
        monkeypatch.setattr(RT, "destroy_event", destroy_event)


@needs_cpp
def test_events_released_with_the_results(monkeypatch: pytest.MonkeyPatch) -> None:
    gc.collect()
    before = profiling.live_events()
    counting = _CountingRuntime(monkeypatch)
    p = _profiled_step("torch.profiler")[0]
    p.key_averages()
    assert profiling.live_events() > before and counting.created
    del p
    gc.collect()
    assert profiling.live_events() == before
    destroyed = {id(e) for e in counting.destroyed}
    assert all(id(e) in destroyed for e in counting.created)


def test_profiler_off_creates_no_events() -> None:
    """PyTorch calls the stubs from its profiler only: no per-op work while none runs."""
    created = profiling.events_created()
    m, opt, x, y = _model("sim")
    for _ in range(2):
        _step(m, opt, x, y)
    assert profiling.events_created() == created
    assert not torch.autograd._profiler_enabled()


@needs_cpp
def test_runtime_failure_warns_once_and_keeps_profiling(monkeypatch: pytest.MonkeyPatch,
                                                       capfd: pytest.CaptureFixture) -> None:
    create = RT.create_event

    def fail(index: int, enable_timing: bool = False, blocking: bool = False) -> object:
        if enable_timing:  # the profiler's (the allocator's, asynchronous mode, have none)
            raise RuntimeError("no more events")
        return create(index, enable_timing, blocking)

    monkeypatch.setattr(RT, "create_event", fail)
    monkeypatch.setattr(profiling._S.events, "failed", False)
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p, _ = _profiled_step("torch.profiler")
        table = p.key_averages().table(sort_by="self_device_time_total")
    ours = [w for w in caught if issubclass(w.category, profiling.DeviceProfilerWarning)]
    assert len(ours) == 1 and "no more events" in str(ours[0].message)
    assert all(e.device_time_total == 0 for e in p.key_averages())
    assert "train_step" in table
    err = capfd.readouterr().err
    _no_backtrace(err)
    assert "Exception ignored" not in err


_WITHOUT_LIBRARY = """
import warnings
import torch, torchport.sim
from torch.profiler import profile, ProfilerActivity
from torch.autograd.profiler import profile as autograd_profile
from torchport.core import native
from torchport.device import profiling
assert native.loaded() is None and not profiling.device_time()
a = torch.randn(64, 64, device="sim")
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]) as p:
    a @ a
with autograd_profile(use_device="sim") as q:
    a @ a
for prof in (p, q):
    table = prof.key_averages().table(sort_by="self_device_time_total")
    assert "aten::mm" in table and "Self SIM" not in table, table
print("ok")
"""


@mode_independent
def test_without_the_library_cpu_time_and_one_warning() -> None:
    r = run_python(_WITHOUT_LIBRARY, TORCHPORT_NATIVE="0")
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
    _no_backtrace(r.stderr)
    assert r.stderr.count("DeviceProfilerWarning") == 1, r.stderr[-3000:]
    assert "records no sim device time without torchport's C++ library" in r.stderr
