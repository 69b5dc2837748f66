"""The C++ device guard: one current device and one current stream per device and thread
for torch.<device>, torch.accelerator, torch.Stream/torch.Event and the autograd engine,
as CUDA's guard keeps them."""

from __future__ import annotations

import threading

import pytest
import torch

import torchport.sim  # noqa: F401
from tests.helpers import run_python
from torchport.core import native

pytestmark = pytest.mark.modes

needs_cpp = pytest.mark.skipif(native.loaded() is None,
                               reason="the C++ device layer is not loaded")

DEV = "sim"


@needs_cpp
def test_accelerator_device_switching_is_the_device_modules():
    assert torch.accelerator.current_device_index() == 0
    torch.accelerator.set_device_index(1)
    try:
        assert torch.sim.current_device() == 1
        assert torch.tensor([1.0], device=DEV).device == torch.device("sim:1")
        torch.sim.set_device(0)
        assert torch.accelerator.current_device_index() == 0
        with torch.accelerator.device_index(1):
            assert torch.sim.current_device() == 1
            assert torch.empty(2, device=DEV).device.index == 1
        assert torch.sim.current_device() == 0
    finally:
        torch.sim.set_device(0)
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        torch.accelerator.set_device_index(torch.sim.device_count())


@needs_cpp
def test_current_device_is_per_thread():
    seen = []
    torch.sim.set_device(1)
    try:
        t = threading.Thread(target=lambda: seen.append(torch.accelerator.current_device_index()))
        t.start()
        t.join()
        assert seen == [0] and torch.sim.current_device() == 1
    finally:
        torch.sim.set_device(0)


@needs_cpp
def test_stream_on_device_1_is_new_and_current_in_both_apis():
    s = torch.Stream(device="sim:1")
    assert s.device == torch.device("sim:1") and s.stream_id != 0
    assert torch.sim.current_stream(1) == torch.sim.default_stream(1)
    with torch.sim.stream(torch.sim.Stream(1)) as mine:
        assert torch.accelerator.current_stream(1) == mine
    torch.accelerator.set_stream(s)  # also makes the stream's device current, as on CUDA
    try:
        assert torch.sim.current_device() == 1
        assert torch.sim.current_stream(1) == s
        assert torch.sim.current_stream(0) == torch.sim.default_stream(0)
        x = torch.arange(6.0, device="sim:1")
        y = (x * 2).sum()  # queued on s
        assert y.item() == 30.0
        s.synchronize()
        assert s.query()
    finally:
        torch.accelerator.set_stream(torch.sim.default_stream(1))
        torch.sim.set_device(0)
    assert torch.accelerator.current_stream(1).stream_id == 0


@needs_cpp
def test_current_stream_is_per_thread():
    s = torch.sim.Stream(0)
    seen = []
    with torch.sim.stream(s):
        t = threading.Thread(target=lambda: seen.append(torch.accelerator.current_stream(0)))
        t.start()
        t.join()
        assert torch.accelerator.current_stream(0) == s
    assert seen == [torch.sim.default_stream(0)]


@needs_cpp
def test_event_timing_and_waiting_on_device_1():
    a = torch.randn(64, 64, dtype=torch.float64)
    side = torch.Stream(device="sim:1")
    start = torch.Event(device="sim:1", enable_timing=True)
    end = torch.Event(device="sim:1", enable_timing=True)
    x = a.to("sim:1")
    start.record(side)
    with torch.sim.stream(side):
        side.wait_stream(torch.sim.default_stream(1))  # x was copied on the default stream
        y = x @ x + 1
    end.record(side)
    torch.sim.default_stream(1).wait_event(end)  # y is read on the default stream below
    assert torch.equal(y.cpu(), a @ a + 1)
    end.synchronize()
    assert end.query() and start.query()
    assert start.elapsed_time(end) >= 0.0
    with pytest.raises(ValueError, match="enable_timing"):  # CUDA's error too
        e1, e2 = torch.Event(device="sim:1"), torch.Event(device="sim:1")
        e1.record(side)
        e2.record(side)
        e1.elapsed_time(e2)


@needs_cpp
def test_unrecorded_event_is_complete_and_elapsed_time_needs_records():
    e = torch.Event(device="sim", enable_timing=True)
    assert e.query()
    e.synchronize()
    with pytest.raises(ValueError, match="recorded"):
        e.elapsed_time(torch.Event(device="sim", enable_timing=True))


@needs_cpp
def test_accelerator_synchronize_waits_for_every_stream():
    s = torch.sim.Stream(0)
    with torch.sim.stream(s):
        x = torch.ones(256, 256, device=DEV)
        for _ in range(5):
            x = x @ x / 256
    torch.accelerator.synchronize()
    assert s.query() and torch.sim.default_stream(0).query()
    assert torch.equal(x.cpu(), torch.ones(256, 256))


@needs_cpp
def test_device_capability_lists_the_dtypes():
    cap = torch.accelerator.get_device_capability()
    for d in (torch.float32, torch.float64, torch.int64, torch.bool, torch.bfloat16):
        assert d in cap["supported_dtypes"]


def _mlp_grads(device0: str, device1: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    w1 = torch.randn(8, 16, dtype=torch.float64)
    w2 = torch.randn(16, 4, dtype=torch.float64)
    x = torch.randn(5, 8, dtype=torch.float64)
    p1 = w1.to(device0).requires_grad_()
    p2 = w2.to(device1).requires_grad_()
    h = torch.tanh(x.to(device0) @ p1).to(device1)
    (h @ p2).pow(2).sum().backward()
    return [p1.grad.cpu(), p2.grad.cpu()]


@needs_cpp
def test_backward_on_two_devices_matches_the_cpu_in_any_thread():
    expected = _mlp_grads("cpu", "cpu")
    assert all(torch.equal(g, e) for g, e in zip(_mlp_grads("sim:0", "sim:1"), expected,
                                                 strict=True))
    out: list = []
    t = threading.Thread(target=lambda: out.append(_mlp_grads("sim:1", "sim:0")))
    t.start()
    t.join()
    assert all(torch.equal(g, e) for g, e in zip(out[0], expected, strict=True))


@needs_cpp
def test_backward_runs_on_the_devices_threads_as_on_cuda():
    """In every thread, the registering one included: a device's nodes run on autograd's
    thread for that device."""
    threads, caller = [], []

    def run() -> None:
        caller.append(threading.get_ident())
        x = torch.randn(4, device="sim:1", requires_grad=True)
        x.register_hook(lambda g: threads.append(threading.get_ident()))
        (x * 2).sum().backward()

    run()  # this thread registered the backend (tests import torchport.sim first)
    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert len(threads) == 2 and threads[0] != caller[0] and threads[1] != caller[1]
    assert threads[0] == threads[1]  # autograd's sim:1 worker, both times


@needs_cpp
def test_at_exit_autograd_threads_drop_the_python_objects_of_their_last_backward():
    """A backward's graph task keeps a copy of the caller's thread-local Python objects; the
    device thread that ran its last node can drop it after the caller went on. Settling
    (what an exit handler does before the interpreter finalizes) returns only after it
    did, so no device thread needs the GIL during finalization."""
    import gc
    freed: list[str] = []

    class Probe:
        def __del__(self) -> None:
            freed.append(threading.current_thread().name)

    x = torch.randn(64, 64, device="sim:1", requires_grad=True)
    torch._C._stash_obj_in_tls("torchport-probe", Probe())
    try:
        (x.tanh() * x).sum().backward()
    finally:
        torch._C._remove_obj_from_tls("torchport-probe")
    from torchport.backend import active_backend
    active_backend()._settle_autograd_threads()
    gc.collect()
    assert len(freed) == 1


@needs_cpp
def test_backward_runs_on_the_forward_stream():
    s = torch.sim.Stream(0)
    seen = []
    with torch.sim.stream(s):
        x = torch.randn(4, device=DEV, requires_grad=True)
        y = x * 3
    y.register_hook(lambda g: seen.append(torch.sim.current_stream(0)))
    y.sum().backward()
    torch.sim.synchronize()
    assert seen == [s]
    assert torch.equal(x.grad.cpu(), torch.full((4,), 3.0))


_THREAD_BACKWARD = """
import threading, torch, torchport.sim
from torchport.core import native
assert native.loaded() is None
out = []
def grads():
    x = torch.arange(4.0, device="sim:1", requires_grad=True)
    (x * x).sum().backward()
    out.append(x.grad.cpu().tolist())
t = threading.Thread(target=grads)
t.start()
t.join()
print(out)
"""


def test_backward_on_device_1_in_a_thread_without_the_cpp_layer():
    # PyTorch's Python guard reports one device there; autograd must not use its threads
    r = run_python(_THREAD_BACKWARD, TORCHPORT_NATIVE="0")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[[0.0, 2.0, 4.0, 6.0]]"


@needs_cpp
def test_accelerator_hooks_answer_with_the_guards_devices():
    # what PyTorch's C++ asks the hooks of the current accelerator (DataLoader's pin thread,
    # at::accelerator): the same devices as the guard
    hooks = torch._C
    assert hooks._accelerator_hooks_device_count() == torch.sim.device_count()
    assert hooks._accelerator_hooks_get_current_device() == 0
    try:
        hooks._accelerator_hooks_set_current_device(1)
        assert torch.sim.current_device() == 1
        assert hooks._accelerator_hooks_exchange_device(0) == 1
        assert torch.accelerator.current_device_index() == 0
        assert hooks._accelerator_hooks_maybe_exchange_device(1) == 0
    finally:
        torch.sim.set_device(0)
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        hooks._accelerator_hooks_set_current_device(torch.sim.device_count())


@needs_cpp
def test_streams_from_the_pool_are_reused_round_robin():
    from_pool = native.loaded().torchport_guard_stream_from_pool
    ids = [from_pool(1, 0) for _ in range(40)]
    assert len(set(ids)) == 32 and ids[32:] == ids[:8]  # CUDA's 32 per priority
    high = from_pool(1, 1)
    assert high not in ids
    s = torch.Stream(stream_id=ids[0], device_index=1, device_type=torch.sim.current_stream(1).device_type)
    torch.accelerator.set_stream(s)
    try:
        assert torch.sim.current_stream(1) == s and (torch.ones(3, device="sim:1") * 2).sum().item() == 6
    finally:
        torch.accelerator.set_stream(torch.sim.default_stream(1))
        torch.sim.set_device(0)
