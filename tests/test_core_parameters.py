"""Parameters moved to the device keep their identity, as on CUDA (``Module._apply`` and
``.data =``): tied weights stay tied, an optimizer built before ``.to()`` trains them."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.modes


class TiedLM(nn.Module):
    """An embedding and an output layer sharing one weight (GPT-2, BERT, T5...)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(ids)))


def _train(model: nn.Module, opt: torch.optim.Optimizer, device: str) -> list[float]:
    ids = torch.arange(8).remainder(11).view(2, 4).to(device)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_tied_weights_stay_tied_and_train_as_on_the_cpu() -> None:
    torch.manual_seed(0)
    cpu = TiedLM()
    dev = copy.deepcopy(cpu)
    params_before = list(dev.parameters())
    dev.to("sim")
    assert dev.head.weight is dev.embed.weight
    assert list(dev.parameters()) == params_before  # the same Parameter objects
    assert sum(p.numel() for p in dev.parameters()) == sum(p.numel() for p in cpu.parameters())
    cpu_losses = _train(cpu, torch.optim.AdamW(cpu.parameters(), lr=0.1), "cpu")
    dev_losses = _train(dev, torch.optim.AdamW(dev.parameters(), lr=0.1), "sim")
    assert dev_losses == cpu_losses
    for (n, c), d in zip(cpu.named_parameters(), dev.parameters(), strict=True):
        assert torch.equal(c, d.cpu()), n


def test_an_optimizer_built_before_to_trains_the_moved_parameters() -> None:
    torch.manual_seed(0)
    cpu = TiedLM()
    dev = copy.deepcopy(cpu)
    opt = torch.optim.SGD(dev.parameters(), lr=0.5)  # holds the CPU-era Parameters
    dev.to("sim:1")
    assert all(p.device == torch.device("sim", 1) for g in opt.param_groups for p in g["params"])
    cpu_losses = _train(cpu, torch.optim.SGD(cpu.parameters(), lr=0.5), "cpu")
    assert _train(dev, opt, "sim:1") == cpu_losses
    assert torch.equal(dev.embed.weight.cpu(), cpu.embed.weight)


def test_gradients_move_with_their_parameters() -> None:
    lin = nn.Linear(3, 2)
    lin(torch.ones(1, 3)).sum().backward()
    grad, weight = lin.weight.grad, lin.weight
    lin.to("sim")
    assert lin.weight is weight and lin.weight.grad is grad
    assert grad.device.type == "sim" and torch.equal(grad.cpu(), torch.ones(2, 3))
    lin.to("cpu").double()
    assert lin.weight is weight and weight.dtype == torch.float64 and weight.device.type == "cpu"


def test_data_assignment_between_cpu_and_device() -> None:
    t = torch.zeros(2, requires_grad=True)
    t.data = torch.arange(3.0, device="sim")
    assert t.device == torch.device("sim", 0) and t.requires_grad and t.shape == (3,)
    assert torch.equal(t.detach().cpu(), torch.arange(3.0))
    t.data = torch.ones(4)
    assert t.device.type == "cpu" and torch.equal(t.detach(), torch.ones(4))
    assert torch._has_compatible_shallow_copy_type(torch.ones(1), torch.ones(1, device="sim"))
    assert torch._has_compatible_shallow_copy_type(torch.ones(1, device="sim"),
                                                   torch.ones(1, device="sim:1"))


def test_incompatible_kinds_stay_incompatible() -> None:
    sim = torch.ones(2, device="sim")
    for other in (torch.ones(2, device="meta"), torch.ones(2).to_sparse()):
        assert not torch._has_compatible_shallow_copy_type(sim, other)
        assert not torch._has_compatible_shallow_copy_type(other, sim)
    with pytest.raises(RuntimeError, match="incompatible tensor type"):
        sim.data = torch.ones(2, device="meta")
