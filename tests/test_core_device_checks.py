"""CPU tensors next to device tensors: the sim raises where CUDA's kernels raise and takes
what they take (ATen's CUDA code is the spec; CPU PyTorch gives the values).

CUDA takes a CPU tensor as a 0-dim operand (TensorIterator's CPU scalars), as an index of
``x[idx]``/``index_put_`` (ATen's AdvancedIndex moves it), and requires one for foreach's
packed ``scalars``; every other CPU tensor argument raises a RuntimeError."""

from collections.abc import Callable

import pytest
import torch

import torchport.sim  # noqa: F401

pytestmark = pytest.mark.modes

Case = Callable[[str], object]


def _x(d: str, n: int = 5) -> torch.Tensor:
    return torch.arange(float(n * 4), device=d).view(n, 4)


def _lists(d: str, dtype: torch.dtype = torch.float32) -> list[list[torch.Tensor]]:
    return [[(torch.arange(4.0, device=d) + k + 1).to(dtype) for _ in range(2)]
            for k in range(3)]


def _addc(name: str, inplace: bool, scalars_on: str, dtype: torch.dtype = torch.float32,
          scalars: Callable[[str], torch.Tensor] | None = None) -> Case:
    fn = getattr(torch, f"_foreach_{name}{'_' if inplace else ''}")

    def case(d: str) -> object:
        a, b, c = _lists(d, dtype)
        s = scalars(d) if scalars else torch.tensor([0.5, 2.0], device=scalars_on)
        if d == "cpu":
            s = s.cpu()  # the reference run: the CPU's scalars are always on the CPU
        r = fn(a, b, c, s)
        return a if inplace else r
    return case


def _index_put(values_on: str, accumulate: bool, index: str = "long") -> Case:
    def case(d: str) -> torch.Tensor:
        x = _x(d)
        idx = (torch.tensor([True, False, True, False, False]) if index == "mask"
               else torch.tensor([0, 2]))
        shape = [1] if index == "mask" else [2, 4]
        v = torch.full(shape, 7.0, device=values_on if d != "cpu" else "cpu")
        return x.index_put_((idx,), v, accumulate=accumulate)
    return case


# Calls CUDA rejects: every one a RuntimeError on the sim too (with these words).
RAISES: dict[str, tuple[Case, str]] = {
    "index_put_ CPU values": (_index_put("cpu", False), "same device"),
    "index_put_ CPU values, accumulate": (_index_put("cpu", True), "same device"),
    "index_put CPU values": (
        lambda d: torch.index_put(_x(d), (torch.tensor([1]),), torch.ones(1, 4)),
        "same device"),
    "index_put_ CPU values, mask, accumulate": (_index_put("cpu", True, "mask"), "same device"),
    "x[idx] = CPU values": (
        lambda d: _x(d).__setitem__(torch.tensor([0, 1], device=d), torch.ones(2, 4)),
        "same device"),
    **{f"_foreach_{n}{'_' if i else ''} device scalars": (
        _addc(n, i, "sim"), "Expected scalars to be on CPU, got sim:0 instead")
       for n in ("addcdiv", "addcmul") for i in (False, True)},
    # the scalars' device is checked first: before addcdiv's integer refusal
    **{f"_foreach_addcdiv_ {dt} device scalars": (
        _addc("addcdiv", True, "sim", dt), "Expected scalars to be on CPU")
       for dt in (torch.int64, torch.bool)},
    "_foreach_addcmul_ int64 device scalars": (
        _addc("addcmul", True, "sim", torch.int64), "Expected scalars to be on CPU"),
    # TensorIterator (index_fill_, index_copy), generated checks (index_select, index_add,
    # take, put_): a CPU index of one or more dimensions
    "index_fill CPU index": (
        lambda d: _x(d).index_fill(1, torch.tensor([0, 2]), -1.0), "same device"),
    "index_fill_ CPU index": (
        lambda d: _x(d).index_fill_(0, torch.tensor([1]), -1.0), "same device"),
    "index_select CPU index": (
        lambda d: _x(d).index_select(0, torch.tensor([0, 2])), "same device"),
    "index_add CPU index": (
        lambda d: _x(d).index_add(0, torch.tensor([0, 2]), torch.ones(2, 4, device=d)),
        "same device"),
    "index_copy CPU index": (
        lambda d: _x(d).index_copy(0, torch.tensor([0, 2]), torch.ones(2, 4, device=d)),
        "same device"),
    "take CPU index": (lambda d: _x(d).take(torch.tensor([0, 2])), "same device"),
    "gather CPU index": (
        lambda d: _x(d).gather(0, torch.zeros(2, 4, dtype=torch.long)), "same device"),
}


# Calls CUDA takes: the sim computes the CPU's values, bit for bit.
WORKS: dict[str, Case] = {
    "index_put_ CPU index": _index_put("sim", False),
    "index_put_ CPU index, accumulate": _index_put("sim", True),
    "index_put_ CPU 0-dim values": lambda d: _x(d).index_put_(
        (torch.tensor([1, 3]),), torch.tensor(7.0), accumulate=True),
    "index_put_ CPU one-element values, device mask": lambda d: _x(d).index_put_(
        (torch.tensor([True, False, True, False, False], device=d),), torch.tensor([7.0])),
    "x[cpu_idx]": lambda d: _x(d)[torch.tensor([0, 3])],
    "x[cpu_idx] = v": lambda d: _x(d).__setitem__(torch.tensor([4, 1]),
                                                  torch.ones(2, 4, device=d)),
    **{f"_foreach_{n}{'_' if i else ''} CPU scalars": _addc(n, i, "cpu")
       for n in ("addcdiv", "addcmul") for i in (False, True)},
    "_foreach_addcmul_ int64 CPU scalars": _addc(
        "addcmul", True, "cpu", torch.int64, lambda d: torch.tensor([2, 3])),
    "add CPU 0-dim": lambda d: _x(d) + torch.tensor(2.5),
    "index_fill CPU 0-dim value": lambda d: _x(d).index_fill(1, torch.tensor([0, 2], device=d),
                                                             torch.tensor(-1.0)),
}


def _run(case: Case, d: str) -> object:
    r = case(d)
    if r is None:
        return None
    return [t.cpu() for t in r] if isinstance(r, (list, tuple)) else r.cpu()


@pytest.mark.parametrize("name", list(RAISES))
def test_raises_where_cuda_raises(name: str) -> None:
    case, words = RAISES[name]
    with pytest.raises(RuntimeError, match=words):
        case("sim")
    torch.sim.synchronize()


@pytest.mark.parametrize("name", list(RAISES))
def test_the_same_call_on_one_device_works(name: str) -> None:
    """Each refused call is refused for its devices alone: on the CPU it computes (or fails
    with the CPU's own error, as integer addcdiv does), so the device is what differs."""
    case, _ = RAISES[name]
    try:
        case("cpu")
    except RuntimeError as e:
        assert "device" not in str(e), e


@pytest.mark.parametrize("name", list(WORKS))
def test_accepts_what_cuda_accepts(name: str) -> None:
    want, got = _run(WORKS[name], "cpu"), _run(WORKS[name], "sim")
    wants = want if isinstance(want, list) else [want]
    gots = got if isinstance(got, list) else [got]
    for w, g in zip(wants, gots, strict=True):
        if w is None:
            assert g is None
            continue
        assert (g.dtype, g.shape) == (w.dtype, w.shape)
        assert torch.equal(g, w), (name, w, g)


def test_the_tables_name_real_arguments() -> None:
    """The op layer's tables (the one place saying which arguments may be CPU tensors) name
    overloads and arguments of this torch's schemas."""
    from torchport.ops import plan

    for name, args in {**plan.CPU_ARGS, **plan.HOST_ARGS}.items():
        base, _, overload = name.removeprefix("aten::").partition(".")
        packet = getattr(torch.ops.aten, base)
        schema = getattr(packet, overload or "default")._schema
        assert args <= {a.name for a in schema.arguments}, name


@pytest.mark.filterwarnings("ignore::torchport.ops.FallbackWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bfloat16])
@pytest.mark.parametrize("dim,keepdim", [(0, False), (1, True), (-1, False)])
def test_mode_functional_and_out(dtype: torch.dtype, dim: int, keepdim: bool) -> None:
    """ATen's ``mode.values`` is a composite refusing devices other than CPU/CUDA/XPU; the
    device's own gives the CPU's values and indices, into the outputs given."""
    g = torch.Generator().manual_seed(7)
    t = torch.randint(0, 4, (6, 9), generator=g).to(dtype)
    want = torch.mode(t, dim, keepdim)
    d = t.to("sim")
    got = torch.mode(d, dim, keepdim)
    values = torch.empty(0, dtype=dtype, device="sim")
    indices = torch.empty(0, dtype=torch.long, device="sim")
    r = torch.mode(d, dim, keepdim, out=(values, indices))
    assert r[0] is values and r[1] is indices
    for v, i in (got, (values, indices)):
        assert v.device.type == "sim" and i.device.type == "sim"
        assert torch.equal(v.cpu(), want.values) and torch.equal(i.cpu(), want.indices)


@pytest.mark.filterwarnings("ignore::torchport.ops.FallbackWarning")
def test_mode_out_keeps_cudas_checks() -> None:
    d = torch.ones(3, 4, device="sim")
    with pytest.raises(RuntimeError, match="same device"):
        torch.mode(d, 0, out=(torch.empty(0), torch.empty(0, dtype=torch.long)))
    want = _error(lambda: torch.mode(torch.ones(3, 4), 0, out=(
        torch.empty(0, dtype=torch.int32), torch.empty(0, dtype=torch.long))))
    got = _error(lambda: torch.mode(d, 0, out=(
        torch.empty(0, dtype=torch.int32, device="sim"),
        torch.empty(0, dtype=torch.long, device="sim"))))
    assert got == want


def _error(fn: Callable[[], object]) -> tuple[type, str]:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 -- the error itself is compared
        return type(e), str(e)
    raise AssertionError("no error")
