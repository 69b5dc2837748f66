"""Data helpers shared by the training scripts: plain CPU code, nothing to migrate."""

import random

import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def make_blobs(n: int, d_in: int = 8, classes: int = 3, seed: int = 0):
    """``n`` points around ``classes`` random centres, and their labels."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, d_in, generator=g) * 2
    y = torch.arange(n) % classes
    x = centres[y] + torch.randn(n, d_in, generator=g)
    return x, y


def accuracy(logits: torch.Tensor, target: torch.Tensor) -> float:
    return (logits.argmax(dim=1) == target).float().mean().item()
