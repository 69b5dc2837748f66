"""A runtime's blocking copies in C (``Runtime.native_copies``) over a table of device memory
kept in host memory (``torchport.backends.host_memory``, ``csrc/native_host_memory.cpp``):
they move what the runtime's Python copies move, inside its blocks only, and hand every
other copy (outside the blocks, a busy device, a declined table) to the Python method."""

from __future__ import annotations

import ctypes

import pytest
import torch

import torchport.sim  # noqa: F401  (loads the C++ library where it builds)
from torchport.backends.host_memory import HostMemoryTable
from torchport.backends.sim.runtime import SimRuntime
from torchport.core import native

pytestmark = pytest.mark.modes

needs_library = pytest.mark.skipif(native.loaded() is None,
                                   reason="the C++ library is not loaded (TORCHPORT_NATIVE=0)")

_COPY = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_int32, ctypes.c_uint64,
                         ctypes.c_uint64, ctypes.c_uint64)


def _copies(c):
    return _COPY(c.copy_d2h), _COPY(c.copy_h2d)


@needs_library
def test_the_table_copies_inside_its_blocks_and_hands_the_rest_to_python() -> None:
    memory = torch.arange(256, dtype=torch.uint8)  # one device's block, behind address 4096
    table = HostMemoryTable(2)
    table.add(0, 4096, memory.data_ptr(), 256)
    c = table.native_copies()
    d2h, h2d = _copies(c)
    out = torch.zeros(64, dtype=torch.uint8)
    assert d2h(c.context, 0, out.data_ptr(), 4096 + 16, 64) == 0
    assert torch.equal(out, memory[16:80])
    out.zero_()
    for index, at, n in [(0, 4096 + 200, 64), (0, 4000, 64), (1, 4096, 64), (2, 4096, 1)]:
        assert d2h(c.context, index, out.data_ptr(), at, n) == 1, (index, at, n)
    assert not out.any()  # nothing moved
    assert d2h(c.context, 0, out.data_ptr(), 4096 + 192, 64) == 0  # up to the last byte
    table.busy(0, True)
    assert d2h(c.context, 0, out.data_ptr(), 4096, 64) == 1
    table.busy(0, False)
    table.declined(True)
    assert d2h(c.context, 0, out.data_ptr(), 4096, 64) == 1
    table.declined(False)
    src = torch.full((8,), 9, dtype=torch.uint8)
    assert h2d(c.context, 0, 4096 + 8, src.data_ptr(), 8) == 0
    assert memory[8:16].eq(9).all() and memory[7] == 7 and memory[16] == 16
    table.remove(0, 4096)
    assert d2h(c.context, 0, out.data_ptr(), 4096, 8) == 1


@needs_library
def test_a_table_that_tracks_queues_answers_the_default_stream_query() -> None:
    """``query_default_stream``: 1 while the device is not busy (its default queue settled),
    -1 (the runtime's Python query) while it is busy or for another table's device; a table
    whose runtime does not mark its queues offers no query."""
    assert HostMemoryTable(1).native_copies().query_default_stream == 0
    table = HostMemoryTable(2, tracks_queues=True)
    c = table.native_copies()
    query = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_int32)(
        c.query_default_stream)
    assert [query(c.context, i) for i in (0, 1)] == [1, 1]
    table.busy(1, True)
    assert [query(c.context, i) for i in (0, 1)] == [1, -1]
    table.declined(True)  # (faults concern copies, not what the queue ran)
    assert [query(c.context, i) for i in (0, 1)] == [1, -1]
    table.busy(1, False)
    assert [query(c.context, i) for i in (0, 1, 2, -1)] == [1, 1, -1, -1]


@needs_library
def test_the_strict_sims_c_copies_move_what_its_python_copies_move(monkeypatch) -> None:
    monkeypatch.delenv("TORCHPORT_SIM_ASYNC", raising=False)  # (a synchronous sim's)
    rt = SimRuntime(num_devices=2, memory=1 << 24, strict=True)
    before = rt.malloc(1, 4096)  # a block made before the table: it joins it
    c = rt.native_copies()
    assert c is not None
    d2h, h2d = _copies(c)
    after = rt.malloc(1, 1000)
    data = torch.randn(250)
    for block in (before, after):
        assert h2d(c.context, 1, block, data.data_ptr(), 1000) == 0
        back = torch.empty(250)
        rt.copy_d2h(1, back.data_ptr(), block, 1000)  # the Python copy reads what C wrote
        assert torch.equal(back, data)
        ones = torch.ones(2)
        rt.copy_h2d(1, block + 8, ones.data_ptr(), 8)
        got = torch.empty(250)
        assert d2h(c.context, 1, got.data_ptr(), block, 1000) == 0
        assert torch.equal(got[:2], data[:2]) and torch.equal(got[2:4], torch.ones(2))
        assert torch.equal(got[4:], data[4:])
    assert d2h(c.context, 1, got.data_ptr(), after, 1004) == 1  # past its end
    assert d2h(c.context, 0, got.data_ptr(), after, 8) == 1     # another device's
    rt.free(1, after)
    assert d2h(c.context, 1, got.data_ptr(), after, 8) == 1
    with pytest.raises(RuntimeError, match="illegal memory access"):
        rt.copy_d2h(1, got.data_ptr(), after, 8)  # what the Python copy then says


def test_only_a_synchronous_strict_sim_gives_c_copies(monkeypatch) -> None:
    assert SimRuntime(num_devices=1, strict=False).native_copies() is None  # host-addressable
    monkeypatch.setenv("TORCHPORT_SIM_ASYNC", "1")
    monkeypatch.delenv("TORCHPORT_LAUNCH_BLOCKING", raising=False)
    rt = SimRuntime(num_devices=1, strict=True)
    assert rt.asynchronous and rt.native_copies() is None  # a copy waits for the queue
