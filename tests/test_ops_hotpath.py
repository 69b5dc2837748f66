"""The hot path of host-computed kernels: cached views, cached output layouts, the
out= trial, and the allocator's deferred statistics -- each checked against the CPU."""

from __future__ import annotations

import warnings

import pytest
import torch

import torchport.sim  # noqa: F401
from torchport.backend import active_backend
from torchport.ops import hostviews


def test_scalar_type_is_part_of_the_layout_key() -> None:
    i = torch.arange(6, device="sim")
    # the same layouts, values equal as Python numbers, other result dtypes
    assert (i * 2).dtype == torch.int64
    assert (i * 2.0).dtype == torch.float32
    assert (i * True).dtype == torch.int64
    assert torch.equal((i * 2.5).cpu(), torch.arange(6) * 2.5)


def test_wrapped_numbers_in_tensor_slots() -> None:
    x = torch.zeros(3, device="sim", dtype=torch.int32)
    x.add_(1)  # the dispatcher hands the kernel a Python 1 for the Tensor `other`
    y = x + 1
    assert y.dtype == torch.int32 and torch.equal(y.cpu(), torch.full((3,), 2, dtype=torch.int32))


def test_out_overload_that_stages_in_out_is_not_used_and_stays_silent() -> None:
    # CPU mse_loss.out computes the elementwise loss in `out` before reducing it
    a, b = torch.randn(64, 32), torch.randn(64, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            got = torch.nn.functional.mse_loss(a.to("sim"), b.to("sim"))
            assert torch.equal(got.cpu(), torch.nn.functional.mse_loss(a, b))


def test_neighbours_untouched_by_a_staging_kernel() -> None:
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    guard = torch.full((128,), 7.0, device="sim")  # likely the block after the result
    torch.nn.functional.mse_loss(a.to("sim"), b.to("sim"), reduction="sum")
    assert torch.equal(guard.cpu(), torch.full((128,), 7.0))


def test_views_dropped_when_segments_go_back() -> None:
    b = active_backend()
    x = torch.randn(300, 300, device="sim")
    y = (x * 2).cpu()
    entries = [hv.entries for hv in hostviews._ALL]
    assert any(entries)
    del x
    b.device_module.empty_cache()
    assert not any(hv.entries for hv in hostviews._ALL)
    x2 = torch.randn(300, 300, device="sim")
    assert torch.equal((x2 * 2).cpu(), x2.cpu() * 2)
    assert y.shape == (300, 300)


@pytest.mark.parametrize("sizes", [[256, 256, 1024, 256], [512, 4096, 512, 4096, 512]])
def test_deferred_statistics_are_exact(sizes: list[int]) -> None:
    dm = active_backend().device_module
    dm.synchronize()
    live = []
    for n in sizes:  # warm the parked lists so the hot path serves the loop below
        live.append(torch.empty(n, dtype=torch.uint8, device="sim"))
    live.clear()
    dm.reset_peak_memory_stats()
    base = dm.memory_allocated()
    peak = base
    expect = base
    for _ in range(3):
        for n in sizes:
            live.append(torch.empty(n, dtype=torch.uint8, device="sim"))
            expect += max(512, n)
            peak = max(peak, expect)
        while live:
            t = live.pop()
            expect -= max(512, t.numel())
            del t
            assert dm.memory_allocated() == expect
    assert dm.max_memory_allocated() == peak
    stats = dm.memory_stats()
    assert stats["allocation.all.current"] == stats["active.all.current"]
    assert stats["allocated_bytes.all.peak"] == peak
