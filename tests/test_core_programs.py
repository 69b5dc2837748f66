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

pytestmark = pytest.mark.modes

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


def _graph(seed: int, device: str) -> tuple[list, torch.Tensor, list]:
    """A random differentiable program on ``device``: the layout and grad_fn of each step
    (or its error), the loss, and the leaves' gradients."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    leaves = [torch.randn(shape, generator=g).to(device).requires_grad_()
              for shape in ((4, 6), (6,), (4, 1))]
    pool = list(leaves)
    trace: list = []

    def in_place_on_a_view(a: torch.Tensor) -> torch.Tensor:
        r = a.clone()
        (r.view(-1)[:2] if r.is_contiguous() else r[..., :1]).mul_(2)  # CopySlices
        return r

    def assign(a: torch.Tensor) -> torch.Tensor:
        r = a * 1
        r[..., 0] = rng.choice(pool).sum()
        return r

    steps: list[Callable[[torch.Tensor], torch.Tensor]] = [
        lambda a: a * rng.choice(pool),
        torch.tanh,
        lambda a: a.t() if a.dim() == 2 else a.unsqueeze(0),
        lambda a: a[..., ::2] if a.shape[-1] > 1 else a.squeeze(-1),
        in_place_on_a_view,
        lambda a: a.sum(-1, keepdim=True),
        lambda a: torch.relu(a) + a.exp(),
        assign,
        lambda a: a.reshape(-1)[:3].unsqueeze(1) * a.reshape(-1)[-3:].unsqueeze(0),
        lambda a: torch.cat([a.reshape(-1), rng.choice(pool).reshape(-1)]),
        lambda a: a.detach() * a,
        lambda a: torch.where(a > 0, a, a * 0.5),
        lambda a: (a * 1).transpose(0, -1).contiguous() if a.dim() > 1 else a.flip(0),
        lambda a: torch.nn.functional.softmax(a.reshape(-1), 0),
    ]
    for _ in range(rng.randrange(3, 12)):
        step, a = rng.choice(steps), rng.choice(pool)
        try:
            r = step(a)
        except RuntimeError as e:  # broadcasting mismatches: the CPU's error too
            trace.append(str(e).split("\n")[0])
            continue
        pool.append(r)
        trace.append((r.shape, r.stride(), type(r.grad_fn).__name__))
    loss = sum((t ** 2).sum() for t in pool[-3:])
    loss.backward()
    return trace, loss.detach().cpu(), [x.grad.cpu() for x in leaves if x.grad is not None]


@pytest.mark.parametrize("seed", range(40))
def test_random_differentiable_programs_match_the_cpu(seed: int) -> None:
    # Views of non-leaf tensors changed in place (autograd's CopySlices), index assignment,
    # detach, broadcasting: every step's layout and grad_fn, the loss and the gradients
    # must be the CPU's, bit for bit.
    (ct, cl, cg), (dt, dl, dg) = _graph(seed, "cpu"), _graph(seed, "sim")
    assert dt == ct
    assert torch.equal(dl, cl)
    assert len(dg) == len(cg) and all(torch.equal(d, c) for d, c in zip(dg, cg, strict=True))
