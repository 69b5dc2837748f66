"""The reference backend (``torchport.backends.reference``, device ``ref``): a discrete,
asynchronous device (device-only memory, one worker thread per stream) with a handful of
numpy kernels, against CPU PyTorch -- kernels, copies on the default and a side stream,
events, BatchNorm's running statistics, SGD and AdamW training of a CNN and a transformer
-- and its injected faults (``runtime.faults``): each surfaces at the right call with the
vendor's message, leaves no tensor silently stale, returns its memory, and the device
works after. The code runs in a worker process (one backend per process; this one has
the sim)."""

import subprocess
import sys

import pytest

from tests.helpers import ROOT, backend_worker, child_env

pytestmark = pytest.mark.vendor

WORKER = r"""
import json, warnings
import torch
import torchport
import torchport.backends.reference as ref
from tests.helpers import serve

torchport.ops.set_fallback_warn(False)
warnings.simplefilter("ignore", UserWarning)
rt = ref.runtime


def raises(exc, match, fn):
    '''fn() raises exc whose message holds ``match``; the message.'''
    try:
        fn()
    except exc as e:
        assert match in str(e), (match, str(e))
        return str(e)
    raise AssertionError(f"{fn} did not raise {exc.__name__} ({match!r})")


def close(dev, cpu, rtol=1.3e-6, atol=1e-5):
    got = dev.cpu()
    assert got.dtype == cpu.dtype and got.shape == cpu.shape, (got.dtype, cpu.dtype,
                                                               got.shape, cpu.shape)
    torch.testing.assert_close(got, cpu, rtol=rtol, atol=atol, equal_nan=True)


def paths(fn):
    '''{overload: its paths} of the ops ``fn`` ran.'''
    with torchport.ops.record() as rec:
        fn()
    return {name: json.dumps(row) for name, row in json.loads(rec.to_json())["ops"].items()}


serve(dict(globals()), "ref", "<ref test>", reset=lambda: setattr(rt, "faults", ref.Faults()))
"""


@pytest.fixture(scope="module")
def ref():
    w = backend_worker(WORKER, "ref")
    yield w
    w.close()


# ---- kernels against the CPU ----------------------------------------------------------------

def test_elementwise_kernels_against_the_cpu(ref):
    ref.run("""
    x, y = torch.randn(6, 5), torch.randn(5)
    xd, yd = x.to("ref"), y.to("ref")
    for dev, cpu in [(xd + yd, x + y), (xd - yd, x - y), (xd * yd, x * y), (xd / yd, x / y),
                     (torch.add(xd, yd, alpha=0.5), torch.add(x, y, alpha=0.5)),
                     (torch.sub(xd, yd, alpha=2), torch.sub(x, y, alpha=2)),
                     (xd * 3, x * 3), (2.5 - xd, 2.5 - x), (-xd, -x), (xd.relu(), x.relu()),
                     (xd.t() * xd.t(), x.t() * x.t()), (xd[::2, 1:] + 1, x[::2, 1:] + 1)]:
        close(dev, cpu)
    i, j = torch.arange(-6, 6).view(3, 4), torch.tensor([3, -2, 5, 7])
    idev, jdev = i.to("ref"), j.to("ref")
    for dev, cpu in [(idev + jdev, i + j), (idev * jdev, i * j), (idev / jdev, i / j),
                     (idev * 2.5, i * 2.5), (idev.relu(), i.relu())]:
        close(dev, cpu, rtol=0, atol=0)
    h = torch.randn(7).half()
    close(h.to("ref") * h.to("ref") + 1, h * h + 1, rtol=1e-3, atol=1e-3)
    z = xd.clone()
    z.mul_(2).add_(yd).relu_()
    close(z, (x * 2 + y).relu())
    p = paths(lambda: (xd + yd, xd * 2, xd / yd, -xd, xd.relu()))
    for name in ("add.Tensor", "mul.Tensor", "div.Tensor", "neg", "relu"):
        assert "native" in p[name] and "fallback" not in p[name], (name, p)
    """)


def test_matmul_and_sum_kernels_against_the_cpu(ref):
    ref.run("""
    a, b, c = torch.randn(8, 5), torch.randn(5, 3), torch.randn(4, 3, 6)
    ad, bd, cd = a.to("ref"), b.to("ref"), c.to("ref")
    close(ad @ bd, a @ b, rtol=1e-5)
    close(ad.t().t() @ bd, a @ b, rtol=1e-5)
    close(torch.bmm(cd, cd.transpose(1, 2)), torch.bmm(c, c.transpose(1, 2)), rtol=1e-5)
    close(cd.sum(), c.sum(), rtol=1e-5)
    for dims in ([0], [1, 2], [-1], [0, 2]):
        close(cd.sum(dims), c.sum(dims), rtol=1e-5)
        close(cd.sum(dims, keepdim=True), c.sum(dims, keepdim=True), rtol=1e-5)
    i = torch.arange(24).view(2, 3, 4)
    close(i.to("ref").sum(1), i.sum(1), rtol=0, atol=0)
    close((i.to("ref") > 5).sum(), (i > 5).sum(), rtol=0, atol=0)
    p = paths(lambda: (ad @ bd, torch.bmm(cd, cd.transpose(1, 2)), cd.sum(1)))
    for name in ("mm", "bmm", "sum.dim_IntList"):
        assert "native" in p[name] and "fallback" not in p[name], (name, p)
    """)


# ---- copies and factories, on the default and on a side stream -------------------------------

COPIES = """
import time
x = torch.randn(16, 12)
xd = x.to("ref")
torch.ref.synchronize()
s = torch.ref.Stream() if SIDE else torch.ref.default_stream()
with torch.ref.stream(s):
    torchport.launch(xd, lambda: time.sleep(0.2), "slow")  # holds the queue
    y = xd * 2                      # queued behind it
    outs = {
        "clone": (y.clone(), x * 2),
        "contiguous": (y.t().contiguous(), (x * 2).t().contiguous()),
        "to float64": (y.to(torch.float64), (x * 2).double()),
        "to int64": (y.to(torch.int64), (x * 2).long()),
        "slice assign": (torch.zeros(16, 12, device="ref").index_fill_(0, torch.tensor([0], device="ref"), 0), None),
        "factories": (torch.full((3, 4), 2.5, device="ref") + torch.ones(3, 4, device="ref"),
                      torch.full((3, 4), 3.5)),
        "arange": (torch.arange(10, device="ref") * 3, torch.arange(10) * 3),
        "fallback": (y.exp(), (x * 2).exp()),
        "to ref:1": (y.to("ref:1"), x * 2),
    }
    z = torch.zeros(16, 12, device="ref")
    z[:, :5] = y[:, :5]
    outs["slice assign"] = (z, torch.cat([(x * 2)[:, :5], torch.zeros(16, 7)], 1))
    w = torch.empty(16, 12, device="ref")
    w.copy_(y)
    outs["copy_"] = (w, x * 2)
    got = {k: d.cpu() for k, (d, _) in outs.items()}  # blocking: after the stream's work
for k, (_, cpu) in outs.items():
    torch.testing.assert_close(got[k], cpu, rtol=0, atol=0, msg=k)
torch.testing.assert_close(y.cpu(), x * 2, rtol=0, atol=0)
"""


@pytest.mark.parametrize("side", [False, True], ids=["default stream", "side stream"])
def test_copies_clones_and_factories_keep_stream_order(ref, side):
    ref.run(f"SIDE = {side}\n" + COPIES)


def test_nothing_overtakes_queued_kernels():
    """tests/stream_order_sweep.py on ref: every host-side read or write issued right behind
    queued kernels (a worker thread per queue, device-only memory) gives the CPU's values."""
    r = subprocess.run([sys.executable, "-m", "tests.stream_order_sweep",
                        "torchport.backends.reference"],
                       env=child_env(drop=("TORCHPORT_SIM_ASYNC", "TORCHPORT_SIM_STRICT"),
                                     importable=True, OMP_NUM_THREADS="1"),
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr[-3000:]
    assert r.returncode == 0 and "MISMATCH" not in out and "checked " in r.stdout, out


def test_each_stream_is_a_worker_thread_and_events_order_them(ref):
    ref.run("""
    import threading, time
    x = torch.randn(32, 32)
    xd = x.to("ref")
    s1, s2 = torch.ref.Stream(), torch.ref.Stream()
    start, end = torch.ref.Event(enable_timing=True), torch.ref.Event(enable_timing=True)
    with torch.ref.stream(s1):
        start.record()
        torchport.launch(xd, lambda: time.sleep(0.2), "slow")
        y = xd @ xd
        end.record()
    assert not end.query() and not s1.query()       # s1's worker is still sleeping
    s2.wait_event(end)
    with torch.ref.stream(s2):
        z = y + 1                                    # after y, on another queue
    s2.synchronize()
    assert end.query() and s1.query()
    torch.testing.assert_close(z.cpu(), x @ x + 1, rtol=1e-5, atol=1e-5)
    assert start.elapsed_time(end) >= 150
    names = {t.name for t in threading.enumerate()}
    assert {"torchport-ref:0 default stream", f"torchport-ref:0 stream {s1.stream_id}",
            f"torchport-ref:0 stream {s2.stream_id}"} <= names or \
        sum(n.startswith("torchport-ref:0 stream") for n in names) >= 2, names
    """)


# ---- faults ------------------------------------------------------------------------------------

def test_out_of_memory_and_a_failing_malloc_surface_at_the_allocation(ref):
    ref.run("""
    base = torch.ref.memory_allocated()
    torch.ref.empty_cache()
    rt.faults.malloc_none_after = 0
    raises(torch.OutOfMemoryError, "out of memory", lambda: torch.empty(1 << 24, device="ref"))
    rt.faults.malloc_none_after = None
    rt.faults.malloc_raise_after = 1                 # the second malloc raises
    a = torch.ones(1 << 22, device="ref")
    msg = raises(RuntimeError, "ref:0: the driver failed to allocate",
                 lambda: torch.ones(1 << 22, device="ref"))
    assert "\\n" not in msg.strip() or "Traceback" not in msg, msg
    del a
    b = torch.arange(1 << 22, device="ref", dtype=torch.float32)
    assert b[-1].item() == (1 << 22) - 1             # usable after
    del b
    torch.ref.synchronize()
    assert torch.ref.memory_allocated() == base
    """)


def test_a_failing_blocking_copy_raises_at_the_call_and_changes_nothing(ref):
    ref.run("""
    base = torch.ref.memory_allocated()
    d = torch.arange(6.0, device="ref")
    rt.faults.copy_raise_after = 0
    raises(RuntimeError, "DMA error in copy_h2d", lambda: d.copy_(torch.full((6,), 9.0)))
    assert torch.equal(d.cpu(), torch.arange(6.0))   # the destination is untouched
    rt.faults.copy_raise_after = 0
    raises(RuntimeError, "DMA error in copy_d2h", lambda: d.cpu())
    rt.faults.copy_raise_after = 0
    raises(RuntimeError, "DMA error", lambda: torch.tensor([1.0, 2.0], device="ref"))
    assert torch.equal((d + 1).cpu(), torch.arange(6.0) + 1)
    rt.faults.copy_raise_after = 1                   # the CPU fallback's write-back fails
    raises(RuntimeError, "DMA error in copy_h2d", lambda: d.exp_())
    assert torch.equal(d.cpu(), torch.arange(6.0))   # nothing half-written
    del d
    torch.ref.synchronize()
    assert torch.ref.memory_allocated() == base
    """)


def test_a_failing_kernel_is_reported_at_the_next_synchronisation_of_its_stream(ref):
    ref.run("""
    base = torch.ref.memory_allocated()
    x = torch.randn(5, 5)
    a = x.to("ref")
    rt.faults.kernel_raise_after = 0
    y = a + 1                                        # queued: no error yet
    msg = raises(ref.RefDeviceError, "add.out failed asynchronously on ref:0 default stream",
                 lambda: y.cpu())
    assert "kernel fault" in msg, msg
    torch.ref.synchronize()                          # reported once
    torch.testing.assert_close((a + 1).cpu(), x + 1, rtol=0, atol=0)

    s = torch.ref.Stream()
    rt.faults.kernel_raise_after = 0
    with torch.ref.stream(s):
        z = a * 3
    torch.ref.default_stream().synchronize()        # another stream: nothing to report
    raises(ref.RefDeviceError, "on ref:0 stream", lambda: s.synchronize())
    e = torch.ref.Event()
    rt.faults.kernel_raise_after = 0
    with torch.ref.stream(s):
        z = a * 3
        e.record()
    raises(ref.RefDeviceError, "mul.out failed", lambda: e.synchronize())
    with torch.ref.stream(s):
        torch.testing.assert_close((a * 3).cpu(), x * 3, rtol=0, atol=0)
    import os
    os.environ["TORCHPORT_LAUNCH_BLOCKING"] = "1"    # the error at the op instead
    try:
        rt.faults.kernel_raise_after = 0
        raises(ref.RefDeviceError, "sub.out failed", lambda: a - 1)
    finally:
        del os.environ["TORCHPORT_LAUNCH_BLOCKING"]
    del a, y, z
    torch.ref.synchronize()
    assert torch.ref.memory_allocated() == base
    """)


def test_a_failing_queued_copy_is_reported_at_its_stream(ref):
    ref.run("""
    d = torch.zeros(4, device="ref")
    s = torch.ref.Stream()
    s.wait_stream(torch.ref.current_stream())        # d's zeros are queued on the default one
    with torch.ref.stream(s):
        rt.faults.copy_raise_after = 0
        d.copy_(torch.ones(4), non_blocking=True)    # queued on s
        raises(ref.RefDeviceError, "DMA error in copy_h2d", lambda: s.synchronize())
        d.copy_(torch.ones(4), non_blocking=True)
        assert torch.equal(d.cpu(), torch.ones(4))
    """)


def test_a_dead_stream_worker_is_reported_and_the_device_recovers(ref):
    ref.run("""
    import threading
    base = torch.ref.memory_allocated()
    x = torch.randn(8)
    a = x.to("ref")
    torch.ref.synchronize()
    rt.faults.worker_dies_after = 0
    y = a * 2                                        # the worker dies reaching it
    b = a + 1                                        # never runs either
    raises(ref.RefDeviceError, "the worker of ref:0 default stream died",
           lambda: torch.ref.synchronize())
    torch.testing.assert_close((a + 1).cpu(), x + 1, rtol=0, atol=0)  # a new worker
    assert sum(t.name == "torchport-ref:0 default stream" for t in threading.enumerate()) == 1

    s = torch.ref.Stream()
    e = torch.ref.Event()
    with torch.ref.stream(s):
        rt.faults.worker_dies_after = 0
        z = a * 3                                    # the worker dies reaching it
        e.record()                                   # so never reached
    torch.ref.current_stream().wait_event(e)
    raises(ref.RefDeviceError, "whose worker died", lambda: torch.ref.synchronize())
    raises(ref.RefDeviceError, f"the worker of ref:0 stream {s.stream_id} died", s.synchronize)
    del a, b, y, z
    torch.ref.synchronize()
    assert torch.ref.memory_allocated() == base
    """)


def test_device_work_may_not_call_the_blocking_copies(ref):
    ref.run("""
    import ctypes
    a = torch.ones(4, device="ref")
    host = torch.empty(4)
    torchport.launch(a, lambda: rt.copy_d2h(0, host.data_ptr(), torchport.device_address(a), 16),
                     "bad kernel")
    raises(ref.RefDeviceError, "called from device work", lambda: torch.ref.synchronize())
    """)


def test_the_c_copies_take_a_settled_queue_and_leave_the_rest_to_the_python_ones(ref):
    """``RefRuntime.native_copies``: a blocking copy in C while the default queue has no
    work left, no failure to report and no fault armed; 1 (the Python copy's turn, which
    waits, reports or fires) otherwise, and for an address outside every block."""
    ref.run("""
    import ctypes, threading
    c = rt.native_copies()
    proto = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_int32, ctypes.c_uint64,
                             ctypes.c_uint64, ctypes.c_uint64)
    d2h, h2d = proto(c.copy_d2h), proto(c.copy_h2d)
    x = torch.arange(8.0)
    d = x.to("ref")
    torch.ref.synchronize()
    at = torchport.device_address(d)
    host = torch.zeros(8)

    def fetch():
        host.zero_()
        return d2h(c.context, 0, host.data_ptr(), at, 32)
    assert fetch() == 0 and torch.equal(host, x)
    gate = threading.Event()
    rt.launch(0, None, gate.wait, "gate")            # the default queue has work left
    assert fetch() == 1 and not host.any()
    gate.set()
    torch.ref.synchronize()
    assert fetch() == 0 and torch.equal(host, x)
    rt.launch(0, None, lambda: 1 / 0, "boom")        # a failure to report
    rt.streams[0][0].wait()
    assert fetch() == 1
    raises(ref.RefDeviceError, "boom failed asynchronously", torch.ref.synchronize)
    assert fetch() == 0
    rt.faults.copy_raise_after = 3                   # an armed fault: the Python copy fires it
    assert fetch() == 1
    rt.faults.copy_raise_after = None
    assert fetch() == 0
    assert d2h(c.context, 0, host.data_ptr(), 64, 32) == 1        # in no block
    assert d2h(c.context, 1, host.data_ptr(), at, 32) == 1        # not device 1's
    seven = torch.full((8,), 7.0)
    assert h2d(c.context, 0, at, seven.data_ptr(), 32) == 0
    assert torch.equal(d.cpu(), seven)
    """)


def test_a_block_freed_on_a_settled_default_queue_costs_no_python_query(ref):
    """The caching allocator asks the runtime's C query (``NativeCopies.query_default_stream``)
    whether a freed block's default queue ran everything: a warm fallback call, whose blocking
    copies leave the queue settled, calls no Python ``query_stream``. With work queued the
    Python query answers, and the block waits for that work before it is handed out again."""
    ref.run("""
    import threading
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    a, b = x.to("ref"), y.to("ref")
    asked = []
    query = rt.query_stream
    rt.query_stream = lambda index, stream: asked.append(stream) or query(index, stream)
    try:
        for _ in range(3):
            r = torch.hypot(a, b)                    # the CPU fallback: copies, no kernel
        torch.ref.synchronize()
        asked.clear()
        for _ in range(20):
            r = torch.hypot(a, b)                    # each frees the last result
        assert asked == [], asked
        torch.testing.assert_close(r.cpu(), torch.hypot(x, y), rtol=0, atol=0)

        gate = threading.Event()
        rt.launch(0, None, gate.wait, "gate")        # the default queue has work left
        c = a * 2                                    # queued behind the gate
        at = torchport.device_address(c)
        del c                                        # its block waits for the queue
        assert asked == [None], asked
        d = torch.empty(8, 8, device="ref")
        assert torchport.device_address(d) != at
        gate.set()
        torch.ref.synchronize()
        torch.testing.assert_close(r.cpu(), torch.hypot(x, y), rtol=0, atol=0)
    finally:
        del rt.query_stream
    """)


# ---- training against the CPU ---------------------------------------------------------------

BATCHNORM = """
bn_cpu = torch.nn.BatchNorm2d(3, momentum=0.3)
bn = torch.nn.BatchNorm2d(3, momentum=0.3).to("ref")
for _ in range(3):
    x = torch.randn(4, 3, 5, 5)
    close(bn(x.to("ref")), bn_cpu(x), rtol=1e-4, atol=1e-5)
for name in ("running_mean", "running_var", "num_batches_tracked"):
    close(getattr(bn, name), getattr(bn_cpu, name), rtol=1e-4, atol=1e-6)
bn.eval(); bn_cpu.eval()
x = torch.randn(2, 3, 5, 5)
close(bn(x.to("ref")), bn_cpu(x), rtol=1e-4, atol=1e-5)
"""

def test_batchnorm2d_training_updates_the_running_statistics(ref):
    ref.run(BATCHNORM)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("model", ["cnn", "block"])
def test_trains_as_on_the_cpu(ref, model, optimizer, dtype):
    """A CNN with BatchNorm and a transformer block (tests/vendor_training.py): losses,
    parameters and running statistics within the rounding of ref's numpy kernels."""
    ref.run(f"from tests.vendor_training import check; check('ref', {model!r}, {optimizer!r}, "
            f"{dtype!r})")
