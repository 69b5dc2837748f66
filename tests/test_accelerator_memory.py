"""torch.accelerator's memory API on the device: the C++ DeviceAllocator of
native_allocator.cpp answering from torchport's caching allocator
(torchport.device.accelerator_memory), in every sim mode; without the C++ library, PyTorch's error."""

from __future__ import annotations

import ctypes
import gc
import operator
import subprocess

import pytest
import torch

from tests.helpers import mode_independent, run_python
from torchport.backend import active_backend
from torchport.core import native
from torchport.device import accelerator_memory
from torchport.memory.allocator import round_size

pytestmark = pytest.mark.modes

needs_cpp = pytest.mark.skipif(native.load() is None,
                               reason=f"no C++ library: {native.UNAVAILABLE or 'TORCHPORT_NATIVE=0'}")
_new_storage = torch._C.StorageBase.__new__  # C++'s constructor, under torchport's Python one


def _fresh() -> None:
    gc.collect()
    for i in range(torch.sim.device_count()):
        torch.sim.synchronize(i)
    torch.sim.empty_cache()


@pytest.fixture(autouse=True)
def _device_zero_after():
    yield
    torch.accelerator.set_device_index(0)


def _four(module, *device) -> tuple[int, int, int, int]:
    """Allocated, peak allocated, reserved, peak reserved bytes, as ``module`` reports."""
    return (module.memory_allocated(*device), module.max_memory_allocated(*device),
            module.memory_reserved(*device), module.max_memory_reserved(*device))


def _run_child(code: str, **env: str) -> subprocess.CompletedProcess:
    return run_python(code, **env)


@needs_cpp
def test_registered_with_the_library():
    assert accelerator_memory.installed()
    assert torch.accelerator.current_accelerator().type == "sim"


@needs_cpp
@pytest.mark.parametrize("index", [0, 1])
def test_allocated_and_reserved_equal_the_device_modules(index):
    _fresh()
    torch.accelerator.set_device_index(index)
    start = torch.sim.memory_allocated(index)
    small = torch.empty(1000, dtype=torch.uint8, device="sim")
    large = torch.empty(3 << 20, dtype=torch.uint8, device="sim")
    assert small.device.index == large.device.index == index
    assert torch.accelerator.memory_allocated() == torch.sim.memory_allocated(index) \
        == start + round_size(1000) + round_size(3 << 20)
    del small
    expected = _four(torch.sim, index)
    assert expected[0] == start + round_size(3 << 20) and expected[2] > expected[0]
    assert _four(torch.accelerator) == expected
    for spec in (index, f"sim:{index}", torch.device("sim", index)):
        assert _four(torch.accelerator, spec) == expected
    other = 1 - index
    assert _four(torch.accelerator, other) == _four(torch.sim, other)
    del large
    assert torch.accelerator.memory_allocated() == torch.sim.memory_allocated(index) == start


@needs_cpp
def test_peaks_and_their_reset():
    _fresh()
    torch.accelerator.reset_peak_memory_stats(1)
    base = torch.sim.memory_allocated(1)
    x = torch.empty(5 << 20, dtype=torch.uint8, device="sim:1")
    peak = torch.sim.max_memory_allocated(1)
    assert peak == base + round_size(5 << 20)
    del x
    assert torch.accelerator.max_memory_allocated(1) == torch.sim.max_memory_allocated(1) == peak
    assert torch.accelerator.max_memory_reserved(1) == torch.sim.max_memory_reserved(1) \
        >= peak
    torch.accelerator.reset_peak_memory_stats(1)  # one state: torch.sim sees the reset
    assert torch.sim.max_memory_allocated(1) == torch.sim.memory_allocated(1) == base
    assert torch.accelerator.max_memory_allocated(1) == base
    assert torch.accelerator.max_memory_reserved(1) == torch.sim.memory_reserved(1)


@needs_cpp
def test_reset_accumulated_statistics():
    _fresh()
    x = torch.empty(100, device="sim:1")
    del x
    assert torch.sim.memory_stats(1)["allocation.all.allocated"] > 0
    torch.accelerator.reset_accumulated_memory_stats(1)
    for st in (torch.sim.memory_stats(1), torch.accelerator.memory_stats(1)):
        assert st["allocation.all.allocated"] == st["allocation.all.freed"] == 0
        assert st["num_device_alloc"] == st["num_alloc_retries"] == 0


@needs_cpp
def test_memory_stats_have_the_device_modules_keys_and_values():
    _fresh()
    keep = [torch.empty(700, device="sim:1"), torch.empty(700, device="sim:1"),
            torch.empty(3 << 20, dtype=torch.uint8, device="sim:1")]
    del keep[0]  # a free block of a segment still in use: an inactive split block
    ours = torch.sim.memory_stats(1)
    theirs = torch.accelerator.memory_stats(1)
    assert set(ours) <= set(theirs)
    assert {k: theirs[k] for k in ours} == ours
    assert ours["allocation.small_pool.freed"] >= 1 and ours["segment.large_pool.current"] >= 1
    assert ours["inactive_split.small_pool.current"] >= 1
    # what PyTorch's flattening adds: the oversize counts' other metrics, none here
    extra = set(theirs) - set(ours)
    assert extra == {f"oversize_{k}.{m}" for k in ("allocations", "segments")
                     for m in ("peak", "allocated", "freed")}
    assert all(theirs[k] == 0 for k in extra)
    assert theirs["max_split_size"] == ours["max_split_size"] == -1


@needs_cpp
def test_empty_cache_releases_cached_blocks():
    _fresh()
    base = torch.sim.memory_reserved(1)
    x = torch.empty(30 << 20, dtype=torch.uint8, device="sim:1")
    del x
    assert torch.sim.memory_reserved(1) >= base + (30 << 20)
    torch.accelerator.empty_cache()
    assert torch.sim.memory_reserved(1) == torch.accelerator.memory_reserved(1) == base


@needs_cpp
def test_get_memory_info_equals_mem_get_info():
    _fresh()
    for i in (0, 1):
        assert torch.accelerator.get_memory_info(i) == torch.sim.mem_get_info(i)
    free_before = torch.sim.mem_get_info(1)[0]
    x = torch.empty(8 << 20, dtype=torch.uint8, device="sim:1")  # noqa: F841
    torch.accelerator.set_device_index(1)
    info = torch.accelerator.get_memory_info()
    assert info == torch.sim.mem_get_info(1) and info[0] < free_before
    assert info[1] == torch.sim.get_device_properties(1).total_memory


@needs_cpp
def test_out_of_memory_is_counted():
    _fresh()
    before = torch.accelerator.memory_stats(1)["num_ooms"]
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(10**13, dtype=torch.uint8, device="sim:1")
    assert torch.accelerator.memory_stats(1)["num_ooms"] == \
        torch.sim.memory_stats(1)["num_ooms"] == before + 1
    # the allocator's own OOM, from a storage C++ makes: PyTorch's OutOfMemoryError
    with pytest.raises(torch.OutOfMemoryError, match="SIM out of memory. Tried to allocate"):
        _new_storage(torch.UntypedStorage, 10**13, device="sim:1")
    assert torch.accelerator.memory_stats(1)["num_ooms"] == before + 2


@needs_cpp
def test_a_storage_made_in_cpp_is_a_block_counted_as_a_tensor():
    _fresh()
    start = torch.sim.memory_stats(1)
    t = torch.empty(1000, dtype=torch.uint8, device="sim:1")
    as_tensor = torch.sim.memory_stats(1)
    del t
    torch.accelerator.set_device_index(0)
    on_zero = torch.sim.memory_allocated(0)
    s = _new_storage(torch.UntypedStorage, 1000, device="sim:1")
    assert s.device == torch.device("sim", 1) and s.nbytes() == 1000
    as_storage = torch.sim.memory_stats(1)
    for key in ("allocated_bytes.all.current", "requested_bytes.all.current",
                "allocation.all.current", "active_bytes.small_pool.current"):
        assert as_storage[key] == as_tensor[key] != start[key]
    assert torch.accelerator.memory_allocated(1) == as_storage["allocated_bytes.all.current"]
    assert torch.sim.memory_allocated(0) == torch.accelerator.memory_allocated(0) == on_zero
    del s
    assert torch.sim.memory_allocated(1) == start["allocated_bytes.all.current"]
    torch.accelerator.set_device_index(1)  # no index: the current device
    s = _new_storage(torch.UntypedStorage, 16, device="sim")
    assert s.device == torch.device("sim", 1)
    del s
    assert torch.sim.memory_allocated(1) == start["allocated_bytes.all.current"]


@needs_cpp
def test_a_storage_made_in_cpp_holds_device_data_and_resizes():
    _fresh()
    start = torch.sim.memory_allocated(1)
    s = _new_storage(torch.UntypedStorage, [1, 2, 3], device="sim:1")  # written by device ops
    assert s.cpu().tolist() == [1, 2, 3]
    t = torch.empty(0, dtype=torch.uint8, device="sim:1").set_(s)
    assert (t + 1).cpu().tolist() == [2, 3, 4]
    s.resize_(5000)  # torchport's in-place resize: the C++ block leaves, a new one comes
    assert s.nbytes() == 5000 and s[:3].cpu().tolist() == [1, 2, 3]
    assert torch.sim.memory_allocated(1) == start + round_size(5000)
    del s, t
    gc.collect()
    assert torch.sim.memory_allocated(1) == start


@needs_cpp
def test_a_storage_freed_while_an_exception_is_in_flight_keeps_it():
    """The interpreter drops a failed call's arguments with the exception set; the block's
    return runs Python then, which must not replace the exception (by a SystemError)."""
    _fresh()
    start = torch.sim.memory_allocated(1)
    with pytest.raises(TypeError, match="cannot be interpreted as an integer"):
        operator.index(_new_storage(torch.UntypedStorage, 1000, device="sim:1"))
    assert torch.sim.memory_allocated(1) == start


@needs_cpp
def test_errors_reach_python_as_pytorch_errors():
    with pytest.raises(torch.AcceleratorError, match="invalid device ordinal 5"):
        torch.accelerator.memory_stats(5)
    with pytest.raises(torch.AcceleratorError, match="invalid device ordinal 7"):
        torch.accelerator.get_memory_info(7)


def _cpp_entry(name: str, *argtypes) -> ctypes._CFuncPtr:
    fn = getattr(native.loaded(), name)
    fn.argtypes = list(argtypes)
    fn.restype = ctypes.c_int
    native.loaded().torchport_allocator_last_error.restype = ctypes.c_char_p
    return fn


@needs_cpp
def test_record_stream_through_the_allocator():
    record = _cpp_entry("torchport_allocator_record_stream", ctypes.c_uint64, ctypes.c_int,
                        ctypes.c_int, ctypes.c_int64)
    x = torch.arange(10.0, device="sim:1")
    s = torch.sim.Stream(1)
    block = active_backend().allocators[1].active[x.data_ptr()]
    assert record(x.data_ptr(), 1, 1, s.stream_id) == 1
    assert block.stream_uses == {s}  # as x.record_stream(s) marks it
    other = torch.empty(16)  # memory the allocator did not hand out: left alone
    assert record(other.data_ptr(), 1, 1, s.stream_id) == 1
    assert all(not b.stream_uses for a in active_backend().allocators
               for b in a.active.values() if b is not block)
    assert record(x.data_ptr(), 1, 1, 10**6) == 0
    assert b"expected a torch.sim.Stream" in native.loaded().torchport_allocator_last_error()


@needs_cpp
def test_copy_data_copies_through_the_runtime():
    copy = _cpp_entry("torchport_allocator_copy_data", ctypes.c_uint64, ctypes.c_uint64,
                      ctypes.c_uint64)
    src = torch.arange(10.0, device="sim:1")
    dst = torch.zeros(10, device="sim:0")
    assert copy(dst.data_ptr(), src.data_ptr(), 40) == 1
    assert torch.equal(dst.cpu(), torch.arange(10.0))
    assert copy(dst.data_ptr(), 4096, 40) == 0
    assert b"are not sim memory" in native.loaded().torchport_allocator_last_error()


@needs_cpp
def test_statistics_before_first_use_and_after_all_memory_returned():
    r = _run_child(
        "import torch, torchport.sim\n"
        "assert dict(torch.accelerator.memory_stats()) == {}, 'not initialized: no statistics'\n"
        "assert torch.accelerator.memory_allocated() == torch.sim.memory_allocated() == 0\n"
        "x = torch.empty(1 << 20, dtype=torch.uint8, device='sim:1')\n"
        "del x\n"
        "torch.accelerator.empty_cache()\n"
        "assert torch.sim.memory_reserved(1) == 0\n"
        "peak = torch.sim.max_memory_allocated(1)\n"
        "assert peak == torch.accelerator.max_memory_allocated(1) == 1 << 20, peak\n"
        "print('ok')\n")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


@mode_independent
def test_without_the_library_pytorchs_error_remains():
    r = _run_child(
        "import torch, torchport.sim\n"
        "from torchport.device import accelerator_memory\n"
        "assert not accelerator_memory.installed()\n"
        "x = torch.empty(1000, dtype=torch.uint8, device='sim:1')\n"
        "assert torch.sim.memory_allocated(1) == 1024\n"
        "for name in ('memory_allocated', 'memory_stats', 'empty_cache', 'get_memory_info'):\n"
        "    try:\n"
        "        getattr(torch.accelerator, name)()\n"
        "    except RuntimeError as e:\n"
        "        assert 'is not a DeviceAllocator' in str(e), e\n"
        "    else:\n"
        "        raise AssertionError(name)\n"
        "print('ok')\n", TORCHPORT_NATIVE="0")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
