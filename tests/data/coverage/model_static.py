"""A model script for ``torchport coverage --static``: forward + backward, then .item()."""

import torch

import torchport.sim  # noqa: F401

model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                            torch.nn.Linear(4 * 6 * 6, 3)).to("sim")
x = torch.randn(2, 1, 8, 8, device="sim")
out = model(x).log_softmax(-1)
out.sum().backward()
print("loss", out.mean().item())  # needs device data: a static trace stops here
print("after item")
