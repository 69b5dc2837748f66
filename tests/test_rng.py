"""Device random numbers: seeding, states, reproducibility, fork_rng, no CPU side effects."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import torchport.sim  # noqa: F401

B = torch.sim.backend


def _ops() -> dict[str, Callable[[], torch.Tensor]]:
    d = "sim"
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4]).to(d)
    return {
        "rand": lambda: torch.rand(5, 7, device=d),
        "randn": lambda: torch.randn(5, 7, device=d),
        "randint": lambda: torch.randint(0, 100, (20,), device=d),
        "randperm": lambda: torch.randperm(50, device=d),
        "bernoulli": lambda: torch.bernoulli(torch.full((30,), 0.5, device=d)),
        "bernoulli_p": lambda: torch.empty(30, device=d).bernoulli_(0.3),
        "dropout": lambda: torch.nn.functional.dropout(torch.ones(40, device=d), 0.5),
        "multinomial": lambda: torch.multinomial(probs, 10, replacement=True),
        "normal_": lambda: torch.empty(20, device=d).normal_(1.0, 2.0),
        "uniform_": lambda: torch.empty(20, device=d).uniform_(-1.0, 1.0),
        "normal_fn": lambda: torch.normal(torch.zeros(10, device=d), 1.0),
        "exponential_": lambda: torch.empty(10, device=d).exponential_(),
    }


@pytest.mark.parametrize("name", sorted(_ops()))
def test_reproducible_and_cpu_untouched(name: str) -> None:
    op = _ops()[name]
    torch.sim.manual_seed(1234)
    cpu_state = torch.get_rng_state()
    a = op().cpu()
    assert torch.equal(torch.get_rng_state(), cpu_state), "CPU generator advanced"
    b2 = op().cpu()
    torch.sim.manual_seed(1234)
    c = op().cpu()
    torch.testing.assert_close(a, c, rtol=0, atol=0)
    if name not in ("bernoulli", "bernoulli_p", "multinomial", "dropout"):
        assert not torch.equal(a, b2), "generator state did not advance"


def test_matches_cpu_generator_stream() -> None:
    """The device generator is CPU's Philox-free mt19937: same seed, same numbers as CPU."""
    torch.sim.manual_seed(7)
    g = torch.Generator().manual_seed(7)
    torch.testing.assert_close(torch.rand(100, device="sim").cpu(), torch.rand(100, generator=g))


def test_torch_manual_seed_seeds_device_and_cpu() -> None:
    torch.manual_seed(99)
    a = torch.randn(8, device="sim").cpu()
    ca = torch.randn(8)
    torch.manual_seed(99)
    assert torch.equal(torch.randn(8, device="sim").cpu(), a)
    assert torch.equal(torch.randn(8), ca)
    assert torch.sim.initial_seed() == 99


def test_manual_seed_current_device_only() -> None:
    torch.sim.manual_seed_all(5)
    with torch.sim.device(1):
        torch.sim.manual_seed(6)
        assert torch.sim.initial_seed() == 6
    assert torch.sim.initial_seed() == 5
    a = torch.rand(4, device="sim:0").cpu()
    b = torch.rand(4, device="sim:1").cpu()
    assert not torch.equal(a, b)
    torch.sim.manual_seed_all(6)
    torch.testing.assert_close(torch.rand(4, device="sim:0").cpu(),
                               torch.rand(4, device="sim:1").cpu(), rtol=0, atol=0)


def test_seed_and_seed_all() -> None:
    torch.sim.seed()
    s = torch.sim.initial_seed()
    assert isinstance(s, int)
    torch.sim.manual_seed(s)
    a = torch.rand(3, device="sim").cpu()
    torch.sim.seed()
    torch.sim.manual_seed(s)
    assert torch.equal(torch.rand(3, device="sim").cpu(), a)
    torch.sim.seed_all()
    s0 = torch.sim.initial_seed()
    with torch.sim.device(1):
        assert torch.sim.initial_seed() == s0


def test_get_set_rng_state() -> None:
    torch.sim.manual_seed_all(3)
    st = torch.sim.get_rng_state()
    assert st.dtype == torch.uint8 and st.device.type == "cpu"
    a = torch.randn(10, device="sim").cpu()
    torch.sim.set_rng_state(st)
    assert torch.equal(torch.randn(10, device="sim").cpu(), a)
    all_states = torch.sim.get_rng_state_all()
    assert len(all_states) == torch.sim.device_count()
    x0, x1 = torch.rand(3, device="sim:0").cpu(), torch.rand(3, device="sim:1").cpu()
    torch.sim.set_rng_state_all(all_states)
    assert torch.equal(torch.rand(3, device="sim:0").cpu(), x0)
    assert torch.equal(torch.rand(3, device="sim:1").cpu(), x1)
    st1 = torch.sim.get_rng_state("sim:1")
    torch.sim.set_rng_state(st1, device=1)
    assert torch.equal(torch.sim.get_rng_state(1), st1)


def test_set_rng_state_rejects_bad_state() -> None:
    with pytest.raises((RuntimeError, TypeError, ValueError)):
        torch.sim.set_rng_state(torch.zeros(3, dtype=torch.uint8))


def test_fork_rng() -> None:
    torch.sim.manual_seed_all(11)
    before = torch.sim.get_rng_state_all()
    with torch.random.fork_rng(devices=range(torch.sim.device_count()), device_type="sim"):
        torch.sim.manual_seed_all(0)
        torch.rand(10, device="sim")
        torch.rand(10, device="sim:1")
    after = torch.sim.get_rng_state_all()
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
