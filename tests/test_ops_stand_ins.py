"""The CPU kernels the op layer runs on stand-ins for its own purposes (an asynchronous
launch's output layouts, an in-place op's queueing, a dtype refusal, an aliasing check)
are handed only indices valid in every dimension: some CPU kernels trust their indices
unchecked and would write outside their outputs, into the process's heap (an
asynchronous backward of ``nll_loss2d`` made glibc abort later, in another allocation)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torchport.ops import derive, paths
from torchport.ops.hostkernels import trials

aten = torch.ops.aten
N, H, W = 4, 3, 1


class _IndicesSeen(TorchDispatchMode):
    """The host integer tensors the CPU kernels of ``ops`` receive."""

    def __init__(self, ops: tuple) -> None:
        super().__init__()
        self.ops = ops
        self.seen: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func in self.ops:
            self.seen += [a.clone() for a in [*args, *kwargs.values()]
                          if isinstance(a, torch.Tensor) and a.dtype == torch.int64
                          and a.device.type == "cpu"]
        return func(*args, **kwargs)


def _backward_call(classes: int) -> tuple:
    """``nll_loss2d_backward``'s arguments as ``reduction="none"`` and ``.sum().backward()``
    give them: the CPU kernel writes ``grad_input[n, target[n, h, w], h, w]``."""
    grad = torch.ones(()).expand(N, H, W)
    scores = torch.randn(N, classes, H, W)
    target = torch.zeros(N, H, W, dtype=torch.int64)
    return grad, scores, target, None, 0, -100, torch.tensor(0.0)


def _launch_specs(args: tuple) -> None:
    specs = trials.launch_specs(aten.nll_loss2d_backward.default,
                                aten.nll_loss2d_backward.grad_input, ["grad_input"], args, {})
    n, c, h, w = args[1].shape
    assert specs == [((n, c, h, w), (c * h * w, h * w, w, 1), torch.float32)]


def _stand_ins_of_ones(args: tuple) -> None:
    trials.specs_on_stand_ins(aten.nll_loss2d_backward.default,
                              aten.nll_loss2d_backward.grad_input, ["grad_input"], args, {}, 1)


def _refusal_probe_of_ones(args: tuple) -> None:
    assert paths._probe(aten.nll_loss2d_backward.default, args, {}, None, fill=1) is None


def _aliasing_check(args: tuple) -> None:
    scores = args[1]  # written over its own input: the CPU decides on mirrored memory
    derive._OVERLAP.clear()
    derive.check_overlap(aten.nll_loss2d_backward.grad_input, args,
                         {"grad_input": scores}, [scores], args)


@pytest.mark.parametrize("classes", [1, 2])
@pytest.mark.parametrize("run", [_launch_specs, _stand_ins_of_ones, _refusal_probe_of_ones,
                                 _aliasing_check])
def test_cpu_kernels_on_stand_ins_get_valid_indices(run, classes: int,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # the aliasing check hides its CPU run from dispatch modes: let the spy see it
    monkeypatch.setattr(derive, "_disable_current_modes", contextlib.nullcontext)
    spy = _IndicesSeen((aten.nll_loss2d_backward.default, aten.nll_loss2d_backward.grad_input))
    with spy:
        run(_backward_call(classes))
    assert spy.seen, "the CPU kernel did not run"
    assert all(0 <= int(t.min()) and int(t.max()) < classes for t in spy.seen), \
        [t.unique().tolist() for t in spy.seen]
