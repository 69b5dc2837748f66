"""The caching allocator in C++ (native_caching_allocator.cpp): the Python allocator's behaviour,
without a Python object per storage. Skipped where the C++ library does not serve."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch

import torchport.sim  # noqa: F401
from tests.helpers import MODE_VARIABLES, check_python, child_env
from torchport.backend import active_backend
from torchport.memory import allocator, tensors

pytestmark = pytest.mark.modes

_B = active_backend()
needs_cpp_allocator = pytest.mark.skipif(
    not isinstance(_B.allocators[0], allocator.NativeAllocator),
    reason="the C++ caching allocator does not serve (TORCHPORT_NATIVE=0 or no compiler)")


def _fresh() -> None:
    gc.collect()
    torch.sim.synchronize()
    torch.sim.empty_cache()


def _new(n: int, index: int = 0, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    size = [n // dtype.itemsize]
    return tensors.new_device_tensor(_B.devices[index], _B.allocators[index], n, dtype, size,
                                     [1], None)


@needs_cpp_allocator
def test_a_new_tensor_needs_no_python_object_for_its_block() -> None:
    _fresh()
    start = torch.sim.memory_allocated()
    t = _new(3000)
    assert not weakref.getweakrefs(t.untyped_storage())  # its deleter returns the block
    assert t.data_ptr() in _B.allocators[0].active
    assert torch.sim.memory_allocated() == start + allocator.round_size(3000)
    del t
    assert torch.sim.memory_allocated() == start


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool, torch.complex64,
                                   torch.bfloat16, torch.complex32])
def test_new_device_tensor_matches_wrap_block(dtype: torch.dtype) -> None:
    """Either allocator: the tensor new_device_tensor makes is the one malloc + wrap_block
    makes (dtype, layout, device), and holds values."""
    size, stride = [3, 4], [1, 3]  # column-major
    nbytes = tensors.storage_nbytes(size, stride, dtype.itemsize)
    alloc = _B.allocators[1]
    t = tensors.new_device_tensor(_B.devices[1], alloc, nbytes, dtype, size, stride, None)
    block = alloc.malloc(nbytes, None)
    u = tensors.wrap_block(_B.devices[1], alloc, block, nbytes, dtype, size, stride)
    for x in (t, u):
        assert (x.dtype, x.shape, x.stride(), x.device) == (dtype, u.shape, (1, 3), u.device)
        assert x.untyped_storage().nbytes() == nbytes and x.storage_offset() == 0
    if dtype is not torch.complex32:  # (no CPU kernels to fill it with)
        ref = torch.arange(12).reshape(3, 4).to(dtype)
        t.copy_(ref)
        assert torch.equal(t.cpu(), ref)
    empty = tensors.new_device_tensor(_B.devices[1], alloc, 0, dtype, [0, 4], [4, 1], None)
    assert empty.shape == (0, 4) and empty.device == _B.devices[1]


def test_new_device_tensor_over_the_python_allocator() -> None:
    """The fallback's path (the Python allocator, a weakref returning the block)."""
    py = allocator.DeviceAllocator(_B.runtime, _B.phys(0), 0, _B.name)
    t = tensors.new_device_tensor(_B.devices[0], py, 4096, torch.float32, [32, 32], [32, 1],
                                  None)
    assert py.allocated() == 4096 and t.data_ptr() in py.active
    t.fill_(2.0)
    assert torch.equal(t.cpu(), torch.full((32, 32), 2.0))
    del t
    assert py.allocated() == 0
    py.empty_cache()
    assert py.reserved() == 0


@needs_cpp_allocator
def test_segments_returned_from_cpp_reach_the_host_view_caches() -> None:
    _fresh()
    freed: list[tuple[int, int]] = []

    def hook(address: int, size: int) -> None:
        freed.append((address, size))
    allocator.SEGMENT_FREED.append(hook)
    try:
        t = _new(30 << 20)
        ptr = t.data_ptr()
        del t
        assert not freed  # cached
        torch.sim.empty_cache()
        assert any(a <= ptr < a + size for a, size in freed)
        assert torch.sim.memory_stats()["segment.large_pool.current"] == 0
    finally:
        allocator.SEGMENT_FREED.remove(hook)


@needs_cpp_allocator
def test_a_block_used_on_another_stream_waits_for_its_events() -> None:
    """Freed from its storage's deleter, a block record_stream marked waits for an event on
    that stream (through the stream layer), then is handed out again."""
    _fresh()
    alloc = _B.allocators[0]
    side = torch.sim.Stream(0)
    x = _new(4096)
    x.record_stream(side)
    ptr = x.data_ptr()
    assert alloc.active[ptr].stream_uses == {side}
    del x
    assert any(b.ptr == ptr for b in alloc.pending_blocks())
    side.synchronize()
    y = _new(4096)  # the event completed: released first, then this request parks/reuses
    assert not alloc.pending_blocks()
    assert y.data_ptr() == ptr


@needs_cpp_allocator
def test_out_of_memory_from_cpp_then_usable() -> None:
    _fresh()
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate 931.32 GiB"):
        _new(10**12, 1)
    with pytest.raises(torch.OutOfMemoryError, match="total capacity"):
        torch.UntypedStorage(10**12, device="sim:1")  # C++'s own allocate()
    assert torch.equal((_new(16, 1, torch.float32).fill_(1) + 1).cpu(), torch.full((4,), 2.0))


@needs_cpp_allocator
def test_threads_allocating_and_freeing_at_once() -> None:
    """The allocator's lock is taken by threads holding the GIL and threads that released
    it (ctypes calls); neither waits for the other forever, and every block returns."""
    _fresh()
    start = torch.sim.memory_allocated()
    errors: list[BaseException] = []

    def work(k: int) -> None:
        alloc = _B.allocators[0]
        try:
            keep: list[torch.Tensor] = []
            blocks: list[allocator.NativeBlock] = []
            for i in range(400):
                keep.append(_new(512 * (1 + (i * k) % 7)))
                keep.append(torch.empty(100 + i % 13, device="sim"))
                blocks.append(alloc.malloc(1000 + i))
                if len(keep) > 30:
                    del keep[:3]
                    alloc.free(blocks.pop(0).ptr)
            for b in blocks:
                alloc.free(b.ptr)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    gc.collect()
    assert torch.sim.memory_allocated() == start


_SEQUENCE = """
    import random, torch, torchport.sim
    from torchport.memory import tensors
    from torchport.backend import active_backend
    b = active_backend()
    print(type(b.allocators[0]).__name__)
    a = b.allocators[0]
    slow = [0]
    if hasattr(a, "_malloc"):  # the Python allocator: count the requests its hot path missed
        inner = a._malloc

        def counted(*args):
            slow[0] += 1
            return inner(*args)
        a._malloc = counted
    rng = random.Random(5)
    live, out = [], []
    for step in range(3000):
        if len(live) >= 24 or (live and rng.random() < 0.3):
            live.pop(rng.randrange(len(live)))
        n = rng.choice([rng.randint(1, 4096), rng.randint(1, 1 << 20),
                        rng.randint(1 << 20, 24 << 20)])
        try:
            live.append(tensors.new_device_tensor(b.devices[0], b.allocators[0], n,
                                                  torch.uint8, [n], [1], None))
        except torch.OutOfMemoryError:
            out.append(("oom", step))
        if step % 500 == 499:
            out.append(sorted(torch.sim.memory_stats().items()))
            bases = {s["address"] for s in torch.sim.memory_snapshot()}
            out.append(sorted((s["total_size"], [(x["address"] - s["address"], x["size"],
                                                   x["state"]) for x in s["blocks"]])
                              for s in torch.sim.memory_snapshot()))
        if step == 1700:
            torch.sim.empty_cache()
            torch.sim.reset_peak_memory_stats()
    out.append(("slow mallocs", getattr(a, "slow_mallocs", slow[0])))
    print(out)
"""


def test_cpp_and_python_allocators_agree() -> None:
    """The same requests on a 192 MiB device: the same statistics (every counter and peak,
    out-of-memory errors included), the same segments carved the same way, and as many
    requests served by an exact-size parked block. On device-only (strict) memory: best-fit
    breaks ties between equal blocks by address, as CUDA's allocator does, and the sim's
    default device addresses are the host's, whose order changes with the rest of the
    process (the two allocators then agreed with each other per layout, not across runs);
    strict addresses are the runtime's own, the same in every run."""
    outs = {}
    for native in ("1", "0"):
        env = child_env(drop=MODE_VARIABLES, importable=True, TORCHPORT_NATIVE=native,
                        TORCHPORT_SIM_MEMORY="192MiB", TORCHPORT_SIM_STRICT="1")
        outs[native] = check_python(_SEQUENCE, env=env, timeout=600).splitlines()
    assert outs["0"][0] == "DeviceAllocator"
    if outs["1"][0] != "NativeAllocator":
        pytest.skip("the C++ library does not serve in a child process here")
    assert "('oom', " in outs["1"][1]  # the sequence reaches the device's capacity
    assert outs["1"][1] == outs["0"][1]


@needs_cpp_allocator
def test_a_cpp_storage_resized_in_place_moves_its_blocks() -> None:
    """``UntypedStorage.resize_`` on storages whose blocks their deleters return: the old
    block goes back once, the new one is the storage's, every view sees it."""
    _fresh()
    start = torch.sim.memory_allocated()
    t = _new(24, 0, torch.float32).copy_(torch.arange(6.0))
    view = t[2:]
    st = t.untyped_storage()
    st.resize_(4096)
    assert torch.equal(view.cpu(), torch.tensor([2.0, 3.0, 4.0, 5.0]))  # the bytes kept
    assert torch.sim.memory_allocated() == start + 4096
    st.resize_(0)
    assert torch.sim.memory_allocated() == start and view.untyped_storage().nbytes() == 0
    st.resize_(24)
    t.copy_(torch.arange(6.0) * 2)
    assert torch.equal(view.cpu(), torch.tensor([4.0, 6.0, 8.0, 10.0]))
    del t, view, st
    gc.collect()
    assert torch.sim.memory_allocated() == start


@needs_cpp_allocator
def test_a_block_freed_from_python_the_allocator_called_returns_after() -> None:
    """A storage dropped by Python code the allocator runs (a SEGMENT_FREED hook, while it
    returns segments) is freed once that operation finished, not in its middle."""
    _fresh()
    start = torch.sim.memory_allocated()
    held = [_new(4096)]
    seen: list[int] = []

    def hook(address: int, size: int) -> None:
        seen.append(torch.sim.memory_allocated())  # (a read inside the operation)
        held.clear()  # the block's deleter runs here, inside empty_cache
    allocator.SEGMENT_FREED.append(hook)
    try:
        big = _new(30 << 20)
        del big
        torch.sim.empty_cache()
    finally:
        allocator.SEGMENT_FREED.remove(hook)
    assert seen and not held
    assert torch.sim.memory_allocated() == start


@needs_cpp_allocator
def test_an_adopted_result_needs_no_python_object_and_returns_to_the_host() -> None:
    """A large CPU result the runtime adopts as device memory is a storage of the C++
    allocator too: no weak reference, one owner (so autograd adds gradients into it in
    place, as on CUDA), counted while alive, given back to the runtime when it dies."""
    if not _B.adopts_host or _B.runtime.strict:
        pytest.skip("the runtime adopts no host memory in this mode")
    _fresh()
    start, segments = torch.sim.memory_allocated(), len(_B.runtime._dev(0).segments)
    cpu = torch.arange(float(1 << 19))  # 2 MiB
    address = cpu.data_ptr()
    t = _B.result_to_device(cpu, 0)
    del cpu
    st = t.untyped_storage()
    assert t.data_ptr() == address  # adopted, not copied
    assert not weakref.getweakrefs(st)
    assert torch._C._storage_Use_Count(st._cdata) == 2  # t and st: no Python object of ours
    assert _B.allocators[0].active[address].adopted
    assert torch.sim.memory_allocated() == start + (1 << 21)
    assert torch.equal(t[-3:].cpu(), torch.tensor([524285.0, 524286.0, 524287.0]))
    del t, st
    assert torch.sim.memory_allocated() == start
    assert len(_B.runtime._dev(0).segments) == segments  # the host memory went back


def _accumulated_in_place(device: str) -> bool:
    """Does autograd add the two gradients of ``y`` (2.3 MiB each, each a matmul of a small
    gradient: on the sim, results the host computed and the runtime adopted) into one of
    them?"""
    x = torch.randn(1024, 600, device=device, requires_grad=True)
    y = x * 1.0
    branches, summed = [], []
    outs = [y @ torch.randn(600, 4, device=device) for _ in range(2)]
    for out in outs:
        out.grad_fn.register_hook(lambda grad_in, grad_out: branches.append(grad_in[0].data_ptr()))
    y.register_hook(lambda grad: summed.append(grad.data_ptr()))
    (outs[0].sum() + outs[1].sum()).backward()
    return len(summed) == 1 and len(branches) == 2 and summed[0] in branches


@needs_cpp_allocator
def test_gradients_of_adopted_results_accumulate_in_place() -> None:
    """Two gradients of one large tensor (adopted results of the host-op kernels): the
    engine adds one into the other, as it does on the CPU and CUDA."""
    assert _accumulated_in_place("cpu")
    if not _B.adopts_host or _B.runtime.strict:
        pytest.skip("the runtime adopts no host memory in this mode")
    assert _accumulated_in_place("sim")
