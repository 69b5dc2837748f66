"""Training on sim is bit-identical to CPU (issue 2 acceptance)."""

import copy

import pytest
import torch

pytestmark = pytest.mark.modes


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5))


def _cnn():
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
        torch.nn.MaxPool2d(2), torch.nn.Conv2d(4, 8, 3), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Dropout(0.0),
        torch.nn.Linear(8, 5))


def _train(model, device, opt_name, steps=20):
    torch.manual_seed(1)
    model = model.to(device)
    opt = (torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if opt_name == "sgd"
           else torch.optim.AdamW(model.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(2)
    is_cnn = isinstance(model[0], torch.nn.Conv2d)
    for _ in range(steps):
        x = torch.randn(16, 1, 8, 8, generator=g) if is_cnn else torch.randn(16, 20, generator=g)
        y = torch.randint(0, 5, (16,), generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
    return [p.detach().cpu() for p in model.parameters()], loss.item()


@pytest.mark.parametrize("arch", ["mlp", "cnn"])
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_parameters_bit_identical_to_cpu(arch, opt):
    base = (_mlp if arch == "mlp" else _cnn)()
    cpu_params, cpu_loss = _train(copy.deepcopy(base), "cpu", opt)
    sim_params, sim_loss = _train(copy.deepcopy(base), "sim", opt)
    assert sim_loss == cpu_loss
    for a, b in zip(sim_params, cpu_params, strict=True):
        assert torch.equal(a, b)


def test_training_on_device_1():
    base = _mlp()
    cpu_params, _ = _train(copy.deepcopy(base), "cpu", "sgd", steps=5)
    sim_params, _ = _train(copy.deepcopy(base), "sim:1", "sgd", steps=5)
    for a, b in zip(sim_params, cpu_params, strict=True):
        assert torch.equal(a, b)
