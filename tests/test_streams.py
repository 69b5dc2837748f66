"""Streams and events on torch.sim, and stream-aware freeing in the allocator."""

from __future__ import annotations

import threading

import pytest
import torch

import torchport.sim  # noqa: F401

pytestmark = pytest.mark.asynchronous

B = torch.sim.backend


def test_default_and_current_stream() -> None:
    d0 = torch.sim.default_stream()
    assert d0.stream_id == 0 and d0.device_index == 0 and d0.device == torch.device("sim:0")
    assert torch.sim.current_stream() == d0
    assert torch.sim.default_stream(1).device_index == 1
    assert isinstance(d0, torch.Stream)


def test_stream_context_and_set_stream() -> None:
    s = torch.sim.Stream()
    assert s != torch.sim.default_stream() and s.priority == 0
    with torch.sim.stream(s) as entered:
        assert entered is s
        assert torch.sim.current_stream() == s
        with torch.sim.stream(None):
            assert torch.sim.current_stream() == s
    assert torch.sim.current_stream() == torch.sim.default_stream()
    torch.sim.set_stream(s)
    try:
        assert torch.sim.current_stream() == s
    finally:
        torch.sim.set_stream(torch.sim.default_stream())


def test_stream_on_other_device_does_not_change_current_device() -> None:
    s1 = torch.sim.Stream(device="sim:1", priority=-1)
    assert s1.device_index == 1 and s1.priority == -1
    with torch.sim.stream(s1):
        assert torch.sim.current_stream(1) == s1
        assert torch.sim.current_stream(0) == torch.sim.default_stream(0)
        assert torch.sim.current_device() == 0


def test_current_stream_is_per_thread() -> None:
    s = torch.sim.Stream()
    seen = []
    with torch.sim.stream(s):
        t = threading.Thread(target=lambda: seen.append(torch.sim.current_stream()))
        t.start()
        t.join()
    assert seen == [torch.sim.default_stream()]


def test_stream_methods_and_events() -> None:
    s = torch.sim.Stream()
    with torch.sim.stream(s):
        x = torch.randn(64, 64, device="sim")
        y = x @ x
    e = s.record_event()
    assert isinstance(e, torch.sim.Event) and e.device == torch.device("sim:0")
    torch.sim.current_stream().wait_event(e)
    torch.sim.current_stream().wait_stream(s)
    e.synchronize()
    assert e.query()
    s.synchronize()  # (wait_stream and frees queue markers on s after e: s may still be busy)
    assert s.query()
    torch.testing.assert_close(y.cpu(), x.cpu() @ x.cpu())


def test_event_before_record_and_timing() -> None:
    e = torch.sim.Event()
    assert e.query() and e.device is None
    e.synchronize()
    e.wait()
    start, end = torch.sim.Event(enable_timing=True), torch.sim.Event(enable_timing=True)
    start.record()
    torch.ones(1000, device="sim").sum().item()
    end.record()
    end.synchronize()
    assert start.elapsed_time(end) >= 0.0
    with pytest.raises(RuntimeError, match="enable_timing"):
        e.record()
        e.elapsed_time(end)
    with pytest.raises(RuntimeError, match="recorded"):
        torch.sim.Event(enable_timing=True).elapsed_time(end)


def test_event_device_mismatch() -> None:
    e = torch.sim.Event()
    e.record(torch.sim.Stream(0))
    with pytest.raises(RuntimeError, match="does not match"):
        e.record(torch.sim.Stream(1))


def test_allocations_and_copies_use_current_stream() -> None:
    s = torch.sim.Stream()
    alloc = B.allocator(0)
    with torch.sim.stream(s):
        x = torch.empty(1000, device="sim")
        z = torch.arange(10.0).to("sim", non_blocking=True)
    assert alloc.active[x.data_ptr()].stream is s.handle
    s.synchronize()
    torch.testing.assert_close(z.cpu(), torch.arange(10.0))
    y = torch.empty(1000, device="sim")
    assert alloc.active[y.data_ptr()].stream is None


def test_record_stream_defers_reuse_until_stream_done(monkeypatch: pytest.MonkeyPatch) -> None:
    """A block used on a side stream is not handed out while that stream is busy."""
    alloc = B.allocator(0)
    side = torch.sim.Stream()
    busy = {"on": True}
    real_query = B.runtime.query_event

    def query(index, ev):  # the side stream's work is "still running"
        return False if busy["on"] else real_query(index, ev)

    monkeypatch.setattr(B.runtime, "query_event", query)
    x = torch.empty(4096, device="sim")
    ptr = x.data_ptr()
    x.record_stream(side)
    assert side in alloc.active[ptr].stream_uses
    del x
    assert any(b.ptr == ptr for b in alloc.pending_blocks())
    y = torch.empty(4096, device="sim")
    assert y.data_ptr() != ptr  # still pending: not reused
    busy["on"] = False
    side.synchronize()  # the side stream's work is done (asynchronous sim: really done)
    del y
    z = torch.empty(4096, device="sim")
    assert not any(b.ptr == ptr for b in alloc.pending_blocks())
    w = torch.empty(4096, device="sim")
    assert ptr in (z.data_ptr(), w.data_ptr())


def test_record_stream_on_allocation_stream_is_noop() -> None:
    alloc = B.allocator(0)
    x = torch.empty(100, device="sim")
    x.record_stream(torch.sim.default_stream())
    assert not alloc.active[x.data_ptr()].stream_uses
    x[10:].record_stream(torch.sim.Stream())  # a view: the storage's block is marked
    assert len(alloc.active[x.data_ptr()].stream_uses) == 1


def test_blocks_are_per_stream() -> None:
    """A block freed on one stream is reused by that stream, not by another (CUDA)."""
    s = torch.sim.Stream()
    with torch.sim.stream(s):
        a = torch.empty(256, device="sim")
    pa = a.data_ptr()
    del a
    b = torch.empty(256, device="sim")  # default stream: another block
    assert b.data_ptr() != pa
    with torch.sim.stream(s):
        c = torch.empty(256, device="sim")
    assert c.data_ptr() == pa


def test_record_stream_rejects_foreign_stream() -> None:
    x = torch.empty(100, device="sim")
    with pytest.raises((TypeError, RuntimeError)):
        x.record_stream(torch.Stream(stream_id=999, device_index=0, device_type=20))


# ---- asynchronous sim runtime (opt-in: TORCHPORT_SIM_ASYNC=1) -------------------------
def _async_runtime():
    from torchport.backends.sim.runtime import SimRuntime

    rt = SimRuntime(num_devices=1, memory=1 << 24, strict=False)
    rt.asynchronous = True
    return rt


def test_async_host_runs_ahead_and_order_kept() -> None:
    rt = _async_runtime()
    s = rt.create_stream(0)
    gate, seen = threading.Event(), []
    rt.launch(0, s, gate.wait, "gate")
    for i in range(5):
        rt.launch(0, s, lambda i=i: seen.append(i), f"op{i}")
    assert not rt.query_stream(0, s) and seen == []
    ev = rt.create_event(0)
    rt.record_event(0, ev, s)
    assert not rt.query_event(0, ev)
    gate.set()
    rt.synchronize_event(0, ev)
    assert rt.query_event(0, ev) and seen == [0, 1, 2, 3, 4]
    rt.synchronize(0)


def test_async_stream_wait_event_orders_streams() -> None:
    rt = _async_runtime()
    a, b = rt.create_stream(0), rt.create_stream(0)
    gate, seen = threading.Event(), []
    rt.launch(0, a, gate.wait, "gate")
    rt.launch(0, a, lambda: seen.append("a"), "a")
    ev = rt.create_event(0)
    rt.record_event(0, ev, a)
    rt.stream_wait_event(0, b, ev)
    rt.launch(0, b, lambda: seen.append("b"), "b")
    rt.launch(0, None, lambda: seen.append("default"), "default")  # independent stream
    rt.synchronize_stream(0, None)
    assert seen == ["default"]
    gate.set()
    rt.synchronize_stream(0, b)
    assert seen == ["default", "a", "b"]


def test_async_error_reported_at_sync_with_op_name_and_device_usable() -> None:
    from torchport.backends.sim.runtime import SimAsyncError

    rt = _async_runtime()

    def boom() -> None:
        raise ValueError("bad shape")

    rt.launch(0, None, boom, "aten::mm")
    with pytest.raises(SimAsyncError, match=r"aten::mm.*bad shape"):
        rt.synchronize(0)
    seen = []
    rt.launch(0, None, lambda: seen.append(1), "ok")
    rt.synchronize_stream(0, None)  # the error was reported once; the device works
    assert seen == [1]


def test_async_copies_and_timing() -> None:
    rt = _async_runtime()
    s = rt.create_stream(0)
    src = torch.arange(64, dtype=torch.float32)
    dst = torch.empty(64, dtype=torch.float32)
    ptr = rt.malloc(0, 256)
    start, end = rt.create_event(0, enable_timing=True), rt.create_event(0, enable_timing=True)
    rt.record_event(0, start, s)
    rt.copy_h2d(0, ptr, src.data_ptr(), 256, s)
    rt.copy_d2h(0, dst.data_ptr(), ptr, 256, s)
    rt.record_event(0, end, s)
    rt.synchronize_event(0, end)
    assert torch.equal(dst, src)
    assert rt.event_elapsed_time(0, start, end) >= 0.0
    rt.free(0, ptr)


def test_launch_blocking_disables_async(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchport.backends.sim.runtime import SimRuntime

    monkeypatch.setenv("TORCHPORT_SIM_ASYNC", "1")
    assert SimRuntime(num_devices=1, memory=1 << 20).asynchronous
    monkeypatch.setenv("TORCHPORT_LAUNCH_BLOCKING", "1")
    rt = SimRuntime(num_devices=1, memory=1 << 20)
    assert not rt.asynchronous
    seen = []
    rt.launch(0, None, lambda: seen.append(1), "op")
    assert seen == [1]


def test_non_blocking_copy_from_pinned_memory_is_queued() -> None:
    from torchport.backend import active_backend
    from torchport.core import native

    b = active_backend()
    if not b.runtime.asynchronous or native.loaded() is None:
        pytest.skip("needs an asynchronous runtime and pinned memory (the C++ library)")
    values = torch.randn(1 << 16)
    src = values.pin_memory()
    s = torch.sim.Stream()
    gate = threading.Event()
    with torch.sim.stream(s):
        dst = torch.empty(1 << 16, device="sim")
        b.runtime.launch(b.phys(0), s.handle, lambda: gate.wait(30), "held")  # stream busy
        dst.copy_(src, non_blocking=True)  # returns at once: no wait for the held stream
        assert not s.query()
    del src  # the pinned block stays alive until the copy ran
    gate.set()
    s.synchronize()
    with torch.sim.stream(s):
        assert torch.equal(dst.cpu(), values)
