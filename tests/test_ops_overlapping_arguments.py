"""Arguments that share memory: an ``out=`` over the call's own inputs raises the CPU's
overlap error on every path (a CPU kernel, the CPU fallback, a decomposition), and views of
one buffer passed together compute as on the CPU. On device-only memory the fallback used to
copy each argument alone, so the CPU kernel never saw the overlap: ``cat``/``take`` with an
``out=`` over an input computed a result where the CPU and CUDA raise (PyTorch's
``test_errors_cat``/``test_errors_take`` on the OpenCL and reference backends), and the
decompositions of ``out=`` overloads checked nothing. CPU PyTorch is the oracle."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

pytestmark = pytest.mark.modes

OVERLAP = "some elements of the input tensor and the written-to tensor refer to a single"


def _on(device: str) -> dict[str, Callable[[], object]]:
    """Calls whose out= partially overlaps an input, on ``device``; each builds its tensors
    from the same seed."""
    torch.manual_seed(0)
    y, z = torch.randn(4, 6).to(device), torch.randn(4, 6).to(device)
    ind = torch.tensor([2, 1, 0]).to(device)
    src = torch.arange(3).to(device)
    x = torch.randn(9).to(device)
    buf = torch.rand(3, 8).to(device) + 0.5
    return {
        "cat": lambda: torch.cat((y, z), out=z[:2, :]),
        "take": lambda: torch.take(src, ind[1:], out=ind[:-1]),
        "add": lambda: torch.add(x[:-1], 1.0, out=x[1:]),
        "hypot": lambda: torch.hypot(buf[0, :-1], buf[1, :-1], out=buf[0, 1:]),
        "hypot_": lambda: buf[0, 1:].hypot_(buf[0, :-1]),
        "index_select": lambda: torch.index_select(src, 0, ind[1:], out=ind[:-1]),
        "cumsum": lambda: torch.cumsum(x[:-1], 0, out=x[1:]),
    }


@pytest.mark.parametrize("name", list(_on("cpu")))
def test_an_out_over_an_input_raises_the_cpus_error_and_writes_nothing(name):
    with pytest.raises(RuntimeError) as cpu_error:
        _on("cpu")[name]()
    assert OVERLAP in str(cpu_error.value)
    for attempt in range(2):  # the first call plans the path, the second takes it
        calls = _on("sim")
        closure = calls[name].__closure__ or ()
        tensors = [c.cell_contents for c in closure if isinstance(c.cell_contents, torch.Tensor)]
        before = [t.cpu().clone() for t in tensors]
        with pytest.raises(RuntimeError) as sim_error:
            calls[name]()
        assert str(sim_error.value) == str(cpu_error.value), (name, attempt)
        for t, b in zip(tensors, before, strict=True):
            assert torch.equal(t.cpu(), b), (name, attempt)


def _views_of_one_buffer(device: str) -> list[torch.Tensor]:
    torch.manual_seed(1)
    base = torch.rand(4, 8).to(device) + 0.5
    rows = base.view(4, 8)
    return [
        torch.hypot(rows[0], rows[1], out=rows[2]),  # rows of one buffer: no overlap
        torch.hypot(base[3], base[3].view(2, 4).view(8), out=base[3]),  # the same elements
        rows[1].hypot_(base.view(32)[8:16]),  # in place, the other operand another view
        torch.nextafter(base[:, :4], base[:, 4:], out=base[:, :4].clone()),
        torch.special.i1e(base.t()[1:3]),
        base,
    ]


def test_views_of_one_buffer_compute_as_on_the_cpu():
    want = _views_of_one_buffer("cpu")
    for _ in range(2):
        got = _views_of_one_buffer("sim")
        for w, g in zip(want, got, strict=True):
            assert g.device.type == "sim"
            assert torch.equal(g.cpu(), w)
