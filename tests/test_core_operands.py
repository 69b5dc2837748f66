"""Operands and outputs as CUDA takes them: Python numbers and 0-dim CPU tensors as
operands, never as outputs; dtypes the kernels refuse; decompositions that must mean what
the kernel means. Each case is a device-only difference random programs found: the CPU
(or CUDA, where it differs from the CPU) is the oracle, bit for bit."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import run_python

pytestmark = [pytest.mark.modes, pytest.mark.filterwarnings("ignore::UserWarning")]


def _outcome(fn: Callable[[str], object], device: str) -> object:
    try:
        r = fn(device)
    except Exception as e:  # noqa: BLE001 -- the error is the result compared
        return type(e), str(e)
    return r


def same_as_cpu(fn: Callable[[str], object]) -> None:
    """``fn`` on the device gives the CPU's values, dtype, shape and strides, or its error."""
    want, got = _outcome(fn, "cpu"), _outcome(fn, "sim")
    if isinstance(want, tuple) and isinstance(want[0], type):
        assert isinstance(got, tuple) and got[0] is want[0], (want, got)
        return
    assert not (isinstance(got, tuple) and isinstance(got[0], type)), (want, got)
    wants = want if isinstance(want, tuple) else (want,)
    gots = got if isinstance(got, tuple) else (got,)
    for w, g in zip(wants, gots, strict=True):
        assert g.device.type == "sim"
        assert (g.dtype, g.shape, g.stride()) == (w.dtype, w.shape, w.stride())
        assert torch.equal(_bits(g.cpu()), _bits(w)), (w, g)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Complex numbers as their real and imaginary parts (``equal`` then compares NaNs'
    positions only through them, as for real tensors)."""
    return torch.view_as_real(t.resolve_conj()) if t.dtype.is_complex else t


def _t(device: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.arange(6).reshape(2, 3) - 2).to(device, dtype)


@pytest.mark.parametrize("case", [
    lambda d: torch.copysign(_t(d), 2.0),
    lambda d: torch.copysign(_t(d, torch.float16), -1),  # an int scalar keeps float16
    lambda d: torch.copysign(_t(d, torch.int32), -1.5),  # a float scalar: the default dtype
    lambda d: torch.bitwise_left_shift(_t(d, torch.int64), 1),
    lambda d: 1 << _t(d, torch.int64).abs(),
    lambda d: _t(d, torch.int32) >> 2,
    lambda d: _t(d, torch.uint8) << 1,  # a wrapped int never widens uint8
    lambda d: torch.bitwise_right_shift(_t(d, torch.int64).t(), 1),
    lambda d: _t(d).copysign_(-2.0),
    lambda d: torch.xlogy(_t(d), 3.0),
    lambda d: torch.remainder(_t(d, torch.int64), 4),
    lambda d: torch.heaviside(_t(d), torch.tensor(1.0)),
    lambda d: torch.heaviside(_t(d, torch.float64), torch.tensor(1.0)),  # both raise
    # a 0-dim CPU tensor first: the decompositions' out= wrapper refuses it beside a device out
    lambda d: torch.heaviside(torch.tensor(1.0, dtype=torch.bfloat16), _t(d, torch.bfloat16)),
], ids=["copysign", "copysign-half", "copysign-int", "lshift", "rlshift", "rshift",
        "lshift-uint8", "rshift-strided", "copysign_", "xlogy", "remainder",
        "heaviside-cpu0d", "heaviside-dtypes", "heaviside-cpu0d-first"])
def test_python_numbers_and_cpu_scalars_are_operands(case: Callable[[str], object]) -> None:
    same_as_cpu(case)


@pytest.mark.parametrize("value", [2.5, 2, True])
def test_copy_from_a_python_number(value: object) -> None:
    same_as_cpu(lambda d: torch.ones(3, device=d).copy_(value))


_OUTS = {
    "max": lambda t, o: torch.max(t, out=o),
    "prod": lambda t, o: torch.prod(t, 0, out=o),
    "sum": lambda t, o: torch.sum(t, 0, out=o),
    "div": lambda t, o: torch.div(t, 2, out=o),
    "sigmoid": lambda t, o: torch.sigmoid(t, out=o),
    "add": lambda t, o: torch.add(t, t, out=o),
    "mm": lambda t, o: torch.mm(t, t.t(), out=o),
    "copysign": lambda t, o: torch.copysign(t, t, out=o),  # the CPU fallback
    "logaddexp": lambda t, o: torch.logaddexp(t, t, out=o),  # a decomposition
    "cat": lambda t, o: torch.cat([t, t], out=o),
    "add_": lambda t, o: o.add_(t[0, 0]),
    "foreach_add_": lambda t, o: torch._foreach_add_([o], [t[0, 0]]),
}


@pytest.mark.parametrize("name", sorted(_OUTS))
def test_a_cpu_scalar_is_never_an_output(name: str) -> None:
    # CUDA: "Expected all tensors to be on the same device" (TensorIterator lets a 0-dim CPU
    # tensor be an input, never the output); the CPU tensor is left as it was
    t = torch.arange(6.0).reshape(2, 3).to("sim")
    out = torch.tensor(7.0)
    with pytest.raises(RuntimeError, match="same device|cross-device"):
        _OUTS[name](t, out)
    assert out.item() == 7.0 and out.shape == ()


@pytest.mark.parametrize("case", [
    lambda d: torch.logaddexp(_t(d, torch.int64), _t(d, torch.int64)),
    lambda d: torch.logaddexp(_t(d, torch.int64), _t(d, torch.int64),
                              out=torch.empty(2, 3, dtype=torch.int64, device=d)),
    lambda d: F.hardshrink(_t(d, torch.complex64)),
    lambda d: torch.nansum(_t(d, torch.complex64)),
    lambda d: _t(d, torch.float16) >> 1,
    lambda d: (torch.logaddexp(_t(d), _t(d)),  # the decomposition taken once before
               torch.logaddexp(_t(d, torch.bool), _t(d, torch.bool))),
    lambda d: (torch.logaddexp(_t(d), _t(d)),
               torch.logaddexp(_t(d, torch.bool), torch.tensor(True, device=d))),
], ids=["logaddexp-int", "logaddexp-int-out", "hardshrink-complex", "nansum-complex",
        "rshift-half", "logaddexp-bool", "logaddexp-bool-0d"])
def test_dtypes_the_kernels_refuse_raise_as_on_the_cpu(case: Callable[[str], object]) -> None:
    want, got = _outcome(case, "cpu"), _outcome(case, "sim")
    assert isinstance(got, tuple) and got == want


@pytest.mark.parametrize("case", [
    lambda d: torch.floor_divide(_t(d, torch.int64), torch.tensor(2)),
    lambda d: torch.floor_divide(_t(d, torch.int64), torch.tensor(1, device=d)),
    lambda d: _t(d, torch.uint8) // torch.tensor(3),
    lambda d: torch.floor_divide(_t(d, torch.bool), torch.tensor(True)),
    lambda d: torch.floor_divide(_t(d, torch.int64), torch.tensor(0)),  # the CPU's error
], ids=["int64-cpu0d", "int64-device0d", "uint8", "bool", "by-zero"])
def test_integer_floor_divide_is_not_mistaken_for_a_refused_dtype(
        case: Callable[[str], object]) -> None:
    """The refused-dtype probe runs the CPU kernel on zeros: an integer division by zero is
    the probe's value, not the dtype's refusal."""
    same_as_cpu(case)


def test_a_refusal_learnt_for_one_python_scalar_type_is_not_anothers() -> None:
    """``bool // True`` is refused by the CPU kernel, ``bool // 1`` is not: the learnt
    refusal is keyed by the Python scalars' types too (once the decomposition is taken)."""
    same_as_cpu(lambda d: torch.floor_divide(_t(d), 2))  # the decomposition, taken once
    same_as_cpu(lambda d: torch.floor_divide(_t(d, torch.bool), True))
    same_as_cpu(lambda d: torch.floor_divide(_t(d, torch.bool), 1))
    same_as_cpu(lambda d: torch.floor_divide(_t(d, torch.bool), 2.5))


_AFTER_A_DIVISION_BY_ZERO = """
import torch, torchport.sim
x = torch.tensor(3, dtype=torch.int8)
for d in ("cpu", "sim"):  # the CPU kernel's ZeroDivisionError, on both
    try:
        x.to(d) // 0
        raise SystemExit("no error on " + d)
    except RuntimeError as e:
        assert "ZeroDivisionError" in str(e), e
for d in ("cpu", "sim"):  # then the same overload and dtypes with another divisor
    y = torch.tensor([True, False]).to(d)
    print(d, (x.to(d) // -2).item(), (y // -1).tolist())
for d in ("cpu", "sim"):  # a Scalar argument's value: inf overflows int8, 2.5 does not
    try:
        torch.nn.functional.threshold(x.to(d), True, float("inf"))
        raise SystemExit("no error on " + d)
    except RuntimeError as e:
        assert "overflow" in str(e), e
    print(d, torch.nn.functional.threshold(x.to(d), False, 2.5).item())
"""


def test_a_division_by_zero_teaches_no_refusal() -> None:
    """The refused-dtype probe runs the CPU kernel with the call's own Python numbers: a
    division by a Python 0 (an error of that value, not of the dtypes) must not be learnt
    for the overload's later calls with other numbers. A fresh process: the first call of
    the overload and dtypes is the one that teaches."""
    r = run_python(_AFTER_A_DIVISION_BY_ZERO, timeout=120, OMP_NUM_THREADS="1")
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.split()
    assert lines == ["cpu", "-2", "[-1,", "0]", "sim", "-2", "[-1,", "0]",
                     "cpu", "3", "sim", "3"], r.stdout


def _pair(d: str, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty(0, device=d, dtype=dtype), torch.empty(0, device=d, dtype=dtype)


def test_a_decomposed_overload_fails_as_its_kernel() -> None:
    """A decomposition is chosen on an overload's first call; a later call its kernel
    refuses gets the kernel's error, not the one the decomposition's pieces raise
    (``aminmax`` over an empty dim: IndexError on the CPU and CUDA)."""
    same_as_cpu(lambda d: torch.aminmax(_t(d), dim=0, out=_pair(d)))  # decomposed
    same_as_cpu(lambda d: torch.aminmax(_t(d)[:0], dim=0, out=_pair(d)))
    same_as_cpu(lambda d: torch.aminmax(_t(d)[:0], dim=1, out=_pair(d)))  # an empty result
    # a dtype it refuses (learnt on 1-element stand-ins), then that dtype and an empty dim:
    # the kernel checks the dim first
    c64 = torch.complex64
    same_as_cpu(lambda d: torch.aminmax(_t(d, c64), dim=0, out=_pair(d, c64)))
    same_as_cpu(lambda d: torch.aminmax(_t(d, c64)[:0], dim=0, out=_pair(d, c64)))


def test_refused_dtypes_leave_accepted_ones_decomposed() -> None:
    same_as_cpu(lambda d: torch.logaddexp(_t(d), _t(d, torch.int64)))
    same_as_cpu(lambda d: torch.logaddexp(_t(d, torch.float64), _t(d)))
    same_as_cpu(lambda d: torch.logaddexp(_t(d, torch.bool), _t(d)))


@pytest.mark.parametrize("index", [[-1], [0, -3], [-4], [3]])
def test_index_fill_counts_negative_indices_from_the_end(index: list[int]) -> None:
    same_as_cpu(lambda d: _t(d).index_fill_(1, torch.tensor(index, device=d), 5.0))
    same_as_cpu(lambda d: _t(d).index_fill(0, torch.tensor(index[:1], device=d) % 2 - 2,
                                           torch.tensor(-1.0, device=d)))


@pytest.mark.parametrize("dtype", [torch.int32, torch.uint8, torch.float16])
@pytest.mark.parametrize("threshold", [-0.5, 0.5, 1.7])
def test_threshold_compares_in_the_input_dtype(dtype: torch.dtype, threshold: float) -> None:
    """The kernels convert the threshold and value to the input's dtype first (-0.5 is 0
    for int32), the decomposition compares in the promoted type."""
    same_as_cpu(lambda d: F.threshold(_t(d, dtype), threshold, 2.5))
    same_as_cpu(lambda d: F.threshold(_t(d, dtype), threshold, 2.5, inplace=True))
    same_as_cpu(lambda d: torch.threshold(_t(d, dtype), threshold, 2.5,
                                          out=torch.empty(0, dtype=dtype, device=d)))


def test_no_decomposition_with_other_semantics_is_taken() -> None:
    from torchport.ops import paths

    for name in paths.NOT_EQUIVALENT:
        packet = getattr(torch.ops.aten, name.split("::")[1])
        for o in packet.overloads():
            op = getattr(packet, o)
            assert paths.decomposition_for(op, "sim", (), {}, lambda n: False) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("lambd", [0.5, 0.3])
def test_softshrink_rounds_as_the_kernel(dtype: torch.dtype, lambd: float) -> None:
    x = torch.randn(2000, generator=torch.Generator().manual_seed(0)).to(dtype)
    same_as_cpu(lambda d: F.softshrink(x.to(d), lambd))


@pytest.mark.parametrize("channels_last", [False, True])
def test_batch_norm_training_steps(channels_last: bool) -> None:
    # the async stage's launch trial met the backward's undefined outputs
    def train(d: str) -> tuple[torch.Tensor, ...]:
        torch.manual_seed(0)
        m = torch.nn.BatchNorm2d(3).to(d)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        x = torch.randn(4, 3, 5, 5).to(d)
        if channels_last:
            x = x.to(memory_format=torch.channels_last)
        for _ in range(3):
            opt.zero_grad()
            m(x).square().mean().backward()
            y = m(x)
            y.backward(gradient=torch.ones_like(y))
            opt.step()
        return (*[p.detach() for p in m.parameters()], m.running_mean, m.running_var)

    for want, got in zip(train("cpu"), train("sim"), strict=True):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", [
    lambda d: torch.tensor([1 + 2j, 3 - 1j], device=d).conj_physical_(),
    lambda d: torch.tensor([1 + 2j, 3 - 1j], device=d, dtype=torch.complex128)[::2].conj_physical_(),
    lambda d: torch.tensor([1.0, -2.0], device=d).conj_physical_(),
], ids=["complex64", "complex128-strided", "real"])
def test_conj_physical_in_place(case: Callable[[str], object]) -> None:
    # its only kernel is a composite calling the CPU/CUDA DispatchStub on the device tensor
    same_as_cpu(case)


def test_argument_checks_come_before_the_device_check() -> None:
    # CUDA's kernels check dtypes and shapes (meta functions, embedding's index dtype)
    # before TensorIterator compares devices
    w = torch.ones(4, 3, device="sim")
    with pytest.raises(RuntimeError, match="indices.*scalar types"):
        F.embedding(torch.rand(2, 3), w)
    with pytest.raises(RuntimeError, match="Sizes of tensors must match"):
        torch.cat([w, torch.ones(2, 2, device="sim")])
    # cat's CUDA registration compares its tensors' devices before the meta function
    with pytest.raises(RuntimeError, match="same device"):
        torch.cat([w, torch.ones(2, 2)])
    with pytest.raises(RuntimeError, match="same device"):
        F.embedding(torch.tensor([1, 2]), w)
    with pytest.raises(RuntimeError, match="same device"):
        w + torch.ones(4, 3)
