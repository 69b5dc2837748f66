"""Caching allocator, statistics and OOM (issue 2, item 5)."""

import gc

import pytest
import torch

from torchport.backend import active_backend
from torchport.memory.allocator import K_SMALL_BUFFER, round_size

pytestmark = pytest.mark.modes


def _fresh():
    gc.collect()
    torch.sim.synchronize()
    torch.sim.empty_cache()


def test_allocated_counts_rounded_blocks_and_returns_to_start():
    _fresh()
    start = torch.sim.memory_allocated()
    t = torch.empty(1000, dtype=torch.uint8, device="sim")
    assert torch.sim.memory_allocated() == start + round_size(1000)
    assert torch.sim.memory_reserved() >= K_SMALL_BUFFER
    del t
    assert torch.sim.memory_allocated() == start


def test_block_reuse_no_new_segment():
    _fresh()
    t = torch.empty(256, device="sim")
    ptr = t.data_ptr()
    reserved = torch.sim.memory_reserved()
    del t
    u = torch.empty(256, device="sim")
    assert u.data_ptr() == ptr
    assert torch.sim.memory_reserved() == reserved


def test_splitting_small_segment():
    _fresh()
    a = torch.empty(128, device="sim")
    b = torch.empty(128, device="sim")
    assert abs(a.data_ptr() - b.data_ptr()) == 512  # both carved from one 2 MiB segment
    assert torch.sim.memory_stats()["segment.all.current"] >= 1


def test_stats_names_like_cuda():
    _fresh()
    torch.sim.reset_peak_memory_stats()
    x = torch.empty(3 << 20, dtype=torch.uint8, device="sim")
    st = torch.sim.memory_stats()
    for key in ("allocated_bytes.all.current", "allocated_bytes.all.peak",
                "reserved_bytes.all.current", "reserved_bytes.all.peak", "active_bytes.all.current",
                "active_bytes.all.peak", "allocation.all.allocated", "allocation.all.freed",
                "num_ooms", "num_alloc_retries", "segment.large_pool.current"):
        assert key in st
    assert torch.sim.max_memory_allocated() >= 3 << 20
    peak = torch.sim.max_memory_allocated()
    del x
    assert torch.sim.max_memory_allocated() == peak
    torch.sim.reset_peak_memory_stats()
    assert torch.sim.max_memory_allocated() == torch.sim.memory_allocated()
    assert torch.sim.max_memory_reserved() >= torch.sim.memory_reserved()


def test_empty_cache_releases_reserved():
    _fresh()
    base = torch.sim.memory_reserved()
    x = torch.empty(30 << 20, dtype=torch.uint8, device="sim")
    assert torch.sim.memory_reserved() >= base + (30 << 20)
    del x
    torch.sim.empty_cache()
    assert torch.sim.memory_reserved() == base


def test_mem_get_info_and_summary_and_snapshot():
    _fresh()
    free, total = torch.sim.mem_get_info()
    assert total == torch.sim.get_device_properties(0).total_memory and 0 < free <= total
    x = torch.empty(1 << 20, dtype=torch.uint8, device="sim")  # noqa: F841
    assert torch.sim.mem_get_info()[0] < free
    s = torch.sim.memory_summary()
    assert "Allocated memory" in s and "SIM OOMs" in s
    snap = torch.sim.memory_snapshot()
    assert any(b["state"] == "active_allocated" for seg in snap for b in seg["blocks"])


def test_oom_message_and_recovery():
    _fresh()
    before = torch.sim.memory_stats()["num_ooms"]
    keep = torch.ones(10, device="sim")
    with pytest.raises(torch.OutOfMemoryError) as ei:
        torch.empty(10**12, dtype=torch.uint8, device="sim")
    msg = str(ei.value)
    assert "Tried to allocate" in msg and "total capacity" in msg and "reserved" in msg
    assert torch.sim.memory_stats()["num_ooms"] == before + 1
    assert torch.sim.memory_stats()["num_alloc_retries"] >= 1
    assert torch.equal((keep + 1).cpu(), torch.full((10,), 2.0))


def test_oom_frees_cache_then_retries():
    _fresh()
    total = torch.sim.get_device_properties(1).total_memory
    big = int(total * 0.6)
    x = torch.empty(big, dtype=torch.uint8, device="sim:1")
    del x  # cached, not returned
    assert torch.sim.memory_reserved(1) >= big
    y = torch.empty(big + (4 << 20), dtype=torch.uint8, device="sim:1")  # needs the cache freed
    assert y.numel() == big + (4 << 20)
    assert torch.sim.memory_stats(1)["num_alloc_retries"] >= 1
    del y
    torch.sim.empty_cache()


def test_per_process_memory_fraction():
    _fresh()
    torch.sim.set_per_process_memory_fraction(0.001, 1)
    try:
        with pytest.raises(torch.OutOfMemoryError, match="set_per_process_memory_fraction"):
            torch.empty(64 << 20, dtype=torch.uint8, device="sim:1")
    finally:
        torch.sim.set_per_process_memory_fraction(1.0, 1)
    with pytest.raises(ValueError):
        torch.sim.set_per_process_memory_fraction(2.0)


def test_no_leak_over_training_iterations():
    _fresh()
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 4)).to("sim")
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(8, 16, device="sim"), torch.randn(8, 4, device="sim")

    def step():
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    for _ in range(5):
        step()
    start_alloc, start_res = torch.sim.memory_allocated(), torch.sim.memory_reserved()
    for _ in range(1000):
        step()
    assert torch.sim.memory_allocated() == start_alloc
    assert torch.sim.memory_reserved() == start_res


def test_large_blocks_are_reused_at_their_address():
    _fresh()
    x = torch.empty(3 << 20, dtype=torch.uint8, device="sim")
    y = torch.empty(5 << 20, dtype=torch.uint8, device="sim")
    px, py = x.data_ptr(), y.data_ptr()
    reserved = torch.sim.memory_reserved()
    del x, y
    assert torch.sim.memory_allocated() < reserved
    # the same sizes again, in the other order: merged blocks would give y2 x's address
    y2 = torch.empty(5 << 20, dtype=torch.uint8, device="sim")
    x2 = torch.empty(3 << 20, dtype=torch.uint8, device="sim")
    assert (x2.data_ptr(), y2.data_ptr()) == (px, py)
    assert torch.sim.memory_reserved() == reserved


def test_held_large_blocks_merge_before_the_pool_grows():
    _fresh()
    pieces = [torch.empty(4 << 20, dtype=torch.uint8, device="sim") for _ in range(5)]
    reserved = torch.sim.memory_reserved()
    del pieces  # held unmerged for exact-size reuse ...
    whole = torch.empty(18 << 20, dtype=torch.uint8, device="sim")  # ... merged for this
    assert torch.sim.memory_reserved() == reserved
    del whole
    torch.sim.empty_cache()
    assert torch.sim.memory_stats()["segment.large_pool.current"] == 0


def test_small_requests_repeating_each_step_keep_their_blocks():
    """A step asking for four 512 KiB blocks, then one of 1 MiB: the second request gets a
    segment of its own rather than taking the held 512 KiB blocks apart, so every later
    step reuses the same blocks (exact-size, same addresses) and the cache stops growing."""
    _fresh()

    def step() -> list[int]:
        quarter = [torch.empty(512 << 10, dtype=torch.uint8, device="sim") for _ in range(4)]
        ptrs = [t.data_ptr() for t in quarter]
        del quarter
        half = torch.empty(1 << 20, dtype=torch.uint8, device="sim")
        return ptrs + [half.data_ptr()]

    before = torch.sim.memory_reserved()
    step()
    first, reserved = step(), torch.sim.memory_reserved()
    for _ in range(3):
        assert step() == first
    assert torch.sim.memory_reserved() == reserved <= before + 2 * (2 << 20)  # two segments


def test_small_requests_take_held_blocks_apart_when_the_device_has_no_room():
    _fresh()
    total = torch.sim.get_device_properties(1).total_memory
    quarter = [torch.empty(512 << 10, dtype=torch.uint8, device="sim:1") for _ in range(4)]
    reserved = torch.sim.memory_reserved(1)
    del quarter  # held for exact-size reuse; no room for another 2 MiB segment:
    torch.sim.set_per_process_memory_fraction((reserved + (1 << 20)) / total, 1)
    alloc = active_backend().allocators[1]
    try:
        retries = alloc.num_alloc_retries  # (memory_stats() would merge the held blocks)
        half = torch.empty(1 << 20, dtype=torch.uint8, device="sim:1")  # from two of them
        assert alloc.num_alloc_retries == retries  # no cache flush was needed
        assert torch.sim.memory_reserved(1) == reserved
        del half
    finally:
        torch.sim.set_per_process_memory_fraction(1.0, 1)
    torch.sim.empty_cache()


def test_a_merge_for_one_request_leaves_the_other_sizes_held():
    _fresh()
    alloc = active_backend().allocators[0]
    small = [torch.empty(3000, dtype=torch.uint8, device="sim") for _ in range(4)]
    pieces = [torch.empty(4 << 20, dtype=torch.uint8, device="sim") for _ in range(5)]
    reserved = torch.sim.memory_reserved()
    del small, pieces
    held = alloc.num_parked
    whole = torch.empty(18 << 20, dtype=torch.uint8, device="sim")  # needs the pieces merged
    assert torch.sim.memory_reserved() == reserved
    assert alloc.num_parked == held - 5  # the small blocks keep their exact-size reuse
    assert len(alloc.parked.get((id(None), round_size(3000)), [])) >= 4
    del whole


def test_reading_the_statistics_changes_none_of_them():
    keep = [torch.empty(n, device="sim") for n in (3000, 5000, 7000)]
    del keep[1]  # a free block inside a split segment
    first = torch.sim.memory_stats()
    assert first == torch.sim.memory_stats() == torch.sim.memory_stats()
    for pool in ("all", "small_pool", "large_pool"):
        for name in ("inactive_split", "inactive_split_bytes"):
            s = {m: first[f"{name}.{pool}.{m}"] for m in ("current", "allocated", "freed")}
            assert s["allocated"] - s["freed"] == s["current"]


def test_a_learnt_refusal_keeps_no_device_tensor_alive():
    """The CPU's refusal of an op's dtypes is learnt once and kept: not with the traceback
    of the call that learnt it, whose frames hold its device arguments."""
    _fresh()
    start = torch.sim.memory_allocated()
    f = torch.ones(5, 4, device="sim")
    torch.logaddexp(f, f, out=torch.empty_like(f))  # the overload's path: a decomposition
    x = f.bool()
    out = torch.empty(5, 4, dtype=torch.bool, device="sim")
    with pytest.raises(NotImplementedError):
        torch.logaddexp(x, x, out=out)
    del f, x, out
    gc.collect()
    assert torch.sim.memory_allocated() == start
