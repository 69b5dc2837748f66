"""Host-op kernels in C++ (native_hostops.cpp): the common calls of functional, in-place and
``out=`` ops served without a Python entry, equal to the CPU bit for bit; everything else
handed to the Python kernels with their results and errors; switched like the view and
empty kernels. The C++-only tests skip where the library does not compute (strict sim,
TORCHPORT_NATIVE=0; on the asynchronous sim it queues: tests/test_async.py)."""

from __future__ import annotations

import copy
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F

import torchport.sim  # noqa: F401
from tests.helpers import (
    CPP_HOST_OPS_IDLE,
    check_python,
    child_env,
    cpp_host_ops_compute,
    privateuse1_registrations,
    python_host_kernels,
    torchport_frames,
)
from torchport.backend import active_backend
from torchport.ops import native_hostops, stats

pytestmark = pytest.mark.modes

_B = active_backend()
_K = _B.host_op_kernels
_COMPUTES = cpp_host_ops_compute()
needs_cpp = pytest.mark.skipif(not _COMPUTES, reason=CPP_HOST_OPS_IDLE)


class calls:
    """Counts the calls served in C++ and handed to Python within."""

    def __enter__(self) -> calls:
        self._start = native_hostops.counts()
        return self

    def __exit__(self, *exc: object) -> None:
        end = native_hostops.counts()
        self.served, self.handed, self.moved = (e - s for e, s in zip(end, self._start,
                                                                       strict=True))


def _same(dev: object, cpu: object) -> None:
    if isinstance(cpu, (tuple, list)):
        assert len(dev) == len(cpu)
        for d, c in zip(dev, cpu, strict=True):
            _same(d, c)
        return
    if isinstance(cpu, torch.Tensor):
        assert dev.device.type == "sim", dev.device
        assert (dev.shape, dev.stride(), dev.dtype) == (cpu.shape, cpu.stride(), cpu.dtype)
        assert torch.equal(dev.cpu(), cpu) or (cpu.is_floating_point() and torch.equal(
            dev.cpu().isnan(), cpu.isnan()) and torch.equal(dev.cpu().nan_to_num(), cpu.nan_to_num()))
        return
    assert dev == cpu


def _inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(6, 8, generator=g), "y": torch.randn(6, 8, generator=g),
        "w": torch.randn(5, 8, generator=g), "b": torch.randn(5, generator=g),
        "i": torch.tensor([4, 0, 2, 2]), "m": torch.randn(6, 8, generator=g) > 0,
        "img": torch.randn(2, 3, 6, 6, generator=g), "k": torch.randn(4, 3, 3, 3, generator=g),
        "t": torch.randn(8, 6, generator=g).t(),  # transposed: strides (1, 6)
    }


# (name, fn(inputs) -> result): functional ops of a model's step, on every argument type
# the C++ kernel takes: tensors, numbers, 0-dim CPU tensors, int lists, dtypes, memory
# formats, strings, optional tensors; one, several and boolean results.
_FUNCTIONAL = [
    ("add", lambda v: v["x"] + v["y"]),
    ("add alpha", lambda v: torch.add(v["x"], v["y"], alpha=2.5)),
    ("mul number", lambda v: v["x"] * 0.5),
    ("mul 0-dim cpu", lambda v: v["x"] * torch.tensor(3.0)),
    ("transposed", lambda v: v["t"] * v["x"]),
    ("sum dims", lambda v: v["x"].sum(dim=[0])),
    ("sum dtype", lambda v: v["x"].sum(dtype=torch.float64)),
    ("mean keepdim", lambda v: v["x"].mean(1, keepdim=True)),
    ("linear", lambda v: F.linear(v["x"], v["w"], v["b"])),
    ("mm", lambda v: v["x"] @ v["w"].t()),
    ("relu", lambda v: torch.relu(v["x"])),
    ("softmax", lambda v: torch.softmax(v["x"], -1)),
    ("layer norm", lambda v: torch.ops.aten.native_layer_norm(v["x"], [8], None, None, 1e-5)),
    ("max dim", lambda v: v["x"].max(dim=1)),
    ("sort", lambda v: v["x"].sort(dim=0, descending=True)),
    ("clone channels_last", lambda v: v["img"].clone(memory_format=torch.channels_last)),
    ("where", lambda v: torch.where(v["m"], v["x"], v["y"])),
    ("masked_fill", lambda v: v["x"].masked_fill(v["m"], -1.0)),
    ("index_select", lambda v: v["x"].index_select(0, v["i"])),
    ("div floor", lambda v: torch.div(v["x"], v["y"], rounding_mode="floor")),
    ("eq", lambda v: v["x"] == v["y"]),
    ("argmax", lambda v: v["t"].argmax(0)),
    ("cumsum", lambda v: v["x"].cumsum(1)),
    ("conv2d", lambda v: F.conv2d(v["img"], v["k"], padding=1)),
    ("gelu tanh", lambda v: F.gelu(v["x"], approximate="tanh")),
    ("clamp min", lambda v: torch.clamp(v["x"], min=-0.5)),
    # tensor lists
    ("cat", lambda v: torch.cat([v["x"], v["y"], v["t"]], dim=0)),
    ("stack", lambda v: torch.stack([v["x"], v["y"]], dim=1)),
    ("index", lambda v: v["x"][v["i"], 1:]),
    ("index mask", lambda v: v["x"][v["m"]]),
    ("foreach add", lambda v: torch._foreach_add([v["x"], v["y"]], [v["y"], v["x"]], alpha=2)),
    ("foreach mul scalars", lambda v: torch._foreach_mul([v["x"], v["y"]], [0.5, 2.0])),
]


@pytest.mark.parametrize("name,fn", _FUNCTIONAL, ids=[n for n, _ in _FUNCTIONAL])
def test_functional_calls_equal_the_cpu(name, fn) -> None:
    cpu = _inputs()
    dev = {k: v.to("sim") if k != "t" else v.t().to("sim").t() for k, v in cpu.items()}
    assert dev["t"].stride() == cpu["t"].stride()
    with calls() as c:
        got = fn(dev)
    _same(got, fn(cpu))
    if _COMPUTES and name in _CPU_0DIM_HANDED:
        assert c.handed >= 1, (c.served, c.handed)
    elif _COMPUTES:
        assert c.served >= 1 and c.handed == 0, (c.served, c.handed)


# A 0-dim CPU tensor (not a Python number) is served in C++ where CUDA's registration of
# the op does not compare devices (`mul` takes it, as TensorIterator does); the ops whose
# registration does go to the Python kernel, whose device check raises
# (tests/test_native_fallback.py).
_CPU_0DIM_HANDED: set[str] = set()


_LARGE = [  # inputs of 1.2 MiB and more: their results are computed in device blocks too
    ("sum with a dtype", lambda v: v.sum(dtype=torch.float64)),
    ("clone to channels_last", lambda v: v.view(2, 3, 250, 200)
     .clone(memory_format=torch.channels_last)),
    ("div with a rounding mode", lambda v: torch.div(v, 0.3, rounding_mode="trunc")),
    ("softmax", lambda v: torch.softmax(v.view(300, 1000), 1)),
]


@pytest.mark.parametrize("name,fn", _LARGE, ids=[n for n, _ in _LARGE])
def test_large_inputs_are_served(name, fn) -> None:
    v = torch.randn(300000, generator=torch.Generator().manual_seed(0))
    dv = v.to("sim")
    with calls() as c:
        got = fn(dv)
    _same(got, fn(v))
    if _COMPUTES:
        assert c.served >= 1 and c.handed == 0 and c.moved == 0, (c.served, c.handed, c.moved)


def test_a_large_weight_with_a_small_batch_is_served() -> None:
    x, w, b = torch.randn(4, 1024), torch.randn(512, 1024), torch.randn(512)  # w: 2 MiB
    dx, dw, db = x.to("sim"), w.to("sim"), b.to("sim")
    with calls() as c:
        got = F.linear(dx, dw, db)
        grad_in = got @ dw
    _same(got, F.linear(x, w, b))
    _same(grad_in, F.linear(x, w, b) @ w)
    if _COMPUTES:
        assert c.served == 2 and c.handed == 0


def test_a_training_step_equals_the_cpu_bit_for_bit() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.GELU(),
                                torch.nn.Linear(16, 3))
    data, target = torch.randn(4, 8), torch.tensor([0, 2, 1, 1])
    results = []
    for device in ("cpu", "sim"):
        m = copy.deepcopy(model).to(device)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, foreach=False)
        losses = []
        for _ in range(3):
            opt.zero_grad()
            loss = F.cross_entropy(m(data.to(device)), target.to(device))
            loss.backward()
            opt.step()
            losses.append(loss.item())
        results.append((losses, [p.detach().cpu() for p in m.parameters()]))
    assert results[0][0] == results[1][0]
    for a, b in zip(results[0][1], results[1][1], strict=True):
        assert torch.equal(a, b)


def test_in_place_and_out_calls() -> None:
    cpu = _inputs()
    x, y = cpu["x"].clone(), cpu["y"]
    dx, dy = x.to("sim"), y.to("sim")
    with calls() as c:
        dx.add_(dy, alpha=-1.5)
        dx.mul_(2)
        dx.clamp_(max=0.25)
        out = torch.empty(6, 8, device="sim")
        r = torch.mul(dx, dy, out=out)
        same = torch.add(dx, dx, out=dx)  # an argument passed twice is one CPU tensor
    x.add_(y, alpha=-1.5).mul_(2).clamp_(max=0.25)
    expect = torch.mul(x, y)
    x2 = torch.add(x, x)
    assert r is out and same is dx
    _same(out, expect)
    _same(dx, x2)
    if _COMPUTES:
        assert c.handed == 0 and c.served >= 5


def test_lists_in_place_and_optimizers() -> None:
    cpu = _inputs()
    xs, ys = [cpu["x"].clone(), cpu["w"].clone()], [cpu["y"], cpu["w"] * 2]
    dxs, dys = [t.to("sim") for t in xs], [t.to("sim") for t in ys]
    idx, vals = cpu["i"], torch.ones(4, 8)
    didx, dvals = idx.to("sim"), vals.to("sim")
    with calls() as c:
        torch._foreach_add_(dxs, dys, alpha=0.5)
        torch._foreach_mul_(dxs, 3.0)
        dxs[0].index_put_((didx,), dvals, accumulate=True)
    torch._foreach_add_(xs, ys, alpha=0.5)
    torch._foreach_mul_(xs, 3.0)
    xs[0].index_put_((idx,), vals, accumulate=True)
    for d, x in zip(dxs, xs, strict=True):
        _same(d, x)
    if _COMPUTES:
        assert c.handed == 0 and c.served == 3
    for kind in ({"foreach": True}, {"fused": True}):
        params = []
        for device in ("cpu", "sim"):
            torch.manual_seed(1)
            p = [torch.randn(6, 8, device=device, requires_grad=True) for _ in range(3)]
            opt = torch.optim.AdamW(p, lr=0.01, **kind)
            for _ in range(3):
                opt.zero_grad()
                sum((q * q).sum() for q in p).backward()
                opt.step()
            params.append([q.detach().cpu() for q in p])
        for a, b in zip(*params, strict=True):
            assert torch.equal(a, b), kind


def test_out_of_another_shape() -> None:
    x, w = _inputs()["x"], _inputs()["w"]
    dx, dw = x.to("sim"), w.to("sim")
    # growing: the CPU kernel grows the device tensor's storage (into a device block)
    with calls() as grow:
        out = torch.empty(0, device="sim")
        torch.mm(dx, dw.t(), out=out)
    _same(out, x @ w.t())
    # shrinking, with PyTorch's warning: the device tensor takes the CPU kernel's layout
    cpu_out = torch.empty(10, 10)
    dev_out = torch.empty(10, 10, device="sim")
    with warnings.catch_warnings(record=True) as cw:
        warnings.simplefilter("always")
        torch.mm(x, w.t(), out=cpu_out)
    with warnings.catch_warnings(record=True) as dw_:
        warnings.simplefilter("always")
        torch.mm(dx, dw.t(), out=dev_out)
    _same(dev_out, cpu_out)
    assert [str(w.message) for w in dw_] == [str(w.message) for w in cw]
    if _COMPUTES:
        assert (grow.served, grow.handed, grow.moved) == (1, 0, 0)


_GROWN = [  # a non-empty out= the CPU kernel must grow (PyTorch resizes it, with a warning)
    ("add", lambda a, out: torch.add(a, 1, out=out)),
    ("arange", lambda a, out: torch.arange(float(a.numel()), out=out)),
    ("cat", lambda a, out: torch.cat([a, a], out=out)),
    ("sum", lambda a, out: torch.sum(a.view(-1, 10), 1, out=out)),
    ("mm", lambda a, out: torch.mm(a[:40000].view(200, 200), a[:40000].view(200, 200), out=out)),
]


@pytest.mark.parametrize("kernels", ["as served", "python"])
@pytest.mark.parametrize("name,fn", _GROWN, ids=[n for n, _ in _GROWN])
def test_a_grown_out_never_writes_past_its_storage(name, fn, kernels) -> None:
    # the CPU kernel sees the out='s memory as its storage, not the device memory after it
    a = torch.randn(100_000)
    out = torch.ones(3, device="sim")
    after = [torch.randn(1000, device="sim") for _ in range(8)]  # blocks near the out's
    kept = [t.cpu() for t in after]
    with warnings.catch_warnings(record=True) as dev_warnings:
        warnings.simplefilter("always")
        if kernels == "python":
            with python_host_kernels():
                r = fn(a.to("sim"), out)
        else:
            r = fn(a.to("sim"), out)
    with warnings.catch_warnings(record=True) as cpu_warnings:
        warnings.simplefilter("always")
        expect = fn(a, torch.ones(3))
    assert r is out
    _same(out, expect)
    assert all(torch.equal(t.cpu(), k) for t, k in zip(after, kept, strict=True))
    assert [str(w.message) for w in dev_warnings] == [str(w.message) for w in cpu_warnings]


@pytest.mark.parametrize("strict", ["0", "1"])
def test_without_the_library_a_grown_out_warns_as_the_cpu_does(strict: str) -> None:
    # no C++ library: the out= the CPU kernel cannot grow in place is run again on copies;
    # the user sees each of PyTorch's warnings once, as on the CPU
    out = check_python("""
        import warnings, torch, torchport.sim
        def said(fn, device):
            out = torch.ones(3, device=device)
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                r = fn(torch.arange(1000.).to(device), out)
            assert r is out and r.shape != (3,)
            return [str(w.message) for w in seen]
        for fn in [lambda a, out: torch.add(a, a, out=out),
                   lambda a, out: torch.cat([a, a], out=out),
                   lambda a, out: torch.sum(a.view(-1, 10), 1, out=out),
                   lambda a, out: torch.mm(a[:900].view(30, 30), a[:900].view(30, 30), out=out),
                   lambda a, out: torch.arange(float(a.numel()), out=out)]:
            dev, cpu = said(fn, "sim"), said(fn, "cpu")
            print(len(dev), len(cpu), dev == cpu)
    """, env=child_env(TORCHPORT_NATIVE="0", TORCHPORT_SIM_STRICT=strict))
    assert out.split() == ["1", "1", "True"] * 5, out


@needs_cpp
@pytest.mark.parametrize("name,fn", [
    ("mm", lambda a, out: torch.mm(a, a.t(), out=out)),
    ("add", lambda a, out: torch.add(a, 1, out=out)),
    ("cat", lambda a, out: torch.cat([a, a], out=out)),
    ("arange", lambda a, out: torch.arange(5.0, 500.0, out=out)),
], ids=["mm", "add", "cat", "arange"])
def test_an_out_the_cpu_kernel_grows_takes_a_device_block(name, fn) -> None:
    # as on CUDA: the storage grows in place (every tensor on it sees the new memory), the
    # old block returns, and nothing is copied or handed to Python
    a = torch.randn(40, 30)
    da = a.to("sim")
    out = torch.ones(3, device="sim")
    sharing = torch.empty(0, device="sim").set_(out.untyped_storage())
    storage = out.untyped_storage()
    before = torch.sim.memory_allocated()
    with calls() as c:
        r = fn(da, out)
    expect = fn(a, torch.ones(3))
    assert (c.served, c.handed, c.moved) == (1, 0, 0)
    assert r is out
    _same(out, expect)
    assert out.untyped_storage()._cdata == storage._cdata
    assert sharing.data_ptr() == out.data_ptr() and sharing.shape == (3,)
    assert sharing.untyped_storage().nbytes() >= expect.numel() * 4
    block = _B.allocators[0].active[out.data_ptr()]
    assert torch.sim.memory_allocated() - before == block.size - 512  # the old block returned
    del r, out, sharing, storage
    assert torch.sim.memory_allocated() == before - 512


_FACTORIES = [  # PyTorch's composite kernels, on the device they name or their input is on
    ("full", lambda d: torch.full((3, 4), 2.5, device=d)),
    ("arange", lambda d: torch.arange(2, 40, 3, device=d)),
    ("zeros_like", lambda d: torch.zeros_like(torch.ones(2, 3, device=d))),
    ("new_ones int", lambda d: torch.ones(2, device=d).new_ones((4,), dtype=torch.int32)),
    ("full_like channels_last", lambda d: torch.full_like(
        torch.ones(2, 3, 4, 4, device=d), 7.0, memory_format=torch.channels_last)),
    ("scalar_tensor", lambda d: torch.scalar_tensor(3.0, device=d)),
]


@needs_cpp
@pytest.mark.parametrize("name,fn", _FACTORIES, ids=[n for n, _ in _FACTORIES])
def test_composite_factories_run_in_cpp(name, fn) -> None:
    fn("sim:1")  # (a new segment of the pool comes from the Python runtime)
    with calls() as c, torchport_frames() as frames:
        r = fn("sim:1")
    assert c.handed == 0 and c.served >= 1
    assert frames == [], frames  # no Python of torchport's on the way
    assert r.device == torch.device("sim:1")
    _same(r, fn("cpu"))


def _attention(x: torch.Tensor) -> torch.Tensor:
    qkv = x.view(1, 2, 4, 6).cos()
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qkv, qkv, qkv,
                                                                      dropout_p=0.0)[0]


_RANDOM = [  # random ops taking a generator, and the composites drawing through them
    ("normal_", lambda d, g: torch.empty(5, 3, device=d).normal_(2.0, 3.0, generator=g)),
    ("uniform_ transposed", lambda d, g: torch.empty(4, 6, device=d).t().uniform_(-1, 2,
                                                                              generator=g)),
    ("bernoulli_", lambda d, g: torch.empty(9, device=d).bernoulli_(0.3, generator=g)),
    ("exponential_", lambda d, g: torch.empty(7, device=d).exponential_(generator=g)),
    ("random_", lambda d, g: torch.empty(8, dtype=torch.int64, device=d).random_(0, 10,
                                                                             generator=g)),
    ("normal tensors", lambda d, g: torch.normal(torch.arange(6.0, device=d),
                                                 torch.ones(6, device=d), generator=g)),
    ("bernoulli tensor", lambda d, g: torch.bernoulli(torch.full((10,), 0.4, device=d),
                                                      generator=g)),
    ("multinomial", lambda d, g: torch.multinomial(torch.tensor([0.1, 0.5, 0.4], device=d), 5,
                                                   replacement=True, generator=g)),
    ("randn", lambda d, g: torch.randn(3, 4, device=d, generator=g)),
    ("rand", lambda d, g: torch.rand(6, device=d, generator=g)),
    ("randint", lambda d, g: torch.randint(3, 9, (2, 5), device=d, generator=g)),
    # taking no generator: the device's default one, through the CPU's
    ("rand_like", lambda d, g: torch.rand_like(torch.empty(4, 2, device=d).t())),
    ("native_dropout", lambda d, g: torch.native_dropout(
        torch.arange(24.0, device=d).view(4, 6).t(), 0.4, True)),
    ("attention (a random op)", lambda d, g: _attention(torch.arange(48.0, device=d))),
]
_TAKE_NO_GENERATOR = ("rand_like", "native_dropout", "attention (a random op)")


@needs_cpp
@pytest.mark.parametrize("name,fn", _RANDOM, ids=[n for n, _ in _RANDOM])
def test_random_ops_draw_in_cpp_from_the_device_generator(name, fn) -> None:
    # the CPU's numbers for the seed, drawn from the generator CUDA would draw from (the
    # tensors' device's default one, or the one given, of any index), without Python
    fn("sim:1", None)  # (a new segment of the pool comes from the Python runtime)
    torch.manual_seed(7)
    want = fn("cpu", None)
    torch.manual_seed(7)
    before = torch.sim.get_rng_state(0)
    with calls() as c, torchport_frames() as frames:
        got = fn("sim:1", None)
    assert c.handed == 0 and c.served >= 1 and frames == [], (c.served, c.handed, frames)
    _same(got, want)
    assert torch.equal(torch.sim.get_rng_state(0), before)  # another device's untouched
    if name in _TAKE_NO_GENERATOR:
        return
    given = torch.Generator(device="sim:0").manual_seed(11)
    state = torch.sim.get_rng_state(1)
    with calls() as c:
        got = fn("sim:1", given)
    assert c.handed == 0, c.handed
    _same(got, fn("cpu", torch.Generator().manual_seed(11)))
    assert torch.equal(torch.sim.get_rng_state(1), state)  # the default one did not draw
    # a generator of another type: the Python kernel's error, CUDA's
    assert _outcome(lambda: fn("sim:1", torch.Generator())) == \
        _python_outcome(lambda: fn("sim:1", torch.Generator()))


def _python_outcome(fn) -> tuple:
    with python_host_kernels():
        return _outcome(fn)


@needs_cpp
def test_a_pinned_factory_call_is_handed_to_python() -> None:
    with calls() as c:
        native = _outcome(lambda: torch.full((3,), 1.0, device="sim", pin_memory=True))
    with python_host_kernels():
        python = _outcome(lambda: torch.full((3,), 1.0, device="sim", pin_memory=True))
    assert native[0] == python[0] == "ok" and torch.equal(native[1], python[1])
    assert c.handed == 1


@needs_cpp
def test_resize_runs_in_cpp_as_on_the_cpu() -> None:
    x = torch.arange(12.0).reshape(3, 4)
    dx = x.to("sim")
    view = dx[0]
    with calls() as c:
        dx.resize_(5, 4)  # grows: the first 12 values kept, every view on the storage moves
        dx.resize_(2, 3, 4, 4, memory_format=torch.channels_last)
        dx.resize_(2, 2)  # shrinks: the storage stays
    x.resize_(5, 4)
    x.resize_(2, 3, 4, 4, memory_format=torch.channels_last)
    x.resize_(2, 2)
    assert (c.served, c.handed) == (3, 0)
    assert (dx.shape, dx.stride()) == (x.shape, x.stride())
    assert torch.equal(dx.cpu(), x)
    assert view.data_ptr() == dx.data_ptr() and torch.equal(view.cpu(), torch.arange(4.0))
    assert dx.untyped_storage().nbytes() == x.untyped_storage().nbytes()
    # PyTorch's deterministic mode fills the new memory (NaN), as on the CPU and CUDA
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        y, dy = torch.ones(2), torch.ones(2, device="sim")
        y.resize_(6)
        dy.resize_(6)
    finally:
        torch.use_deterministic_algorithms(was)
    _same(dy, y)


@needs_cpp
def test_out_of_memory_growing_an_out_leaves_it_intact() -> None:
    out = torch.full((4,), 7.0, device="sim:1")
    torch.sim.set_per_process_memory_fraction(0.001, 1)
    try:
        with pytest.raises(torch.OutOfMemoryError, match="sim:1|device 1"):
            torch.arange(float(1 << 24), out=out)  # 64 MiB
        with pytest.raises(torch.OutOfMemoryError, match="sim:1|device 1"):
            out.resize_(1 << 24)
    finally:
        torch.sim.set_per_process_memory_fraction(1.0, 1)
    assert out.shape == (4,) and torch.equal(out.cpu(), torch.full((4,), 7.0))
    torch.arange(10.0, out=out)
    assert torch.equal(out.cpu(), torch.arange(10.0))


def test_overlap_errors_are_the_cpus() -> None:
    a = torch.arange(10.0)
    d = a.to("sim")
    outcomes = []
    for t in (a, d):
        try:
            torch.add(t[1:], t[:-1], out=t[:-1])
            outcomes.append(None)
        except RuntimeError as e:
            outcomes.append(str(e))
    assert outcomes[0] is not None and outcomes[0] == outcomes[1]
    assert torch.equal(d.cpu(), a)  # inputs intact, as on the CPU


def _outcome(fn) -> tuple:
    try:
        r = fn()
        return ("ok", r.cpu() if isinstance(r, torch.Tensor) else r)
    except Exception as e:  # noqa: BLE001 (the exception is the result compared)
        return (type(e), str(e))


_HANDED = [
    ("two devices", lambda: torch.ones(3, device="sim:0") + torch.ones(3, device="sim:1")),
    ("two devices in a list", lambda: torch.cat([torch.ones(3, device="sim:0"),
                                                 torch.ones(3, device="sim:1")])),
    ("cpu indices", lambda: torch.arange(6.0, device="sim")[torch.tensor([5, 1])]),
    ("a cpu tensor", lambda: torch.ones(3, device="sim") + torch.ones(3)),
    ("a conjugate view", lambda: torch.ones(3, dtype=torch.complex64, device="sim").conj()
     * torch.full((3,), 1j, device="sim")),
    # arguments the Python kernel receives as PyTorch's own Python kernels do
    ("a negative view with a dtype",
     lambda: torch._neg_view(torch.ones(30, device="sim")).sum(dtype=torch.float64)),
    ("a negative view with a memory format",
     lambda: torch._neg_view(torch.ones(2, 3, 4, 4, device="sim"))
     .clone(memory_format=torch.channels_last).stride()),
    ("a negative view with a string",
     lambda: torch.div(torch._neg_view(torch.full((30,), 7.0, device="sim")), 2.0,
                       rounding_mode="trunc")[:3]),
]


@pytest.mark.parametrize("name,fn", _HANDED, ids=[n for n, _ in _HANDED])
def test_calls_handed_to_python_are_the_python_kernels(name, fn) -> None:
    with calls() as c:
        native = _outcome(fn)
    with python_host_kernels():
        python = _outcome(fn)
    assert type(native[1]) is type(python[1])
    if isinstance(python[1], torch.Tensor):
        assert torch.equal(native[1], python[1])
    else:
        assert native == python
    if _COMPUTES:
        assert c.handed >= 1


def test_errors_are_the_cpu_kernels() -> None:
    x = torch.randn(4, 3)
    bad = torch.tensor([0, 9])
    cpu = _outcome(lambda: x.index_select(0, bad))
    if not _B.runtime.asynchronous:  # (there: raised at the next synchronization, as on CUDA)
        dev = _outcome(lambda: x.to("sim").index_select(0, bad.to("sim")))
        assert cpu[0] is IndexError and dev == cpu
    cpu = _outcome(lambda: torch.mm(x, x))
    dev = _outcome(lambda: torch.mm(x.to("sim"), x.to("sim")))
    assert cpu[0] is RuntimeError and dev == cpu


@needs_cpp
@pytest.mark.parametrize("rows", [4, 256, 2048])  # results of 8 KiB, 512 KiB, 4 MiB
def test_new_results_are_computed_in_device_blocks(rows) -> None:
    # the CPU kernel's result is a block of the device's pool: no host copy to move, and
    # none adopted (an outer product: a large result from small inputs)
    a, b = torch.randn(rows, 1), torch.randn(1, 512)
    da, db = a.to("sim"), b.to("sim")
    before = torch.sim.memory_allocated()
    with calls() as c:
        r = da @ db
    assert (c.served, c.handed, c.moved) == (1, 0, 0)
    assert torch.equal(r.cpu(), a @ b)
    block = _B.allocators[0].active[r.data_ptr()]
    assert not block.adopted and block.size >= r.numel() * 4
    assert torch.sim.memory_allocated() - before == block.size
    r.add_(1)  # an ordinary device tensor: written in place, resized, freed to the pool
    assert torch.equal(r.cpu(), a @ b + 1)
    r.untyped_storage().resize_(r.untyped_storage().nbytes() * 2)
    del r
    assert torch.sim.memory_allocated() == before


@pytest.mark.parametrize("fn", [
    lambda x: torch.div(x, 2.0, rounding_mode="trunc"), lambda x: x * 2, lambda x: x.sum(0)],
    ids=["div", "mul", "sum"])
def test_an_argument_only_the_call_holds_is_intact_until_the_cpu_kernel_is_done(fn) -> None:
    # a negative view is resolved into a temporary that only the dispatcher's stack holds
    # when the op runs on it; the CPU kernel's own allocations must not reuse its memory
    base = torch.arange(-60.0, 60.0).view(4, 30)
    for _ in range(3):
        got = fn(torch._neg_view(base.to("sim")))
        assert torch.equal(got.cpu(), fn(torch._neg_view(base)))


@needs_cpp
def test_results_for_the_host_are_host_memory() -> None:
    x = torch.randn(300, 300, device="sim")
    before = torch.sim.memory_allocated()
    on_host = [x.cpu(), x.to("cpu", torch.float64), x.tolist()[0][0], x.numpy(force=True)]
    assert torch.sim.memory_allocated() == before
    expected = x.cpu().clone()
    del x
    torch.sim.empty_cache()
    assert torch.equal(on_host[0], expected)
    assert torch.equal(on_host[1], expected.double())
    assert on_host[2] == expected[0, 0].item()
    assert torch.equal(torch.from_numpy(on_host[3]), expected)


@needs_cpp
def test_cpu_kernels_with_their_own_workspaces_return_every_block() -> None:
    # oneDNN's convolutions take their scratch memory through the CPU allocator's raw
    # interface: device blocks while a host op runs, returned by the raw deleter
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(16, 32, 3, padding=1)
    x = torch.randn(8, 16, 28, 28, requires_grad=True)
    dconv = copy.deepcopy(conv).to("sim")
    dx = x.detach().to("sim").requires_grad_()
    before = torch.sim.memory_allocated()
    out, dout = conv(x), dconv(dx)
    out.square().sum().backward()
    dout.square().sum().backward()
    assert torch.allclose(dout.cpu(), out, rtol=1e-5, atol=1e-5)
    assert torch.allclose(dx.grad.cpu(), x.grad, rtol=1e-4, atol=1e-4)
    assert torch.allclose(dconv.weight.grad.cpu(), conv.weight.grad, rtol=1e-4, atol=1e-3)
    grads = dx.grad.numel() * 4 + sum(p.grad.numel() * 4 for p in dconv.parameters())
    del out, dout
    dx.grad = None
    dconv.zero_grad(set_to_none=True)
    assert torch.sim.memory_allocated() == before, grads


@needs_cpp
def test_out_of_memory_inside_the_cpu_kernel_leaves_the_process_usable() -> None:
    a, b = torch.randn(4096, 1, device="sim:1"), torch.randn(1, 4096, device="sim:1")
    torch.sim.set_per_process_memory_fraction(0.001, 1)
    try:
        with pytest.raises(torch.OutOfMemoryError, match="sim:1|device 1"):
            a @ b  # 64 MiB
    finally:
        torch.sim.set_per_process_memory_fraction(1.0, 1)
    assert torch.equal((a @ b).cpu(), a.cpu() @ b.cpu())


@needs_cpp
def test_new_results_are_allocated_on_the_current_stream() -> None:
    x = torch.randn(16, device="sim:1")
    s = torch.sim.Stream(device="sim:1")
    with torch.sim.stream(s):
        r = x * 2
    d = x * 3
    streams = [_B.allocators[1].active[t.data_ptr()].stream for t in (r, d)]
    assert streams[0] != streams[1]
    assert r.device == torch.device("sim:1")
    del r, d


def test_a_recorder_sees_every_op_and_the_kernels_switch_back() -> None:
    was = _K.native
    x = torch.randn(4, device="sim")
    with stats.record() as rec:
        assert not _K.native
        (x + 1).relu_()
    assert rec.ops["add.Tensor"].calls == 1 and rec.ops["relu_"].calls == 1
    assert _K.native == was
    with calls() as c:
        x + 1
        x + 1  # (queuing C++ kernels learn a layout from the Python kernel's first call)
    if was:
        assert c.served >= 1


@needs_cpp
def test_the_cpp_kernels_are_registered_alone() -> None:
    for name in ("aten::add.Tensor", "aten::mm.out", "aten::relu_"):
        lines = privateuse1_registrations(name)
        assert len(lines) == 1 and "native_hostops.cpp" in lines[0], lines
    with python_host_kernels():
        lines = privateuse1_registrations("aten::add.Tensor")
        assert len(lines) == 1 and "native_hostops.cpp" not in lines[0], lines


def test_threads_compute_what_one_thread_does() -> None:
    xs = [torch.randn(32, 32) for _ in range(4)]
    expect = [torch.tanh(x @ x.t() + 1).sum(0) for x in xs]
    got: list[torch.Tensor | None] = [None] * 4

    def work(i: int) -> None:
        d = xs[i].to("sim")
        for _ in range(50):
            r = torch.tanh(d @ d.t() + 1).sum(0)
        got[i] = r.cpu()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for g, e in zip(got, expect, strict=True):
        assert torch.equal(g, e)


def test_without_the_library_the_python_kernels_serve() -> None:
    out = check_python("""
        import torch, torchport.sim
        from torchport.backend import active_backend
        from torchport.ops import native_hostops
        x = torch.arange(4., device="sim")
        print(active_backend().host_op_kernels.native, (x * 2).tolist(),
              native_hostops.counts())
    """, env=child_env(TORCHPORT_NATIVE="0"))
    assert out.split() == ["False", "[0.0,", "2.0,", "4.0,", "6.0]", "(0,", "0,", "0)"]


# Copies (torchport's own copy_, served the same way): (name, fn(make) -> the written
# tensor), where make(t) puts a CPU tensor where the copy's device side is.
_COPIES = [
    ("same device", lambda m: torch.empty(6, 8, device=_dev(m)).copy_(m(_x()))),
    ("same device transposed", lambda m: m(torch.empty(8, 6)).copy_(m(_x()).t())),
    ("same device broadcast", lambda m: m(torch.empty(6, 8)).copy_(m(_x()[0]))),
    ("same device to half", lambda m: m(torch.empty(6, 8, dtype=torch.half)).copy_(m(_x()))),
    ("same device int to float", lambda m: m(torch.empty(6, 8)).copy_(m(_x().long()))),
    ("same device to bool", lambda m: m(torch.empty(6, 8, dtype=torch.bool)).copy_(m(_x()))),
    ("into a strided view", lambda m: _strided(m(torch.zeros(6, 16)), m(_x()))),
    ("from the host", lambda m: m(torch.empty(6, 8)).copy_(_x())),
    ("from the host strided", lambda m: m(torch.empty(8, 6)).copy_(_x().t())),
    ("from the host broadcast", lambda m: m(torch.empty(6, 8)).copy_(_x()[:1])),
    ("from the host 0-dim", lambda m: m(torch.empty(6, 8)).copy_(torch.tensor(2.5))),
    ("from the host to double", lambda m: m(torch.empty(6, 8, dtype=torch.double)).copy_(_x())),
    ("to the host", lambda m: torch.empty(6, 8).copy_(m(_x()))),
    ("to the host strided", lambda m: torch.empty(8, 6).t().copy_(m(_x()))),
    ("to the host as int", lambda m: torch.empty(6, 8, dtype=torch.int32).copy_(m(_x() * 9))),
    ("to the host non-blocking", lambda m: torch.empty(6, 8).copy_(m(_x()), non_blocking=True)),
    ("empty", lambda m: m(torch.empty(0, 8)).copy_(_x()[:0])),
]


def _x() -> torch.Tensor:
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(3))


def _dev(m) -> str:
    return "cpu" if m(torch.empty(0)).device.type == "cpu" else "sim"


def _strided(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    dst[:, ::2].copy_(src)
    return dst


@pytest.mark.parametrize("name,fn", _COPIES, ids=[n for n, _ in _COPIES])
def test_copies_equal_the_cpu(name, fn) -> None:
    cpu = fn(lambda t: t)
    with calls() as c:
        got = fn(lambda t: t.to("sim"))
    assert (got.shape, got.stride(), got.dtype) == (cpu.shape, cpu.stride(), cpu.dtype)
    assert torch.equal(got.cpu(), cpu)
    if _COMPUTES:
        assert c.handed == 0, c.handed  # the copy_ and the copies .to("sim") makes: C++


@needs_cpp
def test_a_copy_is_served_in_cpp_and_returns_its_destination() -> None:
    a, h = torch.randn(5, device="sim"), torch.randn(5)
    b = torch.empty(5, device="sim")
    with calls() as c:
        r1 = b.copy_(a)
        r2 = b.copy_(h)
        r3 = h.copy_(a)
    assert c.served == 3 and c.handed == 0
    assert r1 is b and r2 is b and r3 is h
    assert torch.equal(h, a.cpu()) and torch.equal(b.cpu(), h)


def test_copy_errors_are_the_cpus_and_leave_the_inputs_intact() -> None:
    a = torch.arange(10.0)
    d = a.to("sim")
    for f in (lambda t: t[1:].copy_(t[:-1]),               # partial overlap
              lambda t: t[:4].expand(3, 4).copy_(t[:4]),   # an output with internal overlap
              lambda t: t[:4].copy_(t[:3])):               # shapes that do not broadcast
        cpu, dev = _outcome(lambda f=f: f(a)), _outcome(lambda f=f: f(d))
        assert cpu[0] is RuntimeError and dev == cpu
        assert torch.equal(d.cpu(), a) and torch.equal(a, torch.arange(10.0))
    h = torch.zeros(3)
    assert _outcome(lambda: h.copy_(d[:4])) == _outcome(lambda: h.copy_(a[:4]))
    assert torch.equal(h, torch.zeros(3))


_COPIES_HANDED = [
    ("between two devices", lambda: torch.zeros(4, device="sim:1").copy_(
        torch.full((4,), 2.0, device="sim:0"))),
    ("with the host on a side stream", lambda: _on_side_stream(
        lambda: torch.zeros(4, device="sim").copy_(torch.arange(4.0)))),
    ("from a conjugate view", lambda: torch.zeros(2, dtype=torch.complex64, device="sim").copy_(
        torch.tensor([1 + 2j, 3j], device="sim").conj())),
]


def _on_side_stream(fn):
    with torch.sim.stream(torch.sim.Stream()):
        return fn()


@needs_cpp
def test_a_vendor_copy_kernel_takes_copy_back_to_python() -> None:
    from torchport.ops import KernelSet

    assert "native_hostops.cpp" in privateuse1_registrations("aten::copy_")[0]
    seen = []
    ks = KernelSet("copies")

    @ks.kernel("copy_")
    def copy_(dst, src, non_blocking=False):
        seen.append(src.dtype)
        from torchport.ops import Decline
        raise Decline("the core copy does it")

    try:
        _B.add_kernels(ks)
        lines = privateuse1_registrations("aten::copy_")
        assert len(lines) == 1 and "native_hostops.cpp" not in lines[0], lines
        assert _K.native  # the other ops stay in C++
        assert "native_hostops.cpp" in privateuse1_registrations("aten::add.Tensor")[0]
        torch.empty(3, device="sim").copy_(torch.ones(3, device="sim", dtype=torch.half))
        assert seen == [torch.half]
    finally:
        _B.remove_kernels(ks)
    lines = privateuse1_registrations("aten::copy_")
    assert len(lines) == 1 and "native_hostops.cpp" in lines[0], lines


@pytest.mark.parametrize("dst,src", [((3,), (4,)), ((4,), (1, 4)), ((2, 3), (3, 2))])
def test_a_copy_of_a_shape_that_does_not_broadcast_raises_the_cpus_error(dst, src) -> None:
    for where in ("same device", "from the host", "to the host"):
        d = torch.zeros(dst, device="cpu" if where == "to the host" else "sim")
        s = torch.ones(src, device="cpu" if where == "from the host" else "sim")
        with python_host_kernels():
            python = _outcome(lambda d=d, s=s: d.copy_(s))
        assert python == _outcome(lambda d=d, s=s: d.copy_(s)) == _outcome(
            lambda: torch.zeros(dst).copy_(torch.ones(src))), where
        assert not d.cpu().any()


# Tensor.to / .cpu() (torchport's own _to_copy, served the same way): (name, fn(t, dev) -> the
# copy), t a CPU tensor, dev "sim" or "cpu"; the device's result must equal the CPU's.
_TO = [
    ("to the device", lambda t, dev: t.to(dev)),
    ("to the device transposed", lambda t, dev: t.t().to(dev)),
    ("to the device expanded", lambda t, dev: t[:1].expand(6, 8).to(dev, copy=True)),
    ("to the device channels_last", lambda t, dev: t.reshape(1, 2, 3, 8).to(
        dev, memory_format=torch.channels_last)),
    ("to the device as half", lambda t, dev: t.to(dev, torch.half)),
    ("to sim:1", lambda t, dev: t.to(dev if dev == "cpu" else "sim:1")),
    ("to the host", lambda t, dev: t.to(dev).cpu()),
    ("to the host transposed", lambda t, dev: t.to(dev).t().cpu()),
    ("to the host as int", lambda t, dev: (t * 9).to(dev).to("cpu", torch.int32)),
    ("to the host non-blocking", lambda t, dev: t.to(dev).to("cpu", non_blocking=True)),
    ("a dtype", lambda t, dev: t.to(dev).to(torch.half)),
    ("a dtype of a strided view", lambda t, dev: t.to(dev)[:, ::2].double()),
    ("bool", lambda t, dev: t.to(dev).bool()),
    ("a memory format", lambda t, dev: t.reshape(2, 3, 2, 4).to(dev).to(
        memory_format=torch.channels_last)),
    ("empty", lambda t, dev: t[:0].to(dev).to(torch.half)),
    ("large", lambda t, dev: t.repeat(1024, 64).to(dev).double()),  # 6 MiB: adopted
]


@pytest.mark.parametrize("name,fn", _TO, ids=[n for n, _ in _TO])
def test_to_copies_equal_the_cpu(name, fn) -> None:
    cpu = fn(_x(), "cpu")
    with calls() as c:
        got = fn(_x(), "sim")
    assert got.device.type == ("cpu" if "host" in name else "sim")
    assert (got.shape, got.stride(), got.dtype) == (cpu.shape, cpu.stride(), cpu.dtype)
    assert torch.equal(got.cpu(), cpu)
    if _COMPUTES:
        assert c.served >= 1 and c.handed == 0, (c.served, c.handed)


_TO_HANDED = [
    ("to another device", lambda: torch.full((3,), 2.0, device="sim:0").to("sim:1")),
    ("to the host on a side stream", lambda: _on_side_stream(
        lambda: torch.full((3,), 2.0, device="sim").cpu())),
    ("a conjugate view", lambda: torch.tensor([1 + 2j], device="sim").conj().to(
        torch.complex128)),
]


@pytest.mark.parametrize("name,fn", _COPIES_HANDED + _TO_HANDED,
                         ids=[n for n, _ in _COPIES_HANDED + _TO_HANDED])
def test_copies_handed_to_python_are_the_python_kernels(name, fn) -> None:
    with calls() as c:
        native = _outcome(fn)
    with python_host_kernels():
        python = _outcome(fn)
    assert native[0] == "ok" and torch.equal(native[1], python[1])
    if _COMPUTES:
        assert c.handed >= 1
