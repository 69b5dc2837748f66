"""Out of memory in the middle of a training step: the error is PyTorch's, the model and
the optimizer are as before the step, the memory comes back, and the next (smaller) step
trains exactly as on the CPU. Runs in the three sim modes (make test)."""

from __future__ import annotations

import copy
import gc

import pytest
import torch

import torchport.sim  # noqa: F401

pytestmark = pytest.mark.modes

DEV = "sim:1"


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
          y: torch.Tensor) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


@pytest.fixture
def limited_device():
    gc.collect()
    torch.sim.synchronize(DEV)
    torch.sim.empty_cache()
    torch.sim.set_per_process_memory_fraction(32 / 8192, DEV)  # 32 MiB of the 8 GiB
    yield
    torch.sim.set_per_process_memory_fraction(1.0, DEV)
    gc.collect()
    torch.sim.empty_cache()


def test_oom_mid_step_leaves_the_model_and_trains_on(limited_device) -> None:
    g = torch.Generator().manual_seed(0)
    cpu = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(),
                              torch.nn.Linear(512, 512))
    dev = copy.deepcopy(cpu).to(DEV)
    opt_cpu = torch.optim.SGD(cpu.parameters(), lr=0.01, momentum=0.9)
    opt_dev = torch.optim.SGD(dev.parameters(), lr=0.01, momentum=0.9)
    small = [(torch.randn(32, 512, generator=g), torch.randn(32, 512, generator=g))
             for _ in range(3)]
    huge = torch.randn(4096, 512, generator=g)  # 8 MiB: fits; its step's activations do not
    _step(cpu, opt_cpu, *small[0])
    _step(dev, opt_dev, small[0][0].to(DEV), small[0][1].to(DEV))
    before = [p.detach().cpu().clone() for p in dev.parameters()]
    hx, hy = huge.to(DEV), huge.to(DEV)
    allocated = torch.sim.memory_allocated(DEV)
    with pytest.raises(torch.OutOfMemoryError, match="out of memory"):
        _step(dev, opt_dev, hx, hy)
    del hx, hy
    gc.collect()
    torch.sim.synchronize(DEV)
    assert all(torch.equal(p.detach().cpu(), b) for p, b in zip(dev.parameters(), before, strict=True))
    # the failed step's tensors are freed (its inputs too, deleted above)
    assert torch.sim.memory_allocated(DEV) <= allocated - (16 << 20) + (1 << 20)
    for x, y in small[1:]:
        lc = _step(cpu, opt_cpu, x, y)
        ld = _step(dev, opt_dev, x.to(DEV), y.to(DEV))
        assert torch.equal(ld.cpu(), lc)
    for p, q in zip(dev.parameters(), cpu.parameters(), strict=True):
        assert torch.equal(p.detach().cpu(), q.detach())
