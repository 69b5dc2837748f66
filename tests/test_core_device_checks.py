"""CPU tensors next to device tensors: the sim raises where CUDA's kernels raise and takes
what they take (ATen's CUDA code is the spec; CPU PyTorch gives the values).

CUDA takes a CPU tensor as a 0-dim operand (TensorIterator's CPU scalars), as an index of
``x[idx]``/``index_put_`` (ATen's AdvancedIndex moves it), and requires one for foreach's
packed ``scalars``; every other CPU tensor argument raises a RuntimeError."""

import functools
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


# adaption.h's check_and_update_common_device: the first tensor's device is the common one
def _got(arg: str, op: str, on: str = "cpu", common: str = "sim:0") -> str:
    return (rf"Expected all tensors to be on the same device, but got {arg} is on {on}, "
            rf"different from other tensors on {common} \(when checking argument in method {op};")

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
    # CUDA's registrations of ops keeping native_functions.yaml's ``device_check: ExactSame``
    # compare every out= and positional tensor's device, a 0-dim CPU one too
    "index_select CPU 0-dim index": (
        lambda d: _x(d).index_select(0, torch.tensor(1)), _got("index", "index_select")),
    "clamp CPU 0-dim min": (
        lambda d: _x(d).clamp(min=torch.tensor(2.0)), _got("min", "clamp.Tensor")),
    "clamp_ CPU 0-dim max": (
        lambda d: _x(d).clamp_(max=torch.tensor(2.0)), _got("max", "clamp_.Tensor")),
    "take CPU 0-dim index": (
        lambda d: _x(d).take(torch.tensor(3)), _got("index", "take")),
    "mm out= CPU": (
        lambda d: torch.mm(_x(d), _x(d).T, out=torch.empty(5, 5)),
        _got("self", "mm.out", "sim:0", "cpu")),
    "take CPU 0-dim self, device index": (
        lambda d: torch.take(torch.tensor(1.0), torch.tensor([0], device=d)),
        _got("index", "take", "sim:0", "cpu")),
    # (a structured op the sim runs through its out= overload: CUDA names the functional)
    "logaddexp CPU 0-dim other": (
        lambda d: torch.logaddexp(_x(d), torch.tensor(1.0)), "same device, but got other"),
    "logaddexp CPU 0-dim self": (
        lambda d: torch.logaddexp(torch.tensor(1.0), _x(d)), "same device, but got"),
    # the devices before the kernel's dtype checks (the CPU refuses bool)
    "logaddexp bool, CPU 0-dim": (
        lambda d: torch.logaddexp(_x(d).bool(), torch.tensor(True)), "same device"),
    "nll_loss CPU target": (
        lambda d: torch.nn.functional.nll_loss(_x(d).log_softmax(1), torch.tensor([0, 1, 2, 3, 0])),
        _got("target", "nll_loss_forward")),
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
    # TensorIterator's CPU scalars in ops without the generated check (device_check: NoCheck)
    "mul_ CPU 0-dim": lambda d: _x(d).mul_(torch.tensor(0.5)),
    "where CPU 0-dim": lambda d: torch.where(_x(d) > 5, _x(d), torch.tensor(-1.0)),
    "lerp CPU 0-dim weight": lambda d: torch.lerp(_x(d), _x(d).flip(0), torch.tensor(0.25)),
    "addcmul CPU 0-dim tensor2": lambda d: torch.addcmul(_x(d), _x(d), torch.tensor(3.0)),
    "clamp Python number": lambda d: _x(d).clamp(min=2.0),
    "copy_ from CPU 0-dim": lambda d: _x(d).copy_(torch.tensor(4.0)),
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


@functools.cache
def _torchgen_checks() -> dict[str, tuple[str, ...]]:
    """Overload -> the tensor arguments CUDA's registration compares, as torchgen generates
    it (dest/register_dispatch_key.py: ``gen_device_check`` over out= and flat positional
    arguments, for functions keeping ``device_check: ExactSame`` with a CUDA kernel, a
    structured group's through its out= one): PyTorch's own parser of the yaml."""
    import torchgen
    from torchgen.gen import parse_native_yaml
    from torchgen.model import DeviceCheckType, DispatchKey

    where = Path(torchgen.__file__).parent / "packaged/ATen/native"
    parsed = parse_native_yaml(str(where / "native_functions.yaml"), str(where / "tags.yaml"))
    fs = {str(f.func.name): f for f in parsed.native_functions}
    keys = [parsed.backend_indices[k] for k in
            (DispatchKey.CUDA, DispatchKey.SparseCUDA, DispatchKey.SparseCsrCUDA)]
    checks = {}
    for name, f in fs.items():
        kernels = [f, fs[str(f.structured_delegate)]] if f.structured_delegate else [f]
        if f.device_check is DeviceCheckType.ExactSame and any(
                i.has_kernel(k) for i in keys for k in kernels):
            checks[name] = tuple(a.name for a in (*f.func.arguments.out,
                                                  *f.func.arguments.flat_positional)
                                 if a.type.is_tensor_like())
    return checks


def test_checked_arguments_are_torchgens() -> None:
    """The op layer's scan of native_functions.yaml finds, for every overload, the arguments
    torchgen's own parser says CUDA's generated registration compares."""
    from torchport.ops.plan import cuda_checked_args, plan_for

    want = _torchgen_checks()
    seen = 0
    for packet_name in dir(torch.ops.aten):
        packet = getattr(torch.ops.aten, packet_name)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            name = op._schema.name.removeprefix("aten::") + (
                "." + op._schema.overload_name if op._schema.overload_name else "")
            tensors = {a.name for a in op._schema.arguments if "Tensor" in str(a.type)}
            got = tuple(a for a in cuda_checked_args(plan_for(op)) if a in tensors)
            assert got == want.get(name, ()), name
            seen += bool(got)
    assert seen > 300


class _Expect(TorchDispatchMode):
    """Records the ops of a call whose CUDA registration compares a CPU tensor with a device
    one (the ops seen here; a composite's own calls run inside it, unseen)."""

    def __init__(self) -> None:
        super().__init__()
        self.raising: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        names = _torchgen_checks().get(_overload(func))
        if names:
            bound = {**dict(zip((a.name for a in func._schema.arguments), args, strict=False)),
                     **kwargs}
            types_ = {t.device.type for n in names for t in _flat(bound.get(n))}
            if len(types_) > 1:
                self.raising.append(_overload(func))
        return func(*args, **kwargs)


def _overload(op: torch._ops.OpOverload) -> str:
    s = op._schema
    return s.name.removeprefix("aten::") + ("." + s.overload_name if s.overload_name else "")


def _flat(v: object) -> list[torch.Tensor]:
    return [t for t in (v if isinstance(v, (list, tuple)) else (v,))
            if isinstance(t, torch.Tensor)]


_NAMED = re.compile(r"but got (\w+) is on \S+, different from other tensors on \S+ \(when "
                    r"checking argument in method ([\w.]+);")


def _zero_dim_cases() -> list[tuple[str, Callable[[str], object]]]:
    """(op, call on a device) of op_db's first float32 sample of each op with a tensor argument
    a 0-dim CPU tensor may stand for (the CPU computes with it), the others on the device."""
    from torchport.tools.conformance.catalog import load_op_db, opinfo_id

    cases = []
    for op in load_op_db():
        if torch.float32 not in op.supported_dtypes("cpu"):
            continue
        try:
            # (the generator itself: OpInfo.sample_inputs inspects the stack, slowly)
            s = next(iter(op.sample_inputs_func(op, "cpu", torch.float32, False)))
        except Exception:  # noqa: BLE001, S112 -- ops without a float32 sample here
            continue
        if not isinstance(s.input, torch.Tensor):
            continue
        slots = [i for i, v in enumerate(s.args) if isinstance(v, torch.Tensor) and v.numel()]
        slots += [k for k, v in s.kwargs.items() if isinstance(v, torch.Tensor) and v.numel()]
        for slot in slots:
            def call(d: str, op=op, s=s, slot=slot) -> object:  # noqa: ANN001
                args = [a.to(d) if isinstance(a, torch.Tensor) else a for a in s.args]
                kwargs = {k: v.to(d) if isinstance(v, torch.Tensor) else v
                          for k, v in s.kwargs.items()}
                where = args if isinstance(slot, int) else kwargs
                where[slot] = (s.args[slot] if isinstance(slot, int)
                               else s.kwargs[slot]).flatten()[0].clone()
                return op(s.input.to(d), *args, **kwargs)
            try:
                call("cpu")
            except Exception:  # noqa: BLE001, S112 -- no 0-dim tensor there
                continue
            cases.append((opinfo_id(op), call))
            break
    return cases


@pytest.mark.filterwarnings("ignore")
def test_zero_dim_cpu_tensors_in_op_db_follow_cudas_registrations() -> None:
    """Each op_db op given a 0-dim CPU tensor next to device tensors raises CUDA's error
    exactly where CUDA's generated registration compares it with a device tensor (torchgen's
    own reading of the yaml), naming such an overload and argument; else computes the CPU's
    values (or fails as before, with an error of the op's own)."""
    checks = _torchgen_checks()
    problems, raised, computed = [], 0, 0
    for name, call in _zero_dim_cases():
        want = call("cpu")
        mode = _Expect()
        try:
            with mode:
                got = call("sim")
        except Exception as e:  # noqa: BLE001 -- compared with the rule below
            named = _NAMED.search(str(e))
            if named and named[1] not in checks.get(named[2], ()):
                problems.append(f"{name}: {named[2]} does not check {named[1]} on CUDA: {e}")
            elif mode.raising and not (isinstance(e, RuntimeError) and "same device" in str(e)):
                problems.append(f"{name}: CUDA raises in {mode.raising[0]}, not {e!r}")
            raised += bool(named)
            continue
        if mode.raising:
            problems.append(f"{name}: CUDA raises in {mode.raising[0]}; the sim computed")
            continue
        computed += 1
        for w, g in zip(_flat(want), _flat(got), strict=True):
            if not torch.equal(g.cpu(), w) and not (w.is_floating_point() and torch.allclose(
                    g.cpu(), w, rtol=0, atol=0, equal_nan=True)):
                problems.append(f"{name}: values differ from the CPU's")
    assert not problems, "\n".join(problems)
    assert raised > 10 and computed > 50, (raised, computed)
