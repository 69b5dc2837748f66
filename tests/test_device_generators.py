"""Device generators: ``torch.Generator(device="sim:1")``, ``torch.sim.default_generators``,
``generator=`` on device ops, against the CPU with the same seed (bit for bit)."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable

import pytest
import torch

import torchport.sim  # noqa: F401
from tests.helpers import run_python
from torchport.core import native
from torchport.ops.hostexec import GeneratorDeviceError

pytestmark = pytest.mark.modes

B = torch.sim.backend
NATIVE = native.loaded() is not None
needs_cpp = pytest.mark.skipif(not NATIVE, reason=f"no C++ library: {native.UNAVAILABLE}")
CUDA_DEFAULT_SEED = 67280421310721


def _ops(d: str) -> dict[str, Callable[[torch.Generator], torch.Tensor]]:
    """Random ops taking ``generator=``, on device ``d`` (``"cpu"``: the oracle)."""
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4]).to(d)
    return {
        "rand": lambda g: torch.rand(5, 7, device=d, generator=g),
        "randn": lambda g: torch.randn(5, 7, device=d, generator=g),
        "randn_f64": lambda g: torch.randn(9, dtype=torch.float64, device=d, generator=g),
        "randint": lambda g: torch.randint(0, 100, (20,), device=d, generator=g),
        "randint_low": lambda g: torch.randint(5, 100, (20,), device=d, generator=g),
        "randperm": lambda g: torch.randperm(50, device=d, generator=g),
        "multinomial": lambda g: torch.multinomial(probs, 10, replacement=True, generator=g),
        "normal": lambda g: torch.normal(torch.zeros(10, device=d), 1.0, generator=g),
        "normal_": lambda g: torch.empty(20, device=d).normal_(1.0, 2.0, generator=g),
        "uniform_": lambda g: torch.empty(20, device=d).uniform_(-1.0, 1.0, generator=g),
        "bernoulli": lambda g: torch.bernoulli(torch.full((30,), 0.5, device=d), generator=g),
        "bernoulli_": lambda g: torch.empty(30, device=d).bernoulli_(0.3, generator=g),
        "exponential_": lambda g: torch.empty(10, device=d).exponential_(generator=g),
        "random_": lambda g: torch.empty(10, device=d).random_(0, 50, generator=g),
        "cauchy_": lambda g: torch.empty(10, device=d).cauchy_(generator=g),
        "log_normal_": lambda g: torch.empty(10, device=d).log_normal_(generator=g),
        "geometric_": lambda g: torch.empty(10, device=d).geometric_(0.3, generator=g),
    }


@needs_cpp
@pytest.mark.filterwarnings("ignore::torchport.ops.fallback.FallbackWarning")  # the CPU fallback
@pytest.mark.parametrize("name", sorted(_ops("cpu")))
def test_generator_argument_draws_as_the_cpu(name: str) -> None:
    sim_op, cpu_op = _ops("sim")[name], _ops("cpu")[name]
    torch.sim.manual_seed(1)
    device_state, cpu_state = torch.sim.get_rng_state(), torch.get_rng_state()
    g = torch.Generator(device="sim").manual_seed(1234)
    c = torch.Generator().manual_seed(1234)
    for _ in range(2):  # the generator advances as the CPU's does
        assert torch.equal(sim_op(g).cpu(), cpu_op(c))
    assert torch.equal(g.get_state(), c.get_state())
    # the device's default generator and the CPU's did not move
    assert torch.equal(torch.sim.get_rng_state(), device_state)
    assert torch.equal(torch.get_rng_state(), cpu_state)
    g.manual_seed(1234)  # reproducible
    assert torch.equal(sim_op(g).cpu(), cpu_op(torch.Generator().manual_seed(1234)))


@needs_cpp
def test_drawn_in_program_order_after_queued_work() -> None:
    """With TORCHPORT_SIM_ASYNC=1 the host draws after the kernels queued before it (on a
    side stream too), as it does for the default generators."""
    g = torch.Generator(device="sim:1").manual_seed(6)
    c = torch.Generator().manual_seed(6)
    x = torch.ones(4096, device="sim:1")
    y = (x * 2).exp()  # queued in asynchronous mode
    y.normal_(generator=g)  # in place on what a queued kernel writes
    z = y + torch.rand(4096, device="sim:1", generator=g)
    y_c = (torch.ones(4096) * 2).exp().normal_(generator=c)
    assert torch.equal(z.cpu(), y_c + torch.rand(4096, generator=c))
    s = torch.sim.Stream(1)
    with torch.sim.stream(s):
        w = (x + 1).mul_(3)
        w.uniform_(generator=g)
    s.synchronize()
    assert torch.equal(w.cpu(), torch.empty(4096).uniform_(generator=c))


@needs_cpp
def test_new_generator_device_and_seeds() -> None:
    g = torch.Generator(device="sim")
    assert g.device == torch.device("sim", 0)
    assert g.initial_seed() == CUDA_DEFAULT_SEED == torch.Generator().initial_seed()
    assert torch.Generator(device="sim:1").device == torch.device("sim", 1)
    assert torch.Generator(device=torch.device("sim", 1)).device == torch.device("sim", 1)
    with torch.sim.device(1):
        assert torch.Generator(device="sim").device == torch.device("sim", 1)
    assert g.manual_seed(5) is g and g.initial_seed() == 5
    s = g.seed()
    assert g.initial_seed() == s
    a = torch.rand(4, device="sim", generator=g).cpu()
    assert torch.equal(a, torch.rand(4, generator=torch.Generator().manual_seed(s)))
    with pytest.raises(RuntimeError, match="invalid device ordinal 5"):
        torch.Generator(device="sim:5")


@needs_cpp
def test_state_is_the_cpu_format() -> None:
    g = torch.Generator(device="sim:1").manual_seed(9)
    c = torch.Generator().manual_seed(9)
    assert torch.equal(g.get_state(), c.get_state())
    torch.randn(3, generator=c)  # a CPU state moves into the device generator
    g.set_state(c.get_state())
    assert torch.equal(torch.randn(6, device="sim:1", generator=g).cpu(),
                       torch.randn(6, generator=c))
    with pytest.raises(RuntimeError):
        g.set_state(torch.zeros(3, dtype=torch.uint8))


@needs_cpp
def test_clone_and_graphsafe_states() -> None:
    g = torch.Generator(device="sim").manual_seed(3)
    twin = g.clone_state()  # a copy: drawing from one leaves the other
    assert twin.device == g.device and torch.equal(twin.get_state(), g.get_state())
    torch.rand(5, device="sim", generator=g)
    assert not torch.equal(twin.get_state(), g.get_state())
    shared = g.graphsafe_get_state()  # as CUDA's: one state, two generators
    assert shared.device == g.device
    x = torch.rand(5, device="sim", generator=shared).cpu()
    assert torch.equal(shared.get_state(), g.get_state())
    other = torch.Generator(device="sim")
    other.graphsafe_set_state(shared)
    y = torch.rand(5, device="sim", generator=other).cpu()
    assert torch.equal(g.get_state(), other.get_state()) and not torch.equal(x, y)
    with pytest.raises(RuntimeError, match="default generator of sim:0"):
        torch.sim.default_generators[0].graphsafe_set_state(shared)


@needs_cpp
def test_pickle_and_deepcopy() -> None:
    g = torch.Generator(device="sim:1").manual_seed(11)
    torch.rand(3, device="sim:1", generator=g)
    for dup in (copy.deepcopy, lambda x: pickle.loads(pickle.dumps(x))):
        h = dup(g)
        assert h.device == torch.device("sim", 1) and torch.equal(h.get_state(), g.get_state())
        assert torch.equal(torch.rand(4, device="sim:1", generator=h).cpu(),
                           torch.rand(4, device="sim:1", generator=g).cpu())
    assert g.get_offset() == 0
    with pytest.raises(RuntimeError, match="no offset"):
        g.set_offset(4)


def test_default_generators_are_the_device_state() -> None:
    gens = torch.sim.default_generators
    assert isinstance(gens, tuple) and len(gens) == torch.sim.device_count()
    if NATIVE:
        assert [g.device for g in gens] == B.devices
    torch.sim.manual_seed_all(5)
    assert [g.initial_seed() for g in gens] == [5, 5]
    gens[1].manual_seed(9)
    with torch.sim.device(1):
        assert torch.sim.initial_seed() == 9
    assert torch.equal(torch.sim.get_rng_state(1), torch.Generator().manual_seed(9).get_state())
    assert torch.equal(torch.sim.get_rng_state(0), gens[0].get_state())
    torch.manual_seed(21)
    assert gens[0].initial_seed() == gens[1].initial_seed() == 21
    # the ops without a generator and those given the default one draw from one stream
    c = torch.Generator().manual_seed(21)
    assert torch.equal(torch.randn(4, device="sim").cpu(), torch.randn(4, generator=c))
    assert torch.equal(torch.randn(4, device="sim", generator=gens[0]).cpu(),
                       torch.randn(4, generator=c))
    assert torch.equal(torch.empty(6, device="sim").uniform_(generator=gens[0]).cpu(),
                       torch.empty(6).uniform_(generator=c))
    assert torch.equal(torch.sim.get_rng_state(0), c.get_state())


@needs_cpp
@pytest.mark.skipif(not hasattr(torch.accelerator, "random"),
                    reason="torch.accelerator.random came with torch 2.14")
def test_accelerator_random_reads_the_device_generators() -> None:
    r = torch.accelerator.random  # the C++ hooks' default generators answer it
    torch.sim.manual_seed_all(5)
    torch.sim.default_generators[1].manual_seed(9)
    assert (r.initial_seed(), r.initial_seed(1)) == (5, 9)
    assert torch.equal(r.get_rng_state(1), torch.sim.get_rng_state(1))
    assert len(r.get_rng_state_all()) == torch.sim.device_count()
    state = r.get_rng_state()
    a = torch.rand(3, device="sim")
    torch.sim.set_rng_state(state)
    assert torch.equal(torch.rand(3, device="sim").cpu(), a.cpu())


@needs_cpp
def test_generator_of_another_index_draws_from_itself() -> None:
    """CUDA checks a generator's device type only: a sim:1 generator serves an op on sim:0."""
    torch.sim.manual_seed_all(2)
    before = torch.sim.get_rng_state_all()
    g1 = torch.Generator(device="sim:1").manual_seed(8)
    x = torch.randn(5, device="sim:0", generator=g1)
    assert x.device == torch.device("sim", 0)
    assert torch.equal(x.cpu(), torch.randn(5, generator=torch.Generator().manual_seed(8)))
    assert all(torch.equal(a, b) for a, b in zip(before, torch.sim.get_rng_state_all(),
                                                  strict=True))
    y = torch.randn(5, device="sim:0", generator=torch.sim.default_generators[1])
    assert torch.equal(y.cpu(), torch.randn(5, generator=torch.Generator().manual_seed(2)))
    assert torch.equal(torch.sim.get_rng_state(0), before[0])
    assert not torch.equal(torch.sim.get_rng_state(1), before[1])


def test_cpu_generator_on_a_device_op_raises_as_cuda() -> None:
    wrong = "Expected a 'sim' device type for generator but found 'cpu'"
    with pytest.raises(GeneratorDeviceError, match=wrong):
        torch.rand(3, device="sim", generator=torch.Generator())
    with pytest.raises(RuntimeError, match=wrong):
        torch.empty(3, device="sim").normal_(generator=torch.Generator())
    with pytest.raises(RuntimeError, match=wrong):
        torch.randperm(4, device="sim:1", generator=torch.Generator())


@needs_cpp
def test_device_generator_on_a_cpu_op_raises_as_cuda() -> None:
    g = torch.Generator(device="sim")
    state = g.get_state()
    wrong = "Expected a 'cpu' device type for generator but found 'sim'"
    for op in (lambda: torch.randn(3, generator=g), lambda: torch.empty(3).normal_(generator=g),
               lambda: torch.randperm(5, generator=g), lambda: torch.rand(2, device="cpu", generator=g),
               lambda: torch.bernoulli(torch.full((4,), 0.5), generator=g)):
        with pytest.raises(RuntimeError, match=wrong):
            op()
    assert torch.equal(g.get_state(), state)


@needs_cpp
def test_data_loader_shuffles_with_a_device_generator_as_cuda_refuses() -> None:
    """RandomSampler draws a CPU randperm: CUDA generators are refused there too."""
    loader = torch.utils.data.DataLoader(list(range(8)), shuffle=True,
                                         generator=torch.Generator(device="sim"))
    with pytest.raises(RuntimeError, match="Expected a 'cpu' device type for generator"):
        list(loader)


@needs_cpp
def test_cuda_default_generators_are_the_device_ones(xfer) -> None:
    assert torch.cuda.default_generators is torch.sim.default_generators
    torch.cuda.default_generators[1].manual_seed(4)
    with torch.sim.device(1):
        assert torch.sim.initial_seed() == 4


_WITHOUT_CPP = """
import torch, torchport.sim
from torchport.core import native
assert native.loaded() is None
gens = torch.sim.default_generators
assert len(gens) == 2 and all(g.device.type == "cpu" for g in gens)
gens[0].manual_seed(3)
want = torch.Generator().manual_seed(3)
assert torch.equal(torch.rand(4, device="sim").cpu(), torch.rand(4, generator=want))
assert torch.equal(torch.rand(4, device="sim", generator=gens[0]).cpu(),
                   torch.rand(4, generator=want))
try:
    torch.rand(4, device="sim", generator=torch.Generator())
except RuntimeError as e:
    assert "found 'cpu'" in str(e) and "C++ library" in str(e), e
else:
    raise AssertionError("a CPU generator served a sim op")
try:
    torch.Generator(device="sim")
except NotImplementedError as e:
    assert "getNewGenerator" in str(e), e
else:
    raise AssertionError("a sim generator without the C++ library")
print("ok")
"""


def test_without_the_cpp_library_the_cpu_generators_serve() -> None:
    r = run_python(_WITHOUT_CPP, TORCHPORT_NATIVE="0", TORCHPORT_FALLBACK_WARN="0")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr[-3000:]


@needs_cpp  # (torch.Generator(device=...) is the C++ layer's)
def test_device_1_generators_drive_randn_dropout_and_randperm_reproducibly():
    # dropout takes no generator: it draws from the device's default generator, which is
    # torch.sim.default_generators[1] itself; randn and randperm take a new generator
    def draws() -> list[torch.Tensor]:
        g = torch.Generator(device="sim:1").manual_seed(1234)
        torch.sim.default_generators[1].manual_seed(99)
        x = torch.ones(64, 64, device="sim:1")
        return [torch.randn(5, 7, device="sim:1", generator=g),
                torch.nn.functional.dropout(x, p=0.3),
                torch.randperm(50, device="sim:1", generator=g),
                torch.nn.functional.dropout(x, p=0.5)]

    first, second = draws(), draws()
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(first, second, strict=True))
    cpu = torch.Generator().manual_seed(1234)
    assert torch.equal(first[0].cpu(), torch.randn(5, 7, generator=cpu))
    assert torch.equal(first[2].cpu(), torch.randperm(50, generator=cpu))
    torch.manual_seed(99)  # the CPU's default generator, seeded the same, drops the same
    ones = torch.ones(64, 64)
    assert torch.equal(first[1].cpu(), torch.nn.functional.dropout(ones, p=0.3))
    assert torch.equal(first[3].cpu(), torch.nn.functional.dropout(ones, p=0.5))
