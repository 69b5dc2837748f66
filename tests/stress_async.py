"""Stress of stream-ordered memory reuse: random programs with frees, random factories,
host-computed results and several host threads, every result checked against the CPU.

On an asynchronous runtime the host frees a tensor while kernels that read it are still
queued; the allocator must not hand that memory out before they ran, whatever writes it
next (a queued kernel, a random factory computed by the host, a copy, another thread).
Every value below but a few training steps' loss is a small integer held in float32, so
the CPU's results are exact and a reused block shows as a wrong number, never as rounding.

    python -m tests.stress_async                       # the mode of the environment
    TORCHPORT_SIM_ASYNC=1 python -m tests.stress_async --threads 4 --steps 2000

Prints ``wrong W of N`` and exits 1 when W > 0.
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

Check = tuple[str, Any, torch.Tensor]  # (what, device result, expected CPU result)


def _program(rng: random.Random, device: str, steps: int) -> list[Check]:
    """One host thread's work: ``steps`` random operations, each result kept with the
    CPU's answer; frees happen as they come (``del``, reassignment)."""
    checks: list[Check] = []
    n = rng.choice((1024, 4096, 16384))
    base_cpu = torch.randint(-8, 8, (n,), generator=torch.Generator().manual_seed(
        rng.randrange(1 << 30))).float()
    base = base_cpu.to(device)

    def scaled_sum() -> None:
        k = float(rng.randint(1, 4))
        y = base * k
        z = y.sum()
        del y  # freed while the sum that reads it may still be queued
        checks.append(("(x*k).sum()", z, (base_cpu * k).sum()))

    def random_factory() -> None:
        size = rng.choice((n, n // 2, 2 * n, 777))
        kind = rng.choice(("rand", "randn", "randint", "normal_"))
        if kind == "rand":
            r = torch.rand(size, device=device)
        elif kind == "randn":
            r = torch.randn(size, device=device)
        elif kind == "randint":
            r = torch.randint(0, 10, (size,), device=device)
        else:
            r = torch.empty(size, device=device).normal_()
        checks.append((f"{kind}({size}).shape", r.shape, torch.Size([size])))
        del r

    def masked_select() -> None:
        t = float(rng.randint(-4, 4))
        m = base[base > t]  # a host-computed result (its size depends on the data)
        checks.append((f"x[x > {t}]", m, base_cpu[base_cpu > t]))

    def fill_and_add() -> None:
        v = float(rng.randint(-3, 3))
        f = torch.full((n,), v, device=device)
        g = f + base
        del f
        checks.append(("full + x", g, torch.full((n,), v) + base_cpu))

    def in_place_chain() -> None:
        y = base.clone()
        y.mul_(2).add_(1)
        s = y.cumsum(0)
        del y
        checks.append(("cumsum(2x+1)", s, (base_cpu * 2 + 1).cumsum(0)))

    def host_tensor() -> None:
        values = [float(rng.randint(-9, 9)) for _ in range(rng.choice((3, 300, 3000)))]
        t = torch.tensor(values, device=device)
        u = t * 3
        del t
        checks.append(("tensor(list) * 3", u, torch.tensor(values) * 3))

    def matmul() -> None:
        a = base[:1024].view(32, 32)
        b = a @ a.t()
        c = b.sum(1)
        del b
        a_cpu = base_cpu[:1024].view(32, 32)
        checks.append(("(a @ a.T).sum(1)", c, (a_cpu @ a_cpu.t()).sum(1)))

    def train_steps() -> None:
        g = torch.Generator().manual_seed(rng.randrange(1 << 30))
        data, target = torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g)
        init = torch.nn.Linear(16, 4)
        with torch.no_grad():
            init.weight.copy_(torch.randn(4, 16, generator=g))
        losses = []
        for dev in ("cpu", device):
            model = torch.nn.Linear(16, 4).to(dev)
            model.load_state_dict(init.state_dict())
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            x, y = data.to(dev), target.to(dev)
            for _ in range(3):
                loss = torch.nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
            losses.append(loss.detach())
        checks.append(("3 SGD steps: loss", losses[1], losses[0]))

    ops: list[Callable[[], None]] = [scaled_sum, random_factory, masked_select, fill_and_add,
                                     in_place_chain, host_tensor, matmul, train_steps]
    weights = [4, 4, 2, 2, 2, 1, 1, 1]
    for _ in range(steps):
        rng.choices(ops, weights)[0]()
    return checks


def run(threads: int, steps: int, seed: int, devices: list[str]) -> tuple[int, int, list[str]]:
    """``(wrong, checked, first messages)`` of ``threads`` programs run concurrently."""
    results: list[list[Check]] = [[] for _ in range(threads)]
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            device = devices[i % len(devices)]
            results[i] = _program(random.Random(seed * 1000 + i), device, steps)
        except BaseException as e:  # reported below, never lost in a thread
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]
    wrong, checked, messages = 0, 0, []
    for checks in results:
        for what, got, want in checks:
            checked += 1
            if isinstance(got, torch.Size):
                ok = got == want
            elif what.startswith("3 SGD"):  # the same kernels; summation order may differ
                ok = torch.allclose(got.cpu(), want, rtol=1e-5, atol=1e-6)
            else:
                ok = torch.equal(got.cpu(), want)
            if not ok:
                wrong += 1
                if len(messages) < 5:
                    messages.append(f"{what}: {got} != {want}")
    return wrong, checked, messages


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300, help="operations per thread")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--devices", default="sim:0,sim:1")
    args = ap.parse_args(argv)
    import torchport.sim  # noqa: F401

    devices = args.devices.split(",")
    wrong = checked = 0
    for r in range(args.rounds):
        w, c, messages = run(args.threads, args.steps, args.seed + r, devices)
        wrong, checked = wrong + w, checked + c
        for m in messages:
            print(m, file=sys.stderr)
    print(f"wrong {wrong} of {checked}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
