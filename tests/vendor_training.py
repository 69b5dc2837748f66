"""Training on a vendor backend against the CPU, the oracle: the same initial weights and
batches on both sides, then every step's loss, the final parameters and the buffers
(BatchNorm's running statistics, its step counter) compared. Imported inside a worker
process that registered the backend (one backend per process), as the vendor modules'
tests do: ``compare(cnn(), "sgd", "walk", cnn_batches(), rtol=..., atol=...)``.

The models are the two shapes a vendor's users train first: a CNN with BatchNorm and a
pre-norm transformer block (causal self-attention, LayerNorm, GELU, next-token
cross-entropy)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable

import torch
from torch import nn

Batch = tuple[torch.Tensor, torch.Tensor]

OPTIMIZERS: dict[str, Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
}


def cnn(dtype: torch.dtype = torch.float32, head_bias: bool = True) -> nn.Module:
    """Two convolutions, each before a BatchNorm, and a linear head (seeded). The
    convolutions have no bias, as such CNNs are written: a bias before a BatchNorm has a
    gradient that is zero but for rounding noise, which Adam scales up to a full step, so
    it would differ between two correct devices by its sign alone."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6), nn.ReLU(),
        nn.MaxPool2d(2), nn.Conv2d(6, 8, 3, bias=False), nn.BatchNorm2d(8, momentum=0.3),
        nn.ReLU(), nn.Flatten(), nn.Linear(8 * 2 * 2, 5, bias=head_bias)).to(dtype)


def cnn_batches(dtype: torch.dtype = torch.float32, steps: int = 3) -> list[Batch]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 3, 8, 8, generator=g, dtype=dtype),
             torch.randint(0, 5, (6,), generator=g)) for _ in range(steps)]


class Block(nn.Module):
    """A one-block GPT: token and position embeddings, a pre-norm encoder layer run with a
    causal mask (self-attention, LayerNorm, GELU), a final LayerNorm and a head predicting
    the next token. No biases in the block: the key projection's bias has a gradient that
    is zero but for rounding noise (softmax ignores a shift shared by a query's scores),
    which Adam scales up to a full step."""

    def __init__(self, vocab: int = 20, width: int = 16, context: int = 8,
                 head_bias: bool = True) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.block = nn.TransformerEncoderLayer(width, 2, 2 * width, dropout=0.0,
                                                activation="gelu", batch_first=True,
                                                norm_first=True, bias=False)
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=head_bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        n = idx.shape[1]
        x = self.tokens(idx) + self.positions(torch.arange(n, device=idx.device))
        mask = nn.Transformer.generate_square_subsequent_mask(n, device=idx.device)
        return self.head(self.norm(self.block(x, src_mask=mask, is_causal=True)))


def block(dtype: torch.dtype = torch.float32, head_bias: bool = True) -> nn.Module:
    torch.manual_seed(0)
    return Block(head_bias=head_bias).to(dtype)


def block_batches(dtype: torch.dtype = torch.float32, steps: int = 3) -> list[Batch]:
    """Token sequences and the same shifted by one: next-token targets (``dtype`` is the
    model's: tokens are integers)."""
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 20, (4, 9), generator=g) for _ in range(steps)]
    return [(s[:, :-1], s[:, 1:]) for s in seqs]


def train(model: nn.Module, optimizer: str, device: str,
          batches: list[Batch]) -> tuple[nn.Module, list[torch.Tensor]]:
    """A copy of ``model`` trained on ``device``; it and each step's loss (as computed)."""
    model = copy.deepcopy(model).to(device)
    opt = OPTIMIZERS[optimizer](model.parameters())
    losses = []
    for x, t in batches:
        out = model(x.to(device))
        loss = nn.functional.cross_entropy(out.flatten(0, -2), t.to(device).flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return model, losses


def compare(model: nn.Module, optimizer: str, device: str, batches: list[Batch], *,
            rtol: float, atol: float) -> dict[str, float]:
    """Train ``model`` on the CPU and on ``device``; assert every step's loss and every
    entry of the final state dict (parameters, running statistics; integer counters
    exactly) close within ``rtol``/``atol``. Returns the largest absolute differences seen
    (``loss``, ``state``), so a test can show its margin."""
    cpu, want = train(model, optimizer, "cpu", batches)
    dev, got = train(model, optimizer, device, batches)
    got_losses, want_losses = torch.stack(got).cpu(), torch.stack(want)
    torch.testing.assert_close(got_losses, want_losses, rtol=rtol, atol=atol,
                               msg=lambda m: f"{optimizer} losses per step:\n{m}")
    worst = {"loss": (got_losses - want_losses).abs().max().item(), "state": 0.0}
    have = dev.state_dict()
    assert list(have) == list(cpu.state_dict()), (list(have), list(cpu.state_dict()))
    for name, b in cpu.state_dict().items():
        a = have[name]
        assert a.device.type == device.split(":")[0], (name, a.device)
        a = a.cpu()
        exact = not b.is_floating_point()
        torch.testing.assert_close(a, b, rtol=0 if exact else rtol, atol=0 if exact else atol,
                                   msg=lambda m, name=name: f"{optimizer}, {name}:\n{m}")
        if not exact:
            worst["state"] = max(worst["state"], (a - b).abs().max().item())
    return worst


MODELS: dict[str, tuple[Callable[..., nn.Module], Callable[..., list[Batch]]]] = {
    "cnn": (cnn, cnn_batches), "block": (block, block_batches)}

# Units of rounding (the dtype's eps) a trained value may differ by. A backend's kernels
# round differently from the CPU's where they sum in another order (the reference
# backend's numpy matmul and sum) or where torchport computes an op the backend has no
# kernel for by a composite of others (the walkthrough: addmm as mm then add, addcmul in
# AdamW and LayerNorm as mul then add, LayerNorm through batch norm): an ulp or two per
# such result, compounded over three steps. Measured: 1 ulp of the losses, up to 2 of the
# parameters (about 1.2e-7 in float32, 4.4e-16 in float64). 64 ulps relative (7.6e-6 in
# float32) leave room for other BLAS builds; a lost write, a stale read or a kernel wrong
# by 1e-4 relative (840 ulps in float32) fails. The same count in float64 shows that a
# float32 difference is rounding: it shrinks with the dtype's eps, a bug's does not.
ULPS = 64


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """``rtol``/``atol`` of ULPS units of ``dtype``'s rounding (atol: for values near 0)."""
    eps = torch.finfo(dtype).eps
    return {"rtol": ULPS * eps, "atol": ULPS * eps / 8}


def check(device: str, model: str, optimizer: str, dtype: str = "float32",
          exact: bool = False, head_bias: bool = True) -> dict[str, float]:
    """:func:`compare` of one of MODELS trained with one of OPTIMIZERS in ``dtype``, within
    :func:`tolerance` or, ``exact``, bit for bit; the largest differences seen."""
    make, batches = MODELS[model]
    dt = getattr(torch, dtype)
    tol = {"rtol": 0.0, "atol": 0.0} if exact else tolerance(dt)
    return compare(make(dt, head_bias=head_bias), optimizer, device, batches(dt), **tol)
