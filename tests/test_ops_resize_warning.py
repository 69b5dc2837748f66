"""An ``out=`` of another shape is resized with PyTorch's own warning, word for word the
CPU's, on every path (host kernels, the CPU fallback, decompositions, meta kernels that are
Python references, device routes), once per call."""

from __future__ import annotations

import warnings

import pytest
import torch

import torchport.ops as tops
from torchport.ops import derive

pytestmark = pytest.mark.modes

RESIZED = "An output with one or more elements was resized"


def resize_warnings(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in said if RESIZED in str(w.message)]


def _index(d: str) -> torch.Tensor:
    return torch.tensor([0, 3, 5], device=d)


CALLS = {  # path on the sim: the call
    "decomposed (take)": lambda d: torch.take(torch.ones(3, 3, device=d), _index(d),
                                              out=torch.empty(2, 2, device=d)),
    "host kernel (add)": lambda d: torch.add(torch.ones(3, device=d), 1,
                                             out=torch.empty(2, 2, device=d)),
    "host kernel (cumsum)": lambda d: torch.cumsum(torch.ones(4, device=d), 0,
                                                   out=torch.empty(2, device=d)),
    "fallback (kthvalue)": lambda d: torch.kthvalue(
        torch.ones(4, 3, device=d), 1, out=(torch.empty(2, device=d),
                                            torch.empty(2, dtype=torch.long, device=d))),
    "two outputs (sort)": lambda d: torch.sort(
        torch.ones(4, device=d), out=(torch.empty(2, device=d),
                                      torch.empty(2, dtype=torch.long, device=d))),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_resize_warning_is_the_cpus(name: str) -> None:
    expected = resize_warnings(lambda: CALLS[name]("cpu"))
    assert expected  # the call resizes an out= with elements
    assert resize_warnings(lambda: CALLS[name]("sim")) == expected
    assert resize_warnings(lambda: CALLS[name]("sim")) == expected  # cached paths too


def test_a_python_meta_kernels_resize_warning_is_told_in_pytorchs_words() -> None:
    """``take.out``'s meta kernel is a Python reference, whose wrapper words the warning
    its own way; host kernels learn their outputs' shapes from meta kernels."""
    def specs(d: str) -> None:
        derive.output_specs(torch.ops.aten.take.out, (torch.ones(3, 3, device=d), _index(d)),
                            {"out": torch.empty(2, 2, device=d)})
    expected = resize_warnings(lambda: torch.take(torch.ones(3, 3), _index("cpu"),
                                                  out=torch.empty(2, 2)))
    assert resize_warnings(lambda: specs("sim")) == expected
    assert resize_warnings(lambda: specs("sim")) == expected  # replayed from the cache


def test_integer_histc_route_warns_as_resize_output() -> None:
    """Integer ``histc`` (CUDA has it, the CPU does not): CUDA's kernel resizes its out= by
    ``resize_output``, as the CPU's floating one does."""
    expected = resize_warnings(lambda: torch.histc(torch.arange(5.0), 3, 0, 4,
                                                   out=torch.empty(2)))
    with tops.record() as r:
        got = resize_warnings(lambda: torch.histc(
            torch.arange(5, device="sim"), 3, 0, 4,
            out=torch.empty(2, dtype=torch.long, device="sim")))
    assert r.path_of("histc.out") == "native"
    assert got == expected
