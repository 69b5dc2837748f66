"""Random programs run twice, on CPU tensors and on their device mirrors.

Each step takes tensors from a small pool and makes views of them, changes them in
place, copies between them, resizes them, assigns through indices or computes new ones;
after every step each device tensor must equal its CPU twin in values, shape, strides and
dtype, and an error must be the CPU's. Views of views, storages shared and grown, and the
device's caches of layouts and host views all meet here, as they do in real code.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

Pair = tuple[torch.Tensor, torch.Tensor]  # (cpu, device)


class _Program:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        torch.manual_seed(seed)
        self.pool: list[Pair] = []
        for _ in range(3):
            c = torch.randn(self.rng.randint(1, 5), self.rng.randint(1, 5))
            self.add(c, c.to("sim"))

    def add(self, c: torch.Tensor, d: torch.Tensor) -> None:
        self.pool.append((c, d))
        if len(self.pool) > 12:
            self.pool.pop(0)

    def pick(self) -> Pair:
        return self.rng.choice(self.pool)

    def both(self, fn: Callable[[torch.Tensor], object], pair: Pair) -> None:
        """``fn`` on each side; the same error, or none."""
        errors = []
        for t in pair:
            try:
                fn(t)
                errors.append(None)
            except RuntimeError as e:
                errors.append(str(e))
        assert errors[0] == errors[1]

    # ---- steps ------------------------------------------------------------------------
    def view(self) -> None:
        c, d = self.pick()
        k = self.rng.randrange(7)
        if k == 0 and c.dim() == 2:
            fn = torch.Tensor.t
        elif k == 1 and c.dim() and c.shape[0] > 1:
            fn = lambda t: t[1:]  # noqa: E731
        elif k == 2 and c.dim() and c.shape[-1] > 1:
            fn = lambda t: t[..., ::2]  # noqa: E731
        elif k == 3:
            fn = lambda t: t.unsqueeze(0)  # noqa: E731
        elif k == 4:
            fn = lambda t: t.reshape(-1)  # noqa: E731
        elif k == 5 and c.is_contiguous():
            fn = lambda t: t.view(-1)  # noqa: E731
        else:
            fn = torch.flatten
        self.add(fn(c), fn(d))

    def in_place(self) -> None:
        v = self.rng.choice([0.5, -2.0, 3.0])
        fn = self.rng.choice([lambda t: t.add_(v), lambda t: t.mul_(v), lambda t: t.fill_(v),
                              torch.Tensor.zero_, lambda t: t.clamp_(-1, 1),
                              lambda t: t.sub_(t.flip(0).clone())])
        self.both(fn, self.pick())

    def copy(self) -> None:
        (c1, d1), (c2, d2) = self.pick(), self.pick()
        if c1.shape == c2.shape:  # overlapping views included: ATen refuses some
            self.both(lambda t: t.copy_(c2 if t is c1 else d2), (c1, d1))

    def compute(self) -> None:
        c, d = self.pick()
        fn = self.rng.choice([lambda t: t + 1, lambda t: t * t, torch.ones_like, torch.clone,
                              lambda t: t.to(torch.float64).to(torch.float32),
                              lambda t: torch.zeros_like(t) + t.sum()])
        self.add(fn(c), fn(d))

    def resize(self) -> None:
        c, d = self.pick()
        if c.is_contiguous() and c._base is None:
            n = self.rng.randint(0, 30)
            for t in (c, d):
                t.resize_(n)
                t.fill_(1.5)  # grown memory is uninitialised: define it

    def assign(self) -> None:
        c, d = self.pick()
        if c.dim() and c.shape[0]:
            idx = torch.tensor([0, c.shape[0] - 1])
            c[idx] = 9.0
            d[idx.to(d.device)] = 9.0

    def run(self, steps: int) -> None:
        kinds = [self.view] * 3 + [self.in_place] * 3 + [self.copy] * 2 + \
            [self.compute] * 3 + [self.resize, self.assign]
        for step in range(steps):
            self.rng.choice(kinds)()
            for c, d in self.pool:
                assert (d.shape, d.stride(), d.dtype) == (c.shape, c.stride(), c.dtype), step
                assert torch.equal(d.cpu(), c), step


@pytest.mark.parametrize("seed", range(8))
def test_random_programs_match_the_cpu(seed: int) -> None:
    _Program(seed).run(300)
