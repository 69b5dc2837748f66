"""A training step of torch.nn's pooling and padding layers runs on the sim's kernels (or
their decompositions), as on CUDA's: forward and backward, no op through the CPU fallback,
the CPU's numbers bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchport.ops as tops
import torchport.sim  # noqa: F401  (registers the device)

pytestmark = pytest.mark.modes


def _samples(n: int, dims: int) -> torch.Tensor:
    return torch.rand(n, 3, dims, generator=torch.Generator().manual_seed(3))


LAYERS = [
    (lambda: nn.AdaptiveAvgPool3d(2), (2, 3, 4, 5, 4)),
    (lambda: nn.AvgPool3d(2), (2, 3, 4, 4, 5)),
    (lambda: nn.MaxPool3d(2), (2, 3, 5, 4, 4)),
    (lambda: nn.AdaptiveMaxPool3d(2), (2, 3, 4, 4, 5)),
    (lambda: nn.AdaptiveMaxPool2d(2), (2, 3, 5, 4)),
    (lambda: nn.ReflectionPad1d(2), (2, 3, 5)),
    (lambda: nn.ReflectionPad2d(1), (2, 3, 4, 5)),
    (lambda: nn.ReflectionPad3d(1), (2, 3, 4, 4, 3)),
    (lambda: nn.ReplicationPad1d(2), (2, 3, 5)),
    (lambda: nn.ReplicationPad2d(1), (2, 3, 4, 5)),
    (lambda: nn.ReplicationPad3d(1), (2, 3, 3, 4, 4)),
    (lambda: nn.FractionalMaxPool2d(2, output_size=2, _random_samples=_samples(2, 2)),
     (2, 3, 5, 6)),
    (lambda: nn.FractionalMaxPool3d(2, output_size=2, _random_samples=_samples(2, 3)),
     (2, 3, 5, 5, 6)),
    (lambda: nn.Upsample(scale_factor=2, mode="nearest"), (2, 3, 3, 4, 3)),
]


@pytest.mark.parametrize("make,shape", LAYERS,
                         ids=[type(m()).__name__ + f"-{len(s)}d" for m, s in LAYERS])
def test_layer_training_step_native_and_exact(make, shape) -> None:
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    grads = {}
    for device in ("cpu", "sim"):
        layer = make().to(device)
        xd = x.to(device).detach().requires_grad_()
        with tops.record() as rec:
            y = layer(xd)
            (y * torch.arange(y.numel(), dtype=y.dtype, device=device).reshape(y.shape)
             ).sum().backward()
        grads[device] = (y.detach().cpu(), xd.grad.cpu())
        if device == "sim":
            fell_back = sorted(n for n, s in rec.ops.items() if "fallback" in s.paths)
            assert not fell_back, f"through the CPU fallback: {fell_back}"
    for cpu, sim in zip(grads["cpu"], grads["sim"], strict=True):
        assert torch.equal(cpu, sim)


def test_embedding_bag_and_rrelu_backward_native() -> None:
    bag = nn.EmbeddingBag(10, 3).to("sim")
    rrelu = nn.RReLU().to("sim")
    with tops.record() as rec:
        bag(torch.randint(0, 10, (4, 3), device="sim")).sum().backward()
        x = torch.randn(4, 5, device="sim", requires_grad=True)
        rrelu(x).sum().backward()
    assert not sorted(n for n, s in rec.ops.items() if "fallback" in s.paths)
