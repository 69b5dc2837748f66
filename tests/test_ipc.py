"""Device tensors shared between processes (``torch.multiprocessing``), as CUDA's IPC shares
them: the same memory in both processes, writes seen both ways, freed when the last
process lets go; CPU copies are the oracle. Children are few (spawn and forkserver) and
do several checks each."""

from __future__ import annotations

import gc
import multiprocessing
import os
import queue
import subprocess
import sys
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests import ipc_workers
from tests.helpers import check_python, child_env
from tests.opencl_support import ocl  # noqa: F401  (the OpenCL worker fixture)
from torchport.device import sharing
from torchport.runtime import Runtime

pytestmark = pytest.mark.modes

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.int8,
          torch.bool, torch.complex64]
TIMEOUT = 120


def _values(dtype: torch.dtype, n: int = 12) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.arange(n) % 3 == 0
    return (torch.arange(n, dtype=torch.float64) * 1.25 - 4).to(dtype)


@pytest.fixture(autouse=True, scope="module")
def _sends_let_go():
    """The module's tests send tensors nobody receives (pickled in this process, errors):
    their memory is held for receivers until the process ends, as on CUDA. After the module
    it is let go, so that the allocator's later tests start from an empty cache."""
    yield
    from torchport.device import sharing

    for sent in list(sharing._SENT):
        sent.slots.bytes[sent.slot] = 0
    _collected(0)
    torch.sim.synchronize()
    torch.sim.empty_cache()


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a, b), (a, b)


def _get(q: queue.Queue, proc: multiprocessing.process.BaseProcess):
    """The child's next message; fails (instead of hanging) when the child died."""
    while True:
        try:
            return q.get(timeout=1)
        except queue.Empty:
            assert proc.is_alive(), f"child exited with {proc.exitcode}"


def _collected(base: int) -> int:
    """Device memory allocated above ``base`` once released sends are let go (and blocks
    freed behind queued work, an opened segment among them, released)."""
    gc.collect()
    torch.sim.synchronize()
    torch.sim.empty_cache()
    torch.sim.ipc_collect()
    return torch.sim.memory_allocated() - base


# ---- in one process: the reductions -------------------------------------------------
def test_share_memory_is_a_noop_as_on_cuda():
    t = torch.arange(6.0, device="sim")
    p = t.data_ptr()
    assert t.share_memory_() is t and t.data_ptr() == p
    assert t.is_shared() and t.untyped_storage().is_shared()
    m = torch.nn.Linear(3, 2).to("sim")
    assert m.share_memory() is m


@pytest.mark.parametrize("dtype", DTYPES)
def test_pickled_tensor_aliases_the_same_memory(dtype):
    """A tensor and a view of it, unpickled (here, in this process): the same memory
    under another address, one storage for both, offsets and strides kept."""
    cpu = _values(dtype, 24)
    t = cpu.to("sim")
    view = t.view(4, 6)[1:, ::2]
    t2, view2 = ForkingPickler.loads(ForkingPickler.dumps((t, view)))
    assert t2.device == t.device and t2.data_ptr() != t.data_ptr()
    assert view2.untyped_storage().data_ptr() == t2.untyped_storage().data_ptr()
    assert (view2.storage_offset(), view2.stride()) == (view.storage_offset(), view.stride())
    _same(t2.cpu(), cpu)
    _same(view2.cpu(), cpu.view(4, 6)[1:, ::2])
    ipc_workers.child_write(view2)
    torch.sim.synchronize()
    ipc_workers.child_write(cpu.view(4, 6)[1:, ::2])
    _same(t.cpu(), cpu)
    ipc_workers.parent_write(t)
    torch.sim.synchronize()
    ipc_workers.parent_write(cpu)
    _same(t2.cpu(), cpu)


def test_sent_storage_moves_in_place_and_is_freed_when_both_let_go():
    base = _collected(0)
    t = torch.arange(1000.0, device="sim")
    alias = t[10:20]
    first = t.data_ptr()
    blob = ForkingPickler.dumps(t)
    assert t.data_ptr() != first and alias.data_ptr() == t.data_ptr() + 40  # moved, together
    again = ForkingPickler.dumps(alias)  # already shareable: not moved again
    assert alias.data_ptr() == t.data_ptr() + 40
    got, got_alias = ForkingPickler.loads(blob), ForkingPickler.loads(again)
    assert got_alias.untyped_storage().data_ptr() == got.untyped_storage().data_ptr()
    _same(got.cpu(), torch.arange(1000.0))
    del t, alias
    assert _collected(base) >= 4000 * 2  # the sender's block and the receiver's mapping
    del got
    assert _collected(base) >= 4000  # the receiver still holds a view
    del got_alias
    assert _collected(base) == 0


def test_empty_and_parameter_round_trip():
    e = torch.empty(0, 3, device="sim")
    e2 = ForkingPickler.loads(ForkingPickler.dumps(e))
    assert e2.device == e.device and e2.shape == (0, 3)
    p = torch.nn.Parameter(torch.ones(3, device="sim"))
    p2 = ForkingPickler.loads(ForkingPickler.dumps(p))
    assert isinstance(p2, torch.nn.Parameter) and p2.requires_grad
    p2.data.add_(1)
    torch.sim.synchronize()
    _same(p.detach().cpu(), torch.full((3,), 2.0))


def test_runtime_without_ipc_refuses_clearly(monkeypatch):
    """A runtime that keeps the contract's defaults (OpenCL's) cannot share: one clear
    error naming the backend and the fix."""
    rt = type(torchport_sim_runtime())
    for m in ("malloc_shareable", "ipc_export", "ipc_open"):
        monkeypatch.setattr(rt, m, getattr(Runtime, m))
    assert not sharing.shares_memory(torchport_sim_runtime())
    t = torch.arange(4.0, device="sim")
    with pytest.raises(sharing.DeviceSharingError, match=r"sim:0 .*'sim' backend \(runtime "
                       r"SimRuntime\) does not support.*\.cpu\(\)") as info:
        ForkingPickler.dumps(t)
    assert "\n" not in str(info.value)


def test_interprocess_event_handle_round_trip():
    """An interprocess event opened from its handle (here in the same process) sees the
    records of the original and the original sees its records; no timing, as CUDA."""
    ev = torch.sim.Event(interprocess=True)
    handle = ev.ipc_handle()  # binds it to the current device, as CUDA's does
    assert isinstance(handle, bytes) and ev.device == torch.device("sim", 0)
    other = torch.sim.Event.from_ipc_handle(torch.device("sim:0"), handle)
    assert other.query() and ev.query()  # never recorded: complete
    x = torch.arange(1000.0, device="sim")
    for _ in range(20):
        x = x.sin()
    ev.record()
    other.synchronize()  # waits for the work before ev.record()
    assert ev.query() and other.query()
    torch.sim.current_stream().wait_event(other)
    other.record()
    ev.synchronize()
    _same(x.cpu(), _iterate(torch.arange(1000.0), torch.sin, 20))
    with pytest.raises(RuntimeError, match="interprocess event cannot measure time.*"
                                           "enable_timing=False"):
        torch.sim.Event(enable_timing=True, interprocess=True)
    with pytest.raises(RuntimeError, match="not created with interprocess=True"):
        torch.sim.Event().ipc_handle()
    with pytest.raises(ValueError, match="not a sim event's IPC handle"):
        torch.sim.Event.from_ipc_handle(0, b"nonsense")


def _iterate(x: torch.Tensor, fn, n: int) -> torch.Tensor:
    for _ in range(n):
        x = fn(x)
    return x


def _slow_write(t: torch.Tensor, add: float):
    """A kernel writing ``t`` (as the device would) once its gate opens, launched on the
    current stream; the gate (a threading or multiprocessing Event) is returned shut on
    an asynchronous runtime, open on a synchronous one (whose launches run at once)."""
    import threading

    rt = torchport_sim_runtime()
    gate = threading.Event()
    if not rt.asynchronous:
        gate.set()
    ptr, n = t.data_ptr(), t.untyped_storage().nbytes()

    def kernel() -> None:
        gate.wait()
        rt.device_tensor(0, ptr, n).view(t.dtype).add_(add)

    rt.launch(0, torch.sim.current_stream().handle, kernel, "slow write")
    return gate


def test_interprocess_event_is_pending_until_its_work_ran():
    """An event recorded behind queued work is not complete, in either handle, until
    that work ran; a stream told to wait for it waits (asynchronous mode holds the work
    back; in the synchronous modes it is done on return)."""
    asynchronous = torchport_sim_runtime().asynchronous
    x = torch.zeros(4, device="sim")
    torch.sim.synchronize()
    gate = _slow_write(x, 2.0)
    ev = torch.sim.Event(interprocess=True)
    ev.record()
    other = torch.sim.Event.from_ipc_handle(0, ev.ipc_handle())
    s = torch.sim.Stream()
    s.wait_event(other)
    with torch.sim.stream(s):
        y = x * 3  # ordered after the write by the event
    assert ev.query() is other.query() is s.query() is not asynchronous
    gate.set()
    s.synchronize()
    assert other.query() and ev.query()
    _same(y.cpu(), torch.full((4,), 6.0))


def test_runtime_without_ipc_events_says_what_to_do(monkeypatch):
    rt = type(torchport_sim_runtime())
    for m in ("create_ipc_event", "ipc_event_export", "ipc_event_open"):
        monkeypatch.setattr(rt, m, getattr(Runtime, m))
    says = (r"cannot be shared between processes: runtime SimRuntime does not implement "
            r"create_ipc_event.*call torch\.sim\.synchronize\(\)")
    with pytest.raises(NotImplementedError, match=says):
        torch.sim.Event(interprocess=True)
    with pytest.raises(NotImplementedError, match=says):
        torch.sim.Event.from_ipc_handle(0, b"x")


def test_python_allocator_shares_and_frees_too():
    """Without the C++ library (Python caching allocator) the same reductions serve."""
    out = check_python("""
        import gc
        import torch, torchport.sim
        from multiprocessing.reduction import ForkingPickler
        from torchport.memory.allocator import DeviceAllocator
        assert isinstance(torchport.sim.BACKEND.allocators[0], DeviceAllocator)
        t = torch.arange(1000.0, device="sim")
        v = ForkingPickler.loads(ForkingPickler.dumps(t[5:]))
        v.neg_()
        torch.sim.synchronize()
        assert torch.equal(t.cpu()[5:], -torch.arange(5.0, 1000.0)) and t.cpu()[4] == 4
        held = torch.sim.memory_allocated()
        del t
        torch.sim.ipc_collect()
        assert torch.sim.memory_allocated() == held  # v still holds the block
        del v
        gc.collect()
        torch.sim.ipc_collect()
        print("freed", torch.sim.memory_allocated())
    """, env=child_env(TORCHPORT_NATIVE="0", OMP_NUM_THREADS="1"))
    assert "freed 0" in out


def test_no_room_for_shareable_memory_is_an_out_of_memory_error(sim_backend):
    t = torch.ones(1 << 18, device="sim")
    alloc = sim_backend.allocator(0)
    before = alloc.fraction
    torch.sim.set_per_process_memory_fraction(1e-9)
    try:
        with pytest.raises(torch.OutOfMemoryError, match=r"shareable memory.*ipc_collect"):
            ForkingPickler.dumps(t)
    finally:
        alloc.fraction = before
    ForkingPickler.loads(ForkingPickler.dumps(t)).add_(1)
    torch.sim.synchronize()
    _same(t.cpu(), torch.full((1 << 18,), 2.0))


@pytest.mark.opencl
def test_opencl_refuses_to_share_naming_the_backend(ocl):  # noqa: F811
    """OpenCL keeps the contract's defaults: its tensors sent to another process raise
    DeviceSharingError, which names the backend and says to move them to the CPU; its
    interprocess events raise too."""
    msg = ocl.run("""
        from multiprocessing.reduction import ForkingPickler
        from torchport.device.sharing import DeviceSharingError, shares_memory
        import torchport.opencl
        assert not shares_memory(torchport.opencl.runtime)
        t = torch.arange(4.0, device="ocl")
        try:
            ForkingPickler.dumps(t[1:])
            result = "no error"
        except DeviceSharingError as e:
            result = str(e)
        try:
            torch.ocl.Event(interprocess=True)
            result += " | events: no error"
        except NotImplementedError as e:
            result += " | events: " + str(e)
    """)
    assert "events: ocl events cannot be shared between processes: runtime OpenCLRuntime" \
        in msg, msg
    assert "ocl:0 tensor" in msg and "'ocl' backend (runtime OpenCLRuntime)" in msg, msg
    assert ".cpu()" in msg and "\n" not in msg


def torchport_sim_runtime():
    import torchport.sim

    return torchport.sim.runtime


# ---- across processes ------------------------------------------------------------------
def test_spawned_child_and_parent_see_each_others_writes():
    """spawn: several dtypes, a view with an offset; the child's writes reach the parent,
    the parent's the child; the memory is held while the child holds it, freed after."""
    ctx = multiprocessing.get_context("spawn")
    base = _collected(0)
    cpu = {str(d).split(".")[1]: _values(d) for d in DTYPES}
    dev = {k: v.to("sim") for k, v in cpu.items()}
    dev["view"] = dev["float32"][3:9]
    cpu["view"] = cpu["float32"][3:9]
    writes = [k for k in cpu if k not in ("view", "float32")] + ["view"]
    to_parent, to_child = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=ipc_workers.exchange, args=(dev, writes, to_parent, to_child))
    proc.start()
    try:
        tag, seen, child_allocated = _get(to_parent, proc)
        for k, v in cpu.items():
            _same(seen[k], v)
        assert child_allocated >= sum(v.untyped_storage().nbytes() for v in dev.values()
                                      if v is not dev["view"])
        assert _get(to_parent, proc) == ("wrote",)
        for k in writes:
            ipc_workers.child_write(cpu[k])
        for k, v in cpu.items():
            _same(dev[k].cpu(), v)  # the child's writes, in the parent
        for k in ("float32", "int64", "bool"):
            ipc_workers.parent_write(dev[k])
            ipc_workers.parent_write(cpu[k])
        torch.sim.synchronize()
        to_child.put("parent wrote")
        tag, seen, _ = _get(to_parent, proc)
        for k, v in cpu.items():
            _same(seen[k], v)  # the parent's writes, in the child
        dev.clear()
        assert _collected(base) > 0  # the child still holds them
        to_child.put("release")
        tag, held, after = _get(to_parent, proc)
        assert tag == "released" and held > 0 and after < held
        assert _collected(base) == 0
        to_child.put("bye")
        proc.join(TIMEOUT)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()


@pytest.fixture(scope="module")
def forkserver():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.ipc_workers"])
    return ctx


def test_interprocess_events_order_work_across_processes(forkserver):
    """CUDA's producer/consumer pattern: the parent queues writes and records an
    interprocess event; the child's stream waits for it, reads, writes and records its
    own, which the parent synchronises on instead of the device. In asynchronous mode the
    parent's queue is held shut until the child saw its event pending."""
    rt = torchport_sim_runtime()
    t = torch.zeros(1000, device="sim")
    to_parent, to_child = forkserver.Queue(), forkserver.Queue()
    proc = forkserver.Process(target=ipc_workers.event_exchange, args=(t, to_parent, to_child))
    proc.start()
    try:
        gate = _slow_write(t, 50.0)  # (t moved into shareable memory as it was sent)
        ev = torch.sim.Event(interprocess=True)
        ev.record()
        to_child.put(ev.ipc_handle())
        assert _get(to_parent, proc) == ("queried", not rt.asynchronous)
        gate.set()
        tag, seen = _get(to_parent, proc)
        _same(seen, torch.full((1000,), 50.0))
        tag, handle = _get(to_parent, proc)
        theirs = torch.sim.Event.from_ipc_handle("sim:0", handle)
        theirs.synchronize()
        _same(t.cpu(), torch.full((1000,), 100.0))
        to_child.put("bye")
        proc.join(TIMEOUT)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()


def test_queue_of_tensors_to_a_forkserver_child(forkserver):
    """Tensors put one by one on a queue: the values arrive, and two sends of one storage
    open one storage in the child (as CUDA's cache of opened handles)."""
    base = _collected(0)
    inq, outq = forkserver.Queue(), forkserver.Queue()
    proc = forkserver.Process(target=ipc_workers.queue_reader, args=(inq, outq))
    proc.start()
    try:
        x = torch.randn(5, 7).to("sim")
        sent = [x, x[1:, 2:].t(), _values(torch.int32).to("sim"), torch.randn(300).to("sim")]
        for t in sent:
            inq.put(t)
        got = [_get(outq, proc) for _ in sent]
        for t, (device, values, _, back) in zip(sent, got, strict=True):
            assert device == "sim"
            _same(values, t.cpu())
            _same(back.cpu(), t.cpu())
        assert got[0][2] == got[1][2] and got[0][2] != got[2][2]
        expect = x.cpu()
        got[1][3].mul_(-2)  # the child's mapping, sent back: the same memory as x
        torch.sim.synchronize()
        expect[1:, 2:].t().mul_(-2)
        _same(x.cpu(), expect)
        inq.put(None)
        proc.join(TIMEOUT)
        assert proc.exitcode == 0
        del sent, x, t, got, back
        assert _collected(base) == 0  # the child released everything as it exited
    finally:
        if proc.is_alive():
            proc.kill()


def test_hogwild_training_by_two_processes(forkserver):
    """pytorch/examples' mnist_hogwild on the device, synthetic data: two processes
    train one model's shared parameters in place; the parent's model learns."""
    torch.manual_seed(0)
    model = ipc_workers.Net().to("sim")
    model.share_memory()
    before = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    data = [ipc_workers.hogwild_data(r) for r in (0, 1)]

    def loss() -> float:
        with torch.no_grad():
            return sum(F.cross_entropy(model(x.to("sim")), y.to("sim")).item() for x, y in data)

    start = loss()
    procs = [forkserver.Process(target=ipc_workers.hogwild_train, args=(r, model, 30))
             for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(TIMEOUT)
    assert [p.exitcode for p in procs] == [0, 0]
    for k, v in model.state_dict().items():
        assert not torch.equal(v.cpu(), before[k]), k
    assert loss() < 0.7 * start


def test_forked_child_keeps_the_fork_error():
    """fork after the parent used the device: a device tensor received there raises
    CUDA's "Cannot re-initialize ... in forked subprocess", as every other use does."""
    ctx = multiprocessing.get_context("fork")
    used = torch.ones(1, device="sim")
    inq, outq = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=ipc_workers.receive_error, args=(inq, outq))
    proc.start()
    try:
        inq.put(torch.arange(3.0, device="sim") + used)
        name, msg = _get(outq, proc)
        assert name == "ForkedDeviceError" and "use the 'spawn' start method" in msg, msg
        proc.join(TIMEOUT)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()


_HOGWILD_CUDA = '''\
"""pytorch/examples' mnist_hogwild with --cuda, synthetic data: CUDA code, unchanged."""
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def data(rank, device):
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(64, 16, generator=g)
    return x.to(device), x[:, :4].argmax(1).to(device)


def train(rank, model, device):
    x, y = data(rank, device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    for _ in range(30):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    torch.cuda.synchronize()


def loss(model, device):
    with torch.no_grad():
        return sum(F.cross_entropy(model(x), y).item() for x, y in (data(r, device) for r in (0, 1)))


if __name__ == "__main__":
    mp.set_start_method("spawn")
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = Net().to(device)
    model.share_memory()
    start = loss(model, device)
    procs = [mp.Process(target=train, args=(rank, model, device)) for rank in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    torch.cuda.ipc_collect()
    end = loss(model, device)
    print("exitcodes", [p.exitcode for p in procs], "device", model.fc1.weight.device.type,
          "learned", end < 0.7 * start)
'''


@pytest.mark.slow  # a real script: make examples runs it with the others
@pytest.mark.skipif(any(os.environ.get(k, "") not in ("", "0")
                        for k in ("TORCHPORT_SIM_STRICT", "TORCHPORT_SIM_ASYNC")),
                    reason="the CUDA script's path (torchport run, autoload in spawned "
                           "children) is the same in every memory mode: default stage only")
def test_mnist_hogwild_cuda_script_runs_unchanged(tmp_path):
    """mnist_hogwild's --cuda code, unchanged, under ``torchport run``: spawned children
    (registered by autoload) train the model the parent shared; the parent's learns."""
    script = tmp_path / "hogwild_cuda.py"
    script.write_text(_HOGWILD_CUDA)
    cli = Path(sys.executable).with_name("torchport")
    r = subprocess.run([str(cli), "run", str(script)], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300, env=child_env(importable=True,
                                                             OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "exitcodes [0, 0] device sim learned True" in r.stdout, r.stdout + r.stderr[-3000:]
