"""nn.DataParallel over the sim devices (torch._C's comm functions), and pinned memory."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.parallel import comm
from torch.utils.data import DataLoader, TensorDataset

import torchport.sim
from tests.helpers import ExactNet, check_python, exact_batches, exact_net, train_exact
from torchport.core import compat, native
from torchport.distributed.parallel_comm import NAMES, route
from torchport.memory.pinned import PinnedMemoryWarning

B = torchport.sim.BACKEND
NO_NCCL = pytest.mark.filterwarnings("ignore:PyTorch is not compiled with NCCL support")


# ---- torch._C's comm functions -------------------------------------------------------

def test_comm_functions_are_the_devices_or_route_to_it():
    # a CPU build has none: they are new; a CUDA build's are wrapped, kept for CUDA tensors
    for name in NAMES:
        fn = getattr(torch._C, name)
        assert fn.__module__ == "torchport.distributed.parallel_comm"
        assert (getattr(fn, "__wrapped__", None) is not None) == (name in compat.BUILD_COMM)


def test_routing_between_the_device_and_the_builds_functions():
    calls = []
    routed = route("sim", lambda *a, **k: calls.append("own"),
                   lambda *a, **k: calls.append("build"))
    cpu, dev = torch.zeros(2), torch.zeros(2, device="sim")
    routed(dev, [0, 1])
    routed([dev, dev], 0, None)
    routed(cpu, [0, 1], None, 0, [torch.sim.Stream(1), None])
    routed(cpu, out=[dev])
    assert calls == ["own"] * 4
    calls.clear()
    routed(cpu, [0, 1])  # device indices only: CUDA's where a CUDA device is usable
    routed(torch.zeros(2, device="meta"), [0])
    assert calls == ["build" if compat.cuda_usable() else "own"] * 2
    calls.clear()
    with FakeTensorMode():  # a CUDA tensor on any build, without a GPU
        cuda = torch.empty(2, device="cuda")
    routed(cuda, [0, 1])
    routed([cuda], 0, -1)
    assert calls == ["build", "build"]


def test_broadcast():
    cpu = torch.arange(6.).view(2, 3)
    a, b = comm.broadcast(cpu, [0, 1])
    assert (a.device, b.device) == (torch.device("sim", 0), torch.device("sim", 1))
    assert torch.equal(a.cpu(), cpu) and torch.equal(b.cpu(), cpu)
    src = cpu.to("sim:1")
    got = comm.broadcast(src, [1, 0])
    assert got[0] is src and got[1].device == torch.device("sim", 0)  # its own device: as is
    out = [torch.zeros(2, 3, device="sim:0"), torch.zeros(2, 3, device="sim:1")]
    assert all(o is p for o, p in zip(comm.broadcast(cpu, out=out), out, strict=True))
    assert all(torch.equal(o.cpu(), cpu) for o in out)
    with pytest.raises(RuntimeError, match="output tensor at index 1 has device 'cpu'"):
        comm.broadcast(cpu, out=[out[0], torch.zeros(2, 3)])
    with pytest.raises(RuntimeError, match=r"same shape as the source tensor \[2, 3\], but "
                                           r"output tensor at index 0 has shape \[3, 2\]"):
        comm.broadcast(cpu, out=[torch.zeros(3, 2, device="sim")])
    with pytest.raises(RuntimeError, match="non-negative device index, but got -1"):
        torch._C._broadcast(cpu, [-1])
    with pytest.raises(RuntimeError, match="CPU or sim tensor to broadcast, but got a tensor "
                                           "on meta"):
        comm.broadcast(torch.empty(2, device="meta"), [0, 1])


def test_broadcast_coalesced_groups_by_buffer_size_and_keeps_order():
    src = [torch.arange(4.), torch.arange(3), torch.ones(2, 2), torch.arange(5.) / 2,
           torch.tensor([True, False])]
    dev = [t.to("sim:0") for t in src]
    outs = comm.broadcast_coalesced(dev, [0, 1], buffer_size=20)  # several chunks per dtype
    assert len(outs) == 2 and all(o is d for o, d in zip(outs[0], dev, strict=True))
    for o, s in zip(outs[1], src, strict=True):
        assert o.device == torch.device("sim", 1) and o.dtype == s.dtype
        assert torch.equal(o.cpu(), s) and not o.requires_grad
    # coalesced copies share a buffer but not a version counter (CUDA re-wraps them)
    floats = [o for o in outs[1] if o.dtype == torch.float32]
    before = [o._version for o in floats]
    floats[0].add_(1)
    assert [o._version for o in floats][1:] == before[1:]
    with pytest.raises(RuntimeError, match=r"All tensors must be on devices\[0\]: 0 \(tensor at "
                                           r"index 1 is on cpu\)"):
        comm.broadcast_coalesced([dev[0], src[1]], [0, 1])
    assert comm.broadcast_coalesced([], [0, 1]) == [[], []]


def test_scatter_with_chunk_sizes_and_streams():
    x = torch.arange(24.).view(4, 6)
    s1 = torch.sim.Stream(1)
    parts = comm.scatter(x, [0, 1], chunk_sizes=[2, 4], dim=-1, streams=[None, s1])
    s1.synchronize()
    assert [p.device.index for p in parts] == [0, 1]
    assert torch.equal(parts[0].cpu(), x[:, :2]) and torch.equal(parts[1].cpu(), x[:, 2:])
    dev = x.to("sim:0")
    parts = comm.scatter(dev, [0, 1])  # torch.chunk's split, the own device's chunk a view
    assert parts[0].data_ptr() == dev.data_ptr() and torch.equal(parts[1].cpu(), x[2:])
    assert len(comm.scatter(torch.arange(3.), [0, 1, 0, 1])) == 3  # chunk makes fewer chunks
    with pytest.raises(RuntimeError, match=r"stream at index 0 \(was 1\) to match the device "
                                           r"supplied at that index \(expected 0\)"):
        comm.scatter(x, [0, 1], streams=[s1, None])
    with pytest.raises(RuntimeError, match="Need torch.sim.Stream or None"):
        comm.scatter(x, [0, 1], streams=["s"])
    with pytest.raises(RuntimeError, match="same length, but got len.devices. = 2 and "
                                           "len.chunk_sizes. = 3"):
        comm.scatter(x, [0, 1], chunk_sizes=[1, 1, 2])
    with pytest.raises(IndexError, match="Dimension out of range"):
        comm.scatter(x, [0, 1], dim=2)
    out = [torch.zeros(1, 6, device="sim:1"), torch.zeros(3, 6, device="sim:0")]
    assert comm.scatter(x, out=out) == tuple(out)
    assert torch.equal(torch.cat([o.cpu() for o in out]), x)
    with pytest.raises(RuntimeError, match="Total size for output tensors along scatter dim 0 "
                                           "does not match the source tensor size at dim 0. "
                                           "Expected 4, but got total size 2"):
        comm.scatter(x, out=[torch.zeros(1, 6, device="sim:0")] * 2)
    with pytest.raises(RuntimeError, match=r"Output tensor at index 0 has incorrect shape: "
                                           r"\[1, 5\]"):
        comm.scatter(x, out=[torch.zeros(1, 5, device="sim:0")])


def test_gather():
    parts = [torch.arange(6.).view(2, 3).to("sim:1"), torch.arange(3.).view(1, 3).to("sim:0")]
    want = torch.cat([p.cpu() for p in parts])
    g = comm.gather(parts, destination=0)
    assert g.device == torch.device("sim", 0) and torch.equal(g.cpu(), want)
    assert comm.gather(parts).device == torch.device("sim", B.current_device())
    with pytest.warns(FutureWarning):
        assert comm.gather(parts, destination=-1).device.type == "cpu"
    g = comm.gather(parts, destination="cpu")
    assert g.device.type == "cpu" and torch.equal(g, want)
    cl = [torch.randn(1, 2, 3, 3).to("sim:0", memory_format=torch.channels_last)
          for _ in range(2)]
    assert comm.gather(cl, destination=1).is_contiguous(memory_format=torch.channels_last)
    out = torch.empty(3, 3)
    assert comm.gather(parts, out=out) is out and torch.equal(out, want)
    with pytest.raises(RuntimeError, match="Expected out tensor to have shape"):
        comm.gather(parts, out=torch.empty(4, 3, device="sim"))
    with pytest.raises(RuntimeError, match="Expected all input tensors to be sim tensors, but "
                                           "tensor at index 1 has device cpu"):
        comm.gather([parts[0], want])
    with pytest.raises(RuntimeError, match=r"Input tensor at index 1 has invalid shape \[1, 2\], "
                                           r"but expected \[1, 3\]"):
        comm.gather([parts[0], torch.zeros(1, 2, device="sim")], dim=0)
    with pytest.raises(RuntimeError, match="at least one tensor"):
        comm.gather([])


@NO_NCCL
def test_reduce_add():
    parts = [torch.arange(4.).to("sim:0"), torch.ones(4).to("sim:1")]
    r = comm.reduce_add(parts, destination=1)
    assert r.device == torch.device("sim", 1) and torch.equal(r.cpu(), torch.arange(4.) + 1)
    grads = [[torch.ones(2, 2).to(f"sim:{d}"), torch.arange(3).to(f"sim:{d}")] for d in (0, 1)]
    a, b = comm.reduce_add_coalesced(grads, destination=0)
    assert torch.equal(a.cpu(), torch.full((2, 2), 2.)) and torch.equal(b.cpu(), torch.arange(3) * 2)


# ---- DataParallel -----------------------------------------------------------------------

@NO_NCCL
@pytest.mark.parametrize("inputs_on", ["cpu", "sim"])
def test_dataparallel_trains_as_on_the_cpu_bit_for_bit(inputs_on):
    batches = exact_batches(4)
    want = train_exact(exact_net(), batches, "cpu")
    dp = nn.DataParallel(exact_net().to("sim"))
    assert dp.device_ids == [0, 1] and dp.output_device == 0
    got = train_exact(dp, batches, inputs_on)  # CPU inputs scattered, sim ones split on sim:0
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert all(p.device == torch.device("sim", 0) for p in dp.parameters())
    x = batches[0][0]
    with torch.no_grad():  # replicas made without autograd (detached broadcast)
        out = dp(x)
    assert out.device == torch.device("sim", 0)
    assert torch.equal(out.cpu(), dp.module.cpu()(x))


@NO_NCCL
def test_dataparallel_float32_matches_the_cpu_within_rounding():
    # Each device sums its half of the batch and reduce_add adds the halves: another
    # order of the same float32 additions than the CPU's single matmul, so a few ULPs.
    torch.manual_seed(0)
    cpu = ExactNet(torch.float32)
    dev = ExactNet(torch.float32)
    dev.load_state_dict(cpu.state_dict())
    batches = [(torch.randn(10, 4), torch.randn(10, 2)) for _ in range(3)]
    want = train_exact(cpu, batches, "cpu", grid=False)
    got = train_exact(nn.DataParallel(dev.to("sim")), batches, "cpu", grid=False)  # chunks: 5
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


# ---- pinned memory --------------------------------------------------------------------------

needs_native = pytest.mark.skipif(not B.pinned_memory,
                                  reason=f"no C++ hooks: {native.UNAVAILABLE or 'off'}")


@needs_native
def test_pin_memory_gives_pinned_host_memory():
    t = torch.arange(6.)
    assert not t.is_pinned()
    p = t.pin_memory()
    assert p.is_pinned() and p[2:].is_pinned() and p.device.type == "cpu"
    assert torch.equal(p, t) and p.data_ptr() != t.data_ptr()
    assert p.pin_memory() is p  # pinned already: itself, as on CUDA
    e = torch.empty(3, 4, pin_memory=True)
    assert e.is_pinned()
    held = native.pinned_bytes()
    assert held >= 6 * 4 + 12 * 4
    del p, e
    gc.collect()
    assert native.pinned_bytes() == held - 6 * 4 - 12 * 4  # freed with the tensors


RUNTIME_HOST_MEMORY = """
import ctypes, gc, torch
from torch.utils.data import DataLoader, TensorDataset
from torchport.backends.sim import SimRuntime, make_backend

class PageLocked(SimRuntime):
    # host memory of the runtime's own (a real one would page-lock it with its driver)
    def __init__(self):
        super().__init__()
        self.blocks, self.freed = {}, []
    def host_alloc(self, nbytes):
        buf = ctypes.create_string_buffer(nbytes + 64)
        address = (ctypes.addressof(buf) + 63) // 64 * 64
        self.blocks[address] = buf
        return address
    def host_free(self, ptr):
        del self.blocks[ptr]
        self.freed.append(ptr)

rt = PageLocked()
make_backend(rt).register()
p = torch.arange(6.).pin_memory()
assert p.is_pinned() and p.data_ptr() in rt.blocks and torch.equal(p, torch.arange(6.))
address = p.data_ptr()
del p
gc.collect()
assert rt.freed == [address] and not rt.blocks
ds = TensorDataset(torch.arange(32.).view(16, 2), torch.arange(16))
batches = list(DataLoader(ds, batch_size=4, pin_memory=True, num_workers=2))
assert all(x.is_pinned() and x.data_ptr() in rt.blocks for x, _ in batches)
dev = [x.to("sim", non_blocking=True) for x, _ in batches]
assert torch.equal(torch.cat([d.cpu() for d in dev]), torch.arange(32.).view(16, 2))
print("ok")
"""


@needs_native
def test_pinned_blocks_come_from_the_runtimes_host_memory():
    assert check_python(RUNTIME_HOST_MEMORY, TORCHPORT_FALLBACK_WARN="0").strip() == "ok"


@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader_pin_memory_trains_as_on_the_cpu(workers):
    xs, ys = zip(*exact_batches(4), strict=True)
    ds = TensorDataset(torch.cat(xs), torch.cat(ys))
    want = train_exact(exact_net(), exact_batches(4), "cpu")
    loader = DataLoader(ds, batch_size=8, pin_memory=True, num_workers=workers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PinnedMemoryWarning)
        batches = list(loader)
    assert all(x.is_pinned() == B.pinned_memory for x, _ in batches)
    got = train_exact(exact_net().to("sim"), batches, "sim")
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_fresh_process_without_the_cpp_library():
    # The comm functions come with the registration of a backend and replace nothing a
    # build has (a CUDA build's: wrapped, still called for CUDA tensors); without the C++ hooks, pinning warns once and gives
    # unpinned copies, and DataParallel serves with PyTorch's Python guard (whose streams
    # all name device 0).
    out = check_python(
        "import warnings, torch, torchport\n"
        "from torchport.distributed.parallel_comm import NAMES\n"
        "from torchport.core.compat import BUILD_COMM\n"
        "assert {n for n in NAMES if hasattr(torch._C, n)} == BUILD_COMM  # the build's\n"
        "mine = lambda *a: 'pytorch'\n"
        "torch._C._gather_out = mine\n"
        "import torchport.sim\n"
        "assert torch._C._gather_out.__wrapped__ is mine  # kept, for CUDA tensors\n"
        "assert all(hasattr(torch._C, n) for n in NAMES)\n"
        "from torch.utils.data import DataLoader, TensorDataset\n"
        "from torchport.memory.pinned import PinnedMemoryWarning\n"
        "from tests.helpers import exact_net, exact_batches, train_exact\n"
        "warnings.simplefilter('ignore')\n"
        "assert not torchport.sim.BACKEND.pinned_memory\n"
        "xs, ys = zip(*exact_batches(4))\n"
        "ds = TensorDataset(torch.cat(xs), torch.cat(ys))\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always', PinnedMemoryWarning)\n"
        "    batches = list(DataLoader(ds, batch_size=8, pin_memory=True))\n"
        "    p = torch.arange(3.).pin_memory()\n"
        "assert len([x for x in w if x.category is PinnedMemoryWarning]) == 1, w\n"
        "assert torch.equal(p, torch.arange(3.)) and not p.is_pinned()\n"
        "want = train_exact(exact_net(), exact_batches(4), 'cpu')\n"
        "got = train_exact(exact_net().to('sim'), batches, 'sim')\n"
        "assert all(torch.equal(g, v) for g, v in zip(got, want))\n"
        "got = train_exact(torch.nn.DataParallel(exact_net().to('sim')), exact_batches(4),\n"
        "                  'cpu')\n"
        "assert all(torch.equal(g, v) for g, v in zip(got, want))\n"
        "print('ok')\n", TORCHPORT_NATIVE="0", TORCHPORT_FALLBACK_WARN="0")
    assert out.strip() == "ok"


ASYNC_COPIES = """
import threading, warnings, torch, torchport.sim
warnings.simplefilter("ignore")
rt = torchport.sim.runtime
assert rt.asynchronous
x = torch.arange(8.)
d0 = x.to("sim:0")
gate0, gate1 = threading.Event(), threading.Event()
# default streams: the runtime copies at once, after the work queued on sim:0
rt.launch(0, None, gate0.wait, "gate")
w = d0 * 2                                      # queued behind the gate
threading.Timer(0.2, gate0.set).start()
assert torch.equal(w.to("sim:1", non_blocking=True).cpu(), x * 2)
# another stream of sim:1: the copy is queued there, after the work queued on sim:0
gate0.clear()
rt.launch(0, None, gate0.wait, "gate")
w = d0 * 3
s1 = torch.sim.Stream(1)
with torch.sim.stream(s1):
    b = w.to("sim:1", non_blocking=True)
assert not s1.query()                           # waits for sim:0's gate
gate0.set()
s1.synchronize()
assert torch.equal(b.cpu(), x * 3)
# ... and the work sim:0 queues next waits for the copy to have read the source
rt.launch(1, s1.handle, gate1.wait, "gate")
with torch.sim.stream(s1):
    b = w.to("sim:1", non_blocking=True)
threading.Timer(0.3, gate1.set).start()
w.zero_()
s1.synchronize()
assert torch.equal(b.cpu(), x * 3)
# DataParallel, kernels queued on both devices
from tests.helpers import exact_net, exact_batches, train_exact
want = train_exact(exact_net(), exact_batches(4), "cpu")
got = train_exact(torch.nn.DataParallel(exact_net().to("sim")), exact_batches(4), "cpu")
assert all(torch.equal(g, v) for g, v in zip(got, want))
print("ok")
"""


def test_async_copies_between_devices_are_ordered_as_on_cuda():
    # A non-blocking copy between two devices waits for the work queued on the source's
    # stream and the destination's, and later work on either waits for it (CUDA's
    # two-way barrier); DataParallel's broadcasts, gathers and reduce_add rely on it.
    out = check_python(ASYNC_COPIES, TORCHPORT_SIM_ASYNC="1", TORCHPORT_FALLBACK_WARN="0")
    assert out.strip() == "ok"
