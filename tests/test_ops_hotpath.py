"""The hot path of host-computed kernels: cached views, cached output layouts, the
out= trial, and the allocator's deferred statistics -- each checked against the CPU."""

from __future__ import annotations

import copy
import gc
import json
import warnings
from collections.abc import Iterator

import pytest
import torch

import torchport.sim  # noqa: F401
from tests.helpers import host_kernels_of, python_host_kernels
from torchport.backend import active_backend
from torchport.ops import hostviews

pytestmark = pytest.mark.modes


@pytest.fixture(autouse=True)
def _python_host_kernels() -> Iterator[None]:
    """These tests follow the Python host kernels' paths (C++ serves their common calls
    where it can: tests/test_native_hostops.py)."""
    with python_host_kernels():
        yield

# Checks of the synchronous path's own machinery (its caches, plans and adoptions); an
# asynchronous runtime queues kernels instead, checked in tests/test_async.py.
sync_path = pytest.mark.skipif(active_backend().runtime.asynchronous,
                               reason="the synchronous path's machinery; asynchronous "
                                      "runtimes queue kernels (tests/test_async.py)")

def test_scalar_type_is_part_of_the_layout_key() -> None:
    i = torch.arange(6, device="sim")
    # the same layouts, values equal as Python numbers, other result dtypes
    assert (i * 2).dtype == torch.int64
    assert (i * 2.0).dtype == torch.float32
    assert (i * True).dtype == torch.int64
    assert torch.equal((i * 2.5).cpu(), torch.arange(6) * 2.5)


def test_wrapped_numbers_in_tensor_slots() -> None:
    x = torch.zeros(3, device="sim", dtype=torch.int32)
    x.add_(1)  # the dispatcher hands the kernel a Python 1 for the Tensor `other`
    y = x + 1
    assert y.dtype == torch.int32 and torch.equal(y.cpu(), torch.full((3,), 2, dtype=torch.int32))


def test_out_overload_that_stages_in_out_is_not_used_and_stays_silent() -> None:
    # CPU mse_loss.out computes the elementwise loss in `out` before reducing it
    a, b = torch.randn(64, 32), torch.randn(64, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            got = torch.nn.functional.mse_loss(a.to("sim"), b.to("sim"))
            assert torch.equal(got.cpu(), torch.nn.functional.mse_loss(a, b))


def test_neighbours_untouched_by_a_staging_kernel() -> None:
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    guard = torch.full((128,), 7.0, device="sim")  # likely the block after the result
    torch.nn.functional.mse_loss(a.to("sim"), b.to("sim"), reduction="sum")
    assert torch.equal(guard.cpu(), torch.full((128,), 7.0))


@sync_path
def test_views_dropped_when_segments_go_back() -> None:
    b = active_backend()
    x = torch.randn(3 << 20, device="sim")  # 12 MiB: a segment of its own
    ptr, size = x.data_ptr(), x.numel() * 4
    y = (x * 2).cpu()

    def views_into() -> int:
        return len(hostviews.cached(ptr, size))
    assert views_into()
    del x
    b.device_module.empty_cache()
    assert views_into() == 0
    x2 = torch.randn(3 << 20, device="sim")  # may land at the same address
    assert torch.equal((x2 * 2).cpu(), x2.cpu() * 2)
    assert y.shape == (3 << 20,)


@pytest.mark.parametrize("sizes", [[256, 256, 1024, 256], [512, 4096, 512, 4096, 512]])
def test_deferred_statistics_are_exact(sizes: list[int]) -> None:
    dm = active_backend().device_module
    dm.synchronize()
    live = []
    for n in sizes:  # warm the parked lists so the hot path serves the loop below
        live.append(torch.empty(n, dtype=torch.uint8, device="sim"))
    live.clear()
    dm.reset_peak_memory_stats()
    base = dm.memory_allocated()
    peak = base
    expect = base
    for _ in range(3):
        for n in sizes:
            live.append(torch.empty(n, dtype=torch.uint8, device="sim"))
            expect += max(512, n)
            peak = max(peak, expect)
        while live:
            t = live.pop()
            expect -= max(512, t.numel())
            del t
            assert dm.memory_allocated() == expect
    assert dm.max_memory_allocated() == peak
    stats = dm.memory_stats()
    assert stats["allocation.all.current"] == stats["active.all.current"]
    assert stats["allocated_bytes.all.peak"] == peak


def _expected_stats(events: list[tuple[int, int, bool, int]]) -> dict[str, int]:
    """``torch.cuda.memory_stats`` counters of allocations (``allocation``, ``active``,
    their bytes, the requested bytes) for a sequence of ``(+1 or -1, block size, small
    pool?, requested bytes)`` events, counted one event at a time."""
    out = {f"{name}.{pool}.{metric}": 0
           for pool in ("all", "small_pool", "large_pool")
           for name in ("allocation", "active", "allocated_bytes", "active_bytes",
                        "requested_bytes")
           for metric in ("current", "peak", "allocated", "freed")}
    for sign, size, small, requested in events:
        for pool in ("all", "small_pool" if small else "large_pool"):
            for name, n in (("allocation", 1), ("active", 1), ("allocated_bytes", size),
                            ("active_bytes", size), ("requested_bytes", requested)):
                k = f"{name}.{pool}."
                out[k + "current"] += sign * n
                out[k + ("allocated" if sign > 0 else "freed")] += n
                out[k + "peak"] = max(out[k + "peak"], out[k + "current"])
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_statistics_of_mixed_small_and_large_blocks_are_exact(seed: int) -> None:
    # small and large blocks interleaved, most of them reused from the exact-size lists
    # (the hot path, whose statistics are deferred); read only now and then
    g = torch.Generator().manual_seed(seed)
    sizes = [100, 512, 4096, 300_000, 1 << 20, (1 << 20) + 1, 3 << 20, (8 << 20) - 7]
    dm = active_backend().device_module
    alloc = active_backend().allocators[0]
    gc.collect()  # earlier tests' garbage must not be freed in the middle of the count
    dm.synchronize()
    warm = [torch.empty(n, dtype=torch.uint8, device="sim") for n in sizes for _ in range(3)]
    del warm
    dm.reset_peak_memory_stats()
    dm.reset_accumulated_memory_stats()
    before = dm.memory_stats()
    events: list[tuple[int, int, bool, int]] = []
    live: list[tuple[torch.Tensor, int, bool, int]] = []
    for step in range(600):
        if live and torch.rand(1, generator=g).item() < 0.45:
            t, size, small, n = live.pop(int(torch.randint(len(live), (1,), generator=g)))
            del t
            events.append((-1, size, small, n))
        else:
            n = sizes[int(torch.randint(len(sizes), (1,), generator=g))]
            t = torch.empty(n, dtype=torch.uint8, device="sim")
            block = alloc.active[t.data_ptr()]
            live.append((t, block.size, block.small, n))
            events.append((1, block.size, block.small, n))
        if step % 97 == 0:
            dm.memory_allocated()  # a reader flushes the deferred counts
    t = None
    while live:
        size, small, n = live.pop()[1:]
        events.append((-1, size, small, n))
    stats = dm.memory_stats()
    for k, v in _expected_stats(events).items():
        # counted from the start's counts (the peaks were reset to them)
        start = before[k.rsplit(".", 1)[0] + ".current"] if k.endswith((".current", ".peak")) else 0
        assert stats[k] == start + v, k


@pytest.mark.parametrize("training", [True, False])
def test_first_call_of_a_layout_runs_the_op_once(training: bool) -> None:
    # native_batch_norm writes its running statistics without saying so in its schema;
    # in eval mode the CPU returns empty saved statistics where the meta kernel says [C]
    x, w, b = torch.randn(6, 3), torch.randn(3), torch.randn(3)
    rm, rv = torch.zeros(3), torch.ones(3)
    dev = [t.to("sim") for t in (x, w, b, rm, rv)]
    for _ in range(2):
        want = torch.ops.aten.native_batch_norm(x, w, b, rm, rv, training, 0.1, 1e-5)
        got = torch.ops.aten.native_batch_norm(*dev, training, 0.1, 1e-5)
        for g, r in zip(got, want, strict=True):
            assert g.shape == r.shape and torch.equal(g.cpu(), r)
        assert torch.equal(dev[3].cpu(), rm) and torch.equal(dev[4].cpu(), rv)


@sync_path
def test_large_host_results_are_adopted_not_copied() -> None:
    # convolution.out is generated (the functional kernel, then a copy): a large result of
    # the CPU kernel becomes device memory as it is, its own segment, freed with it
    dm = active_backend().device_module
    x, w = torch.randn(32, 8, 32, 32), torch.randn(16, 8, 3, 3)
    xs, ws = x.to("sim"), w.to("sim")
    dm.empty_cache()
    before = dm.memory_stats()
    y = torch.nn.functional.conv2d(xs, ws, padding=1)
    assert torch.equal(y.cpu(), torch.nn.functional.conv2d(x, w, padding=1))
    if not active_backend().runtime.host_addressable:
        pytest.skip("strict sim memory is not host memory: the result was copied")
    nbytes = y.numel() * 4
    during = dm.memory_stats()
    assert during["allocated_bytes.all.current"] - before["allocated_bytes.all.current"] == nbytes
    assert during["segment.large_pool.current"] == before["segment.large_pool.current"] + 1
    del y
    after = dm.memory_stats()
    assert after["allocated_bytes.all.current"] == before["allocated_bytes.all.current"]
    assert after["reserved_bytes.all.current"] == before["reserved_bytes.all.current"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64, torch.bool])
def test_relu_computes_through_clamp_min_into_the_device_tensor(dtype: torch.dtype) -> None:
    # ATen's relu is clamp_min(x, 0) after refusing bool; relu.out is generated (the
    # functional kernel, then a copy). The device computes through clamp_min.out into a
    # block of the caching allocator: no CPU result to copy, or to adopt when large.
    b = active_backend()
    for shape in [(3, 5), (2, 1024, 160)]:  # the second is 1.25 MiB in float32
        x = (torch.randn(shape) * 3).to(dtype) if dtype != torch.bool else torch.rand(shape) > 0.5
        if dtype.is_floating_point:
            x.view(-1)[:2] = torch.tensor([float("nan"), -0.0])
        xs = x.to("sim")
        for i in range(3):  # the first call of a layout is a trial
            if dtype == torch.bool:
                with pytest.raises(RuntimeError, match="Boolean inputs not supported for relu"):
                    torch.relu(xs)
                continue
            segments = b.allocators[0].num_device_alloc
            y = torch.relu(xs)
            want = torch.relu(x)
            assert (y.dtype, y.shape, y.stride()) == (want.dtype, want.shape, want.stride())
            assert torch.equal(y.cpu().view(torch.uint8), want.view(torch.uint8))  # bits
            assert not b.allocators[0].active[y.data_ptr()].adopted
            assert i == 0 or b.allocators[0].num_device_alloc == segments  # a cached block
            del y  # its block serves the next call


@sync_path
def test_an_adopted_result_is_its_own_host_view_until_it_dies(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the CPU result that became device memory is already the chip's view of it: the op
    # consuming it makes no new view, and the entry goes with the segment
    if not active_backend().runtime.host_addressable:
        pytest.skip("strict sim memory is not host memory: results are copied")
    x, w = torch.randn(32, 8, 32, 32), torch.randn(16, 8, 3, 3)
    torch.ones(32, 16, 32, 32, device="sim") * 3  # mul's first call of this layout: a trial
    y = torch.nn.functional.conv2d(x.to("sim"), w.to("sim"), padding=1)
    key = (y.data_ptr(), y.dtype, y.shape, y.stride())
    holders = [hv for hv in hostviews.caches() if key in hv.entries]
    assert len(holders) == 1
    hv = holders[0]
    assert hv.entries[key][0].data_ptr() == y.data_ptr()
    made: list = []
    to_cpu = hv.to_cpu
    monkeypatch.setattr(hv, "to_cpu", lambda t: made.append(t.shape) or to_cpu(t))
    want = torch.nn.functional.conv2d(x, w, padding=1)
    assert torch.equal((y * 3).cpu(), want * 3)
    assert made == []  # y's entry was there; the product reuses the warm-up's block
    del y
    assert key not in hv.entries


def test_adoption_respects_the_memory_fraction() -> None:
    dm = active_backend().device_module
    x = torch.randn(1, 1, 1536, 2048, device="sim")  # 12 MiB: a segment of its own
    w = torch.randn(1, 1, 3, 3, device="sim")
    dm.empty_cache()
    total = dm.get_device_properties(0).total_memory
    dm.set_per_process_memory_fraction((dm.memory_reserved() + (1 << 20)) / total)
    try:
        with pytest.raises(torch.OutOfMemoryError):
            torch.nn.functional.conv2d(x, w, padding=1)  # no room to adopt or copy
    finally:
        dm.set_per_process_memory_fraction(1.0)
    y = torch.nn.functional.conv2d(x, w, padding=1)
    assert torch.equal(y.cpu(), torch.nn.functional.conv2d(x.cpu(), w.cpu(), padding=1))


def test_float_arguments_do_not_grow_the_layout_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchport.ops import derive
    calls = []
    real = derive.output_specs
    monkeypatch.setattr(derive, "output_specs", lambda *a: calls.append(a[0]) or real(*a))
    x = torch.randn(5, 3, device="sim")
    for i in range(50):  # an optimizer's bias corrections: a new float every step
        assert torch.equal((x / (1.0 + i / 7)).cpu(), x.cpu() / (1.0 + i / 7))
        assert torch.equal((x * (0.5 + i)).cpu(), x.cpu() * (0.5 + i))
    assert len(calls) <= 2  # one layout per op, not one per value


def test_every_foreach_op_is_native() -> None:
    from torchport.ops import registry
    names = {s.name.split("::")[1] for s in torch._C._jit_get_all_schemas()
             if s.name.startswith("aten::_foreach_")}
    native = {k.split(".")[0] for k in registry.native_overloads() if k.startswith("_foreach_")}
    assert names <= native, sorted(names - native)[:5]


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_foreach_optimizer_steps_match_cpu(opt: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    dev = copy.deepcopy(model).to("sim")
    make = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=True),
            "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, foreach=True)}[opt]
    o_cpu, o_dev = make(model.parameters()), make(dev.parameters())
    x, y = torch.randn(4, 6), torch.randn(4, 3)
    for _ in range(4):
        for m, o, xx, yy in ((model, o_cpu, x, y), (dev, o_dev, x.to("sim"), y.to("sim"))):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(xx), yy).backward()
            o.step()
    for a, b in zip(model.parameters(), dev.parameters(), strict=True):
        assert torch.equal(a, b.cpu())


def test_functional_foreach_ops_match_cpu() -> None:
    xs = [torch.randn(3, 4), torch.randn(5), torch.randn(2, 2)]
    ds = [t.to("sim") for t in xs]
    pairs = ((torch._foreach_sqrt([d.abs() for d in ds]), torch._foreach_sqrt([t.abs() for t in xs])),
             (torch._foreach_add(ds, ds, alpha=0.5), torch._foreach_add(xs, xs, alpha=0.5)),
             (torch._foreach_mul(ds, 3.0), torch._foreach_mul(xs, 3.0)))
    for got, want in pairs:
        for g, w in zip(got, want, strict=True):
            assert g.device.type == "sim" and torch.equal(g.cpu(), w)


def _foreach_inputs(dtype: torch.dtype) -> list[list[torch.Tensor]]:
    """Three lists laid out alike: odd sizes, a scalar, an empty, a transposed and a
    channels_last tensor (the CPU keeps each input's layout in its result)."""
    torch.manual_seed(0)

    def one() -> list[torch.Tensor]:
        return [torch.randn(3, 4), torch.randn(37), torch.randn(()), torch.randn(0, 3),
                torch.randn(5, 7, 3), torch.randn(4, 6).t(),
                torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)]
    return [[(t.abs() + 0.5).to(dtype) for t in one()] for _ in range(3)]


_FOREACH_CALLS = {
    "sqrt": lambda a, b, c: torch._foreach_sqrt(a),
    "exp": lambda a, b, c: torch._foreach_exp(a),
    "log1p": lambda a, b, c: torch._foreach_log1p(a),
    "sigmoid": lambda a, b, c: torch._foreach_sigmoid(a),
    "lgamma": lambda a, b, c: torch._foreach_lgamma(a),
    "neg": lambda a, b, c: torch._foreach_neg(a),
    "add.List": lambda a, b, c: torch._foreach_add(a, b, alpha=0.3),
    "add.ScalarList": lambda a, b, c: torch._foreach_add(a, [0.5 * i for i in range(len(a))]),
    "mul.Scalar": lambda a, b, c: torch._foreach_mul(a, 0.7),
    "div.List": lambda a, b, c: torch._foreach_div(a, b),
    "pow.Scalar": lambda a, b, c: torch._foreach_pow(a, 1.7),
    "addcdiv.Scalar": lambda a, b, c: torch._foreach_addcdiv(a, b, c, 0.1),
    "addcmul.ScalarList": lambda a, b, c: torch._foreach_addcmul(a, b, c, [0.5] * len(a)),
    "lerp.List": lambda a, b, c: torch._foreach_lerp(a, b, c),
    "maximum.List": lambda a, b, c: torch._foreach_maximum(a, b),
    "add.complex": lambda a, b, c: torch._foreach_add(a, 1j),  # promotes: not by the twin
}


@sync_path
@pytest.mark.parametrize("name", list(_FOREACH_CALLS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_functional_foreach_ops_keep_cpu_layouts_and_bits(name: str, dtype: torch.dtype) -> None:
    fn = _FOREACH_CALLS[name]
    cpu = _foreach_inputs(dtype)
    dev = [[t.to("sim") for t in lst] for lst in cpu]
    copies = [[t.clone() for t in lst] for lst in dev]
    try:
        want = fn(*cpu)
    except RuntimeError as e:  # an op the CPU refuses for this dtype: the same error
        with pytest.raises(RuntimeError, match=str(e)[:30].replace("(", ".").replace(")", ".")):
            fn(*dev)
        return
    with torchport.ops.record() as rec:
        got = fn(*dev)
    subs = {k for s in rec.ops.values() for k in s.subpaths}
    moved = "native:cpu-result" in subs
    for g, w in zip(got, want, strict=True):
        assert (g.device.type, g.dtype, g.shape, g.stride()) == ("sim", w.dtype, w.shape, w.stride())
        torch.testing.assert_close(g.cpu(), w, rtol=0, atol=0, equal_nan=True)
    for lst, kept in zip(dev, copies, strict=True):  # inputs untouched
        assert all(torch.equal(t.cpu(), k.cpu()) for t, k in zip(lst, kept, strict=True))
    # float32 kept by the result: computed in place into new device tensors
    assert moved == (dtype != torch.float32 or name == "add.complex")
    assert ("native:foreach-twin" in subs) != moved


def _foreach_sample(op: torch._ops.OpOverload, dtype: torch.dtype, number: float) -> list | None:
    """Positional arguments for ``op`` built from its schema (positive tensors: in every
    op's domain), or ``None`` for an argument kind not covered."""
    args: list = []
    for a in op._schema.arguments:
        kind = str(a.type)
        if a.kwarg_only:
            continue
        if kind == "List[Tensor]":
            args.append([(torch.rand(s) + 0.05).to(dtype) for s in [(37,), (4, 5), (3, 7, 5)]])
        elif kind in ("Scalar", "number"):
            args.append(number)
        elif kind == "List[number]":
            args.append([number, -1.3, 2.1])
        elif kind == "bool":
            args.append(False)
        else:
            return None
    return args


def test_every_foreach_twin_computes_the_functional_bits() -> None:
    # what makes the in-place route of functional foreach ops exact, op by op
    from torchport.ops.hostkernels import lists
    from torchport.ops.hostkernels import schema as op_schema
    checked = 0
    for schema in torch._C._jit_get_all_schemas():
        name = schema.name.split("::")[1]
        if not name.startswith("_foreach_") or name.endswith("_"):
            continue
        packet = getattr(torch.ops.aten, name, None)
        op = getattr(packet, schema.overload_name or "default", None)
        twin = op_schema.foreach_twin(op) if op is not None else None
        for dtype in lists.TWIN_DTYPES if twin is not None else ():
            for number in (0.37, 3, -1.7e-3):
                args = _foreach_sample(op, dtype, number)
                if args is None:
                    continue
                want = op(*args)
                outs = [x.clone() for x in args[0]]
                twin(outs, *args[1:])
                for w, o in zip(want, outs, strict=True):
                    torch.testing.assert_close(o, w, rtol=0, atol=0, equal_nan=True,
                                               msg=lambda m, n=name: f"{n}: {m}")
                checked += 1
    assert checked > 300


def test_unary_foreach_ops_on_large_tensors_compute_tensor_by_tensor() -> None:
    # one pass per tensor into its new device tensor (no copy, no twin), the CPU's bits
    from torchport.ops.hostkernels import lists
    from torchport.ops.hostkernels import schema as op_schema
    checked = 0
    for schema in torch._C._jit_get_all_schemas():
        name = schema.name.split("::")[1]
        if not name.startswith("_foreach_") or name.endswith("_") or schema.overload_name:
            continue
        op = getattr(getattr(torch.ops.aten, name, None), "default", None)
        if op is None or op_schema.per_tensor_out(op) is None:
            continue
        for dtype in lists.TWIN_DTYPES:
            xs = [(torch.rand(s) + 0.05).to(dtype) for s in [(64, 80), (5, 40, 30), (4100,)]]
            xs[1] = xs[1].permute(2, 0, 1)  # dense, not contiguous
            dev = [x.to("sim") for x in xs]
            with torchport.ops.record() as rec:
                want, got = op(xs), op(dev)
            sub = "launch" if active_backend().runtime.asynchronous else "foreach-per-tensor"
            assert rec.subpaths_of(name) == {f"native:{sub}": 1}, name
            for g, w in zip(got, want, strict=True):
                assert (g.device.type, g.dtype, g.shape, g.stride()) == \
                    ("sim", w.dtype, w.shape, w.stride()), name
                torch.testing.assert_close(g.cpu(), w, rtol=0, atol=0, equal_nan=True,
                                           msg=lambda m, n=name: f"{n}: {m}")
            assert all(torch.equal(d.cpu(), x) for d, x in zip(dev, xs, strict=True))
            checked += 1
    assert checked >= 60


def test_functional_foreach_errors_are_the_cpus() -> None:
    a, b = _foreach_inputs(torch.float32)[:2]
    da, db = [t.to("sim") for t in a], [t.to("sim") for t in b[:2]]
    with pytest.raises(RuntimeError, match="same number of tensors"):
        torch._foreach_add(da, db)
    odd = [t.to("sim") for t in b]
    odd[1] = odd[1][:5]  # shapes differ at one position: the CPU's own error
    with pytest.raises(RuntimeError) as err:
        torch._foreach_mul(da, odd)
    with pytest.raises(RuntimeError) as want:
        torch._foreach_mul(a, [t if i != 1 else t[:5] for i, t in enumerate(b)])
    assert str(err.value) == str(want.value)


# ---- tensors from DLPack layout headers -------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bool, torch.bfloat16, torch.complex64,
                                   torch.int64, torch.float8_e4m3fn])
@pytest.mark.parametrize("index", [0, 1])
def test_new_tensors_have_the_asked_layout_and_free_their_block(dtype: torch.dtype,
                                                                index: int) -> None:
    b = active_backend()
    alloc = b.allocators[index]
    before = alloc.stat("allocated_bytes").current
    t = b.empty_strided((3, 1, 4), (4, 7, 1), dtype, index)  # a stride on a size-1 dim
    assert (t.shape, t.stride(), t.dtype, t.device) == \
        ((3, 1, 4), (4, 7, 1), dtype, torch.device("sim", index))
    assert t.untyped_storage().nbytes() == 12 * dtype.itemsize
    assert t.data_ptr() in alloc.active
    ptr = t.data_ptr()
    del t
    assert ptr not in alloc.active  # the block went back when the storage died
    assert alloc.stat("allocated_bytes").current == before


def test_a_rewritten_header_takes_the_slow_way(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchport.memory import tensors
    real = tensors._new_capsule

    def racing(address: int, name: bytes, destructor: object) -> object:
        cap = real(address, name, destructor)
        ctypes_field = next(h[1] for h in tensors._HEADERS.values()
                            if h is not None and h[0] == address)
        ctypes_field.value = ctypes_field.value + 64  # another thread's block, say
        return cap
    x = torch.randn(7, 5, device="sim")
    monkeypatch.setattr(tensors, "_new_capsule", racing)
    y = active_backend().empty_strided((7, 5), (5, 1), torch.float32, 0)
    y.copy_(x)
    assert y.data_ptr() in active_backend().allocators[0].active
    assert torch.equal(y.cpu(), x.cpu())


def test_layout_headers_are_bounded() -> None:
    from torchport.memory import tensors
    kept = tensors.header_count()
    old = tensors.set_max_headers(kept)
    try:
        x = torch.randn(13, 17, 19)
        y = (x.to("sim") * 3).cpu()  # a layout no header was made for: the slow way
        assert tensors.header_count() == kept
    finally:
        tensors.set_max_headers(old)
    assert torch.equal(y, x * 3)


def test_a_tensor_dying_while_an_exception_propagates_keeps_the_exception() -> None:
    alloc = active_backend().allocators[0]
    gc.collect()  # earlier tests' garbage must not be freed in the middle of the count
    before = len(alloc.active)

    def fail() -> None:
        t = torch.randn(64, 3, device="sim") * 2  # dies while the error below propagates
        torch._foreach_add([t, t], [t])  # PyTorch raises: lists of unequal length
    with pytest.raises(RuntimeError, match="same number of tensors"):
        fail()
    assert len(alloc.active) == before


# the C++ allocator serves (its storages return their blocks from their DataPtr's deleter)
_CPP_ALLOCATOR = getattr(active_backend().allocators[0], "new_tensor", None) is not None


def _grad_sums(device: str) -> list[str]:
    """The add overloads the autograd engine calls to sum two gradients of one tensor
    (the profiler sees them without making Python objects of the tensors)."""
    from torch.profiler import profile
    x = torch.randn(32, 32, device=device, requires_grad=True)
    y = x * 2
    out = y.sin() + y.cos()
    with profile() as prof:
        out.sum().backward()
    return [e.name for e in prof.events() if e.name in ("aten::add", "aten::add_")
            and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::"))]


@pytest.mark.xfail(not _CPP_ALLOCATOR, strict=True,
                   reason="the Python allocator: the storage's Python object, whose weakref "
                   "returns the block, counts as a reference: the engine's 'last user' check "
                   "fails")
def test_gradients_sum_in_place_as_on_cpu() -> None:
    assert _grad_sums("cpu") == ["aten::add_"]
    assert _grad_sums("sim") == ["aten::add_"]


# ---- the out= overload through its Python binding ------------------------------------
def _plans(op: torch._ops.OpOverload) -> list:
    return [v for o in host_kernels_of(op) for v in o.layouts.values() if v]


@sync_path
def test_python_binding_is_used_once_it_agrees() -> None:
    a, b = torch.randn(6, 2), torch.randn(6, 2)
    for _ in range(2):
        assert torch.equal((a.to("sim") - b.to("sim")).cpu(), a - b)
    assert any(p[2] is torch._C._VariableFunctions.sub for p in _plans(torch.ops.aten.sub.Tensor))


@sync_path
def test_a_binding_computing_other_bits_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    for into in host_kernels_of(torch.ops.aten.atan2.default):  # its out= binding replaced by sub's
        into.layouts.clear()
        monkeypatch.setattr(into, "binding", torch._C._VariableFunctions.sub)
    a, b = torch.randn(3, 9, dtype=torch.float64), torch.randn(3, 9, dtype=torch.float64)
    for _ in range(3):
        assert torch.equal(torch.atan2(a.to("sim"), b.to("sim")).cpu(), torch.atan2(a, b))
    assert _plans(torch.ops.aten.atan2.default)
    assert all(p[2] is None for p in _plans(torch.ops.aten.atan2.default))


@sync_path
@pytest.mark.parametrize("kind", ["function", "dispatch"])
def test_modes_active_inside_kernels_never_see_their_cpu_calls(kind: str) -> None:
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode
    seen: list[str] = []

    def record(func, args, kwargs):  # noqa: ANN001, ANN202
        seen.extend(a.device.type for a in args if isinstance(a, torch.Tensor))
        return func(*args, **(kwargs or {}))

    class FunctionSpy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            return record(func, args, kwargs)

    class DispatchSpy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            return record(func, args, kwargs)
    x, y = torch.randn(4, 4, device="sim"), torch.randn(4, 4, device="sim")
    mul = torch.ops.aten.mul.Tensor
    assert torch.equal(mul(x, y).cpu(), x.cpu() * y.cpu())  # the layout's binding in place
    assert any(p[2] is not None for p in _plans(mul))
    # a redispatch reaches the kernel with the mode still active (a Python binding would
    # show the mode the kernel's CPU call)
    with FunctionSpy() if kind == "function" else DispatchSpy():
        got = mul.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1), x, y)
    assert torch.equal(got.cpu(), x.cpu() * y.cpu())
    assert "cpu" not in seen


# ---- factory ops ---------------------------------------------------------------------
@pytest.mark.parametrize("index", [0, 1])
def test_factory_ops_match_cpu_on_the_named_device(index: int) -> None:
    dev = torch.device("sim", index)
    x = torch.randn(4, 6).t()  # strides (1, 4): *_like keeps them
    xd = x.to(dev)
    cases = [
        (lambda t: torch.zeros_like(t), True),
        (lambda t: torch.ones_like(t, dtype=torch.float64), True),
        (lambda t: torch.full_like(t, 2.5), True),
        (lambda t: t.new_zeros((3, 2)), True),
        (lambda t: t.new_full((5,), 7, dtype=torch.int32), True),
        (lambda t: torch.zeros_like(t, memory_format=torch.contiguous_format), True),
        (lambda t: torch.ones_like(torch.empty(600, 600, device=t.device)), False),  # adopted
    ]
    for make, same_strides in cases:
        got, want = make(xd), make(x)
        assert got.device == dev and got.dtype == want.dtype
        assert torch.equal(got.cpu(), want)
        if same_strides:
            assert got.stride() == want.stride()
    assert torch.equal(torch.full((2, 3), 1.5, device=dev).cpu(), torch.full((2, 3), 1.5))
    assert torch.equal(torch.arange(2, 11, 3, device=dev).cpu(), torch.arange(2, 11, 3))
    assert torch.scalar_tensor(3, device=dev).item() == 3.0


@sync_path
def test_fill_factories_are_one_allocation_and_one_fill() -> None:
    # ones_like & co. are PyTorch composites entering the device three times (empty_like,
    # fill_); once the composite has shown a layout, later calls allocate it and fill the
    # chip's view of it themselves
    x = torch.randn(4, 6).t()  # strides (1, 4): *_like keeps them
    cases = [
        (lambda t: torch.zeros_like(t), 0.0),
        (lambda t: torch.ones_like(t, dtype=torch.float64), 1.0),
        (lambda t: torch.full_like(t, 2.5), 2.5),
        (lambda t: torch.full_like(t.to(torch.int64), 2**40), 2**40),
        (lambda t: torch.ones_like(t, dtype=torch.bool), 1.0),
        (lambda t: torch.full_like(t, 1 + 2j, dtype=torch.complex64), 1 + 2j),
        (lambda t: torch.zeros_like(t, memory_format=torch.contiguous_format), 0.0),
        (lambda t: t.new_zeros((3, 2)), 0.0),
        (lambda t: t.new_ones((2, 0, 3)), None),  # no bytes
        (lambda t: t.new_full((5,), 7, dtype=torch.int32), 7),
    ]
    for index in (0, 1):
        xd = x.to(f"sim:{index}")
        for make, _ in cases:  # (the value each fills with)
            for call in range(3):
                with torchport.ops.record() as rec:
                    got = make(xd)
                want = make(x)
                assert got.device == xd.device and got.dtype == want.dtype
                assert got.stride() == want.stride() and torch.equal(got.cpu(), want)
                if call:  # the first one may be the composite's (the device's own fill_)
                    made = {n: st.subpaths for n, st in rec.ops.items()
                            if n.split(".")[0].endswith(("_like", "new_zeros", "new_ones",
                                                         "new_full"))}
                    assert list(made.values()) == [{"native:fill": 1}], rec.table()
                    assert not {"empty_like", "empty_strided", "empty.memory_format",
                                "fill_.Scalar", "zero_"} & set(rec.ops), rec.table()
    # the CPU's fill_ errors, the block freed
    alloc = active_backend().allocators[0]
    u = torch.zeros(3, dtype=torch.uint8, device="sim")
    before = len(alloc.active)
    for _ in range(3):
        with pytest.raises(RuntimeError, match="cannot be converted to type uint8_t"):
            torch.full_like(u, 300)
    assert len(alloc.active) == before


_EMPTIES = {  # PyTorch's composites over the device's empty / empty_strided, as on CUDA
    "new_empty_strided": lambda t: t.new_empty_strided((3, 4), (1, 3), dtype=torch.float64),
    "new_empty_strided, no elements": lambda t: t.new_empty_strided((0, 4), (4, 1)),
    "new_empty": lambda t: t.new_empty((3, 4)),
    "empty_like": lambda t: torch.empty_like(t),
    "empty_permuted": lambda t: torch.empty_permuted((2, 3, 4), (2, 0, 1), device=t.device),
}


@pytest.mark.parametrize("make", list(_EMPTIES.values()), ids=list(_EMPTIES))
@pytest.mark.parametrize("index", [0, 1])
def test_empty_factories_allocate_without_a_host_kernel(make, index: int) -> None:
    # (autograd's accumulation calls new_empty_strided for each gradient whose layout is
    # not its parameter's: a host kernel made it the general path, 30 us a call)
    x = torch.randn(4, 6).t()
    xd = x.to(f"sim:{index}")
    with torchport.ops.record() as rec:
        got = make(xd)
    want = make(x)
    assert got.device == xd.device and (got.dtype, got.shape, got.stride()) == \
        (want.dtype, want.shape, want.stride())
    assert set(rec.ops) <= {"empty_strided", "empty.memory_format", "as_strided"}, rec.table()


def test_factory_op_naming_another_device() -> None:
    x = torch.randn(3, device="sim:0")
    y = torch.zeros_like(x, device="sim:1")
    assert y.device == torch.device("sim", 1) and torch.equal(y.cpu(), torch.zeros(3))
    z = torch.ones_like(x, device="cpu")
    assert z.device.type == "cpu" and torch.equal(z, torch.ones(3))


def test_general_path_puts_factory_results_on_the_named_device() -> None:
    from torchport.ops import hostexec
    x = torch.randn(3, device="sim:0")
    run = hostexec.run_on_host
    b = active_backend()
    y = run(b, torch.ops.aten.zeros_like.default, (x,), {"device": torch.device("sim", 1)})
    z = run(b, torch.ops.aten.ones_like.default, (x,), {"device": torch.device("cpu")})
    assert y.device == torch.device("sim", 1) and torch.equal(y.cpu(), torch.zeros(3))
    assert z.device.type == "cpu" and torch.equal(z, torch.ones(3))


def test_list_op_results_small_and_large_reach_the_device() -> None:
    # small results are filled by one copy between views; a large one is adopted
    xs = [torch.rand(300, 1000) + 0.1, torch.rand(7) + 0.1, torch.rand(2, 3).t() + 0.1]
    got = torch._foreach_sqrt([x.to("sim") for x in xs])
    for g, x in zip(got, xs, strict=True):
        assert g.device.type == "sim" and g.stride() == x.sqrt().stride()
        assert torch.equal(g.cpu(), x.sqrt())


_LIST_OPS = {  # call -> the overload its device kernel runs
    "x[idx]": (lambda x, i, m: x[i], torch.ops.aten.index.Tensor),
    "x[:, idx]": (lambda x, i, m: x[:, i], torch.ops.aten.index.Tensor),
    "x[idx, idx]": (lambda x, i, m: x[i, i.flip(0)], torch.ops.aten.index.Tensor),
    "cat": (lambda x, i, m: torch.cat([x, x.t(), x], 1), torch.ops.aten.cat.default),
    "stack": (lambda x, i, m: torch.stack([x, x * 2]), torch.ops.aten.cat.default),
}


@sync_path
@pytest.mark.parametrize("name", sorted(_LIST_OPS))
def test_list_ops_write_into_new_device_tensors(name: str) -> None:
    fn, op = _LIST_OPS[name]
    x = torch.randn(6, 6)
    i, m = torch.tensor([4, 0, 5]), x > 0
    xs, is_, ms = x.to("sim"), i.to("sim"), m.to("sim")
    before = xs.cpu()
    for _ in range(3):  # the first call plans, the others take the plan
        got = fn(xs, is_, ms)
        want = fn(x, i, m)
        assert got.device.type == "sim" and got.stride() == want.stride()
        assert torch.equal(got.cpu(), want)
    assert torch.equal(xs.cpu(), before)
    assert any(p[0] is not None for p in _plans(op))  # an out= plan, not a CPU result


@sync_path
def test_list_ops_with_data_dependent_shapes_compute_on_the_cpu() -> None:
    x = torch.randn(5, 4)
    xs = x.to("sim")
    for _ in range(2):
        assert torch.equal(xs[xs > 0].cpu(), x[x > 0])
    index = torch.ops.aten.index.Tensor
    assert any(v is False for o in host_kernels_of(index) for v in o.layouts.values())


def test_list_op_errors_are_the_cpus_and_free_the_output() -> None:
    alloc = active_backend().allocators[0]
    x = torch.randn(4, 3, device="sim")
    ok, bad = torch.tensor([0, 3], device="sim"), torch.tensor([0, 9], device="sim")
    x[ok]  # the plan for this layout exists: the error comes from the out= kernel
    gc.collect()
    before = len(alloc.active)
    if active_backend().runtime.asynchronous:
        # queued, as CUDA launches it: the index is checked on the stream (CUDA's
        # device-side assert), the error raised at the next synchronising call
        y = x[bad]
        with pytest.raises(RuntimeError, match="out of bounds") as raised:
            torch.sim.synchronize()
        assert isinstance(raised.value.__cause__, IndexError)
        del y, raised  # (its traceback's frames hold tensors)
    else:
        with pytest.raises(IndexError, match="out of bounds"):
            x[bad]
    with pytest.raises(RuntimeError, match="Sizes of tensors must match"):
        torch.cat([x, torch.randn(4, 5, device="sim")])
    assert len(alloc.active) == before


def _general_calls(monkeypatch: pytest.MonkeyPatch) -> list:
    """Ops that reach the general path from now on (each makes a ``HostCall``)."""
    from torchport.ops import hostexec
    seen: list = []

    class Counting(hostexec.HostCall):
        def __init__(self, backend, op, *rest) -> None:
            seen.append(op)
            super().__init__(backend, op, *rest)
    monkeypatch.setattr(hostexec, "HostCall", Counting)
    return seen


@sync_path
def test_index_put_takes_the_in_place_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(6, 5)
    i, j, v = torch.tensor([4, 0, 4]), torch.tensor([1, 3]), torch.randn(6, 2)
    general = _general_calls(monkeypatch)
    xs, i_s, j_s, vs = (t.to("sim") for t in (x, i, j, v))
    forms = [  # setitem forms, index_put_ with None entries and with accumulation
        lambda a, i, j, v: a.__setitem__((slice(None), j), v),
        lambda a, i, j, v: a.__setitem__(i, v[:5, 0]),
        lambda a, i, j, v: a.__setitem__(a > 0, 0.5),
        lambda a, i, j, v: a.index_put_((i,), v[:5, 1], accumulate=True),
        lambda a, i, j, v: torch.ops.aten.index_put_(a, [None, j], v, True),
    ]
    for form in forms:
        want, got = x.clone(), xs.clone()
        form(want, i, j, v)
        form(got, i_s, j_s, vs)
        assert torch.equal(got.cpu(), want)
    assert general == []
    got = xs.clone()
    got[i] = 2.0  # CPU indices next to a device tensor, as CUDA allows: the general path
    want = x.clone()
    want[i] = 2.0
    assert torch.equal(got.cpu(), want) and general


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int32, torch.bool])
def test_whole_tensor_sum_is_the_dim_overload_as_on_cuda(dtype: torch.dtype) -> None:
    from torchport import ops
    x = (torch.randn(5, 7) * 3).to(dtype)
    xs = x.to("sim")
    with ops.record() as rec:
        got = xs.sum()
    assert set(rec.ops) == {"sum.dim_IntList"}  # PyTorch's composite, then a real out= kernel
    assert got.dtype == x.sum().dtype and torch.equal(got.cpu(), x.sum())
    if dtype.is_floating_point:
        g = xs.clone().requires_grad_()
        out = g.sum()
        assert type(out.grad_fn).__name__ == "SumBackward0"
        out.backward()
        assert torch.equal(g.grad.cpu(), torch.ones_like(x))


def test_threads_making_tensors_of_one_layout_get_their_own_blocks() -> None:
    import threading
    b = active_backend()
    alloc = b.allocators[0]
    x = torch.randn(16, 16, device="sim")
    want = (x.cpu() * 2 + 1)
    gc.collect()  # earlier tests' garbage (an exception's frames) must not die mid-count
    before = len(alloc.active)
    errors: list[str] = []

    def work() -> None:
        for _ in range(300):
            outs = [x * 2 + 1 for _ in range(4)]  # one layout, one header, many threads
            ptrs = {o.data_ptr() for o in outs}
            if len(ptrs) != 4 or any(p not in alloc.active for p in ptrs):
                errors.append("two tensors share a block, or a block is not the allocator's")
            if not all(torch.equal(o.cpu(), want) for o in outs):
                errors.append("wrong values")
    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert len(alloc.active) == before


@sync_path
@pytest.mark.parametrize("train", [True, False])
def test_random_functional_ops_draw_once_from_the_device_generator(train: bool) -> None:
    # native_dropout takes the fast path: its first call of a layout (no out= trial) and the
    # later ones draw what the CPU draws from the same seed, and leave the CPU's stream alone
    x = torch.randn(37, 11)
    xs = x.to("sim")
    torch.manual_seed(21)
    want = [torch.ops.aten.native_dropout(x, 0.3, train) for _ in range(3)]
    cpu_state = torch.get_rng_state()
    torch.sim.manual_seed(21)
    got = [torch.ops.aten.native_dropout(xs, 0.3, train) for _ in range(3)]
    assert torch.equal(torch.get_rng_state(), cpu_state)
    for g, w in zip(got, want, strict=True):
        assert all(torch.equal(a.cpu(), b) for a, b in zip(g, w, strict=True))
    kernel = host_kernels_of(torch.ops.aten.native_dropout.default)
    assert kernel and not kernel[0].layouts, "native_dropout took the out= path"


def _bytes_copied_to_device(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    rt = active_backend().runtime
    copied: list[int] = []
    real = rt.copy_h2d

    def spy(index: int, dst: int, src: int, nbytes: int, *rest: object) -> None:
        copied.append(nbytes)
        real(index, dst, src, nbytes, *rest)
    monkeypatch.setattr(rt, "copy_h2d", spy)
    return copied


@pytest.mark.parametrize("op", ["native_dropout", "normal"])
def test_large_results_of_random_ops_are_adopted(op: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # native_dropout takes the random fast path, normal (a generator argument) the general
    # path: both hand their large CPU results to the device without a copy
    if not active_backend().runtime.host_addressable:
        pytest.skip("strict sim memory is not host memory: results are copied")
    x = torch.randn(1 << 20)  # 4 MiB, and a 1 MiB mask
    xs = x.to("sim")
    run = {"native_dropout": lambda t: torch.ops.aten.native_dropout(t, 0.5, True),
           "normal": lambda t: (torch.normal(t, 2.0),)}[op]
    torch.manual_seed(5)
    want = run(x)
    torch.sim.manual_seed(5)
    dm = active_backend().device_module
    segments = dm.memory_stats()["segment.large_pool.current"]
    copied = _bytes_copied_to_device(monkeypatch)
    got = run(xs)
    assert copied == []
    if not (op == "native_dropout" and active_backend().runtime.asynchronous):
        assert dm.memory_stats()["segment.large_pool.current"] == segments + len(got)
    # (else its mask is drawn at the call and the stream computes into device tensors:
    # no CPU result to adopt, and no copy either)
    assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want, strict=True))


# ---- views whose CPU kernel is a composite calling as_strided ------------------------
_VIEWS = {
    "select": lambda t: t.select(1, -2),
    "slice": lambda t: t[:, 1:7:3],
    "permute": lambda t: t.permute(2, 0, 1),
    "expand": lambda t: t[:, :1].expand(-1, 4, -1),
    "unsqueeze": lambda t: t.unsqueeze(-1),
    "squeeze": lambda t: t[:, :1].squeeze(1),
    "squeeze_dims": lambda t: t[:1, :1].squeeze((0, 1)),
    "diagonal": lambda t: t.diagonal(1, 0, 2),
    "unbind": lambda t: t.unbind(2)[3],
}


@pytest.mark.parametrize("name", sorted(_VIEWS))
def test_composite_views_have_the_cpu_layout_and_share_memory(name: str) -> None:
    view = _VIEWS[name]
    base = torch.randn(3, 9, 8, 13)
    dev = base.to("sim")
    # other offsets, and one shape with two stride patterns
    for pick in (lambda t: t[1, 2:, 1:, ::2], lambda t: t[2, :5, :6, 3:9],
                 lambda t: t[0, 2:, 1:, ::2].transpose(0, 2)):
        x, xs = pick(base), pick(dev)
        for _ in range(2):  # the first call of a layout, then the cached one
            want, got = view(x), view(xs)
            assert (got.shape, got.stride(), got.storage_offset()) == \
                (want.shape, want.stride(), want.storage_offset())
            assert got.device == xs.device and got.untyped_storage().data_ptr() == \
                xs.untyped_storage().data_ptr()
            assert torch.equal(got.cpu(), want)
    got.fill_(7.0)  # a view: writes reach the base
    view(pick(base)).fill_(7.0)
    assert torch.equal(dev.cpu(), base)


def test_composite_views_keep_errors_bits_and_autograd() -> None:
    xs = torch.randn(4, 5, device="sim")
    xs[1]  # a cached layout for select(0, 1)
    with pytest.raises(IndexError) as cpu:
        xs.cpu()[7]
    with pytest.raises(IndexError, match=str(cpu.value)):
        xs[7]
    z = torch.randn(4, 3, dtype=torch.complex64)
    zs = z.to("sim").conj()
    for _ in range(2):
        got = zs.permute(1, 0)
        assert got.is_conj() and torch.equal(got.cpu(), z.conj().permute(1, 0))
    w = torch.randn(4, 5, requires_grad=True)
    ws = w.detach().to("sim").requires_grad_()
    for _ in range(2):
        (w.unsqueeze(0).select(1, 2) * 3).sum().backward()
        (ws.unsqueeze(0).select(1, 2) * 3).sum().backward()
    assert torch.equal(ws.grad.cpu(), w.grad)


@pytest.mark.parametrize("name,view", [("select_backward", lambda t: t[:, 2]),
                                       ("slice_backward", lambda t: t[1:5:2]),
                                       ("diagonal_backward", lambda t: t.diagonal(1, 0, 1))])
def test_backward_of_views_is_one_native_op(name: str, view) -> None:
    # their composite kernels would allocate, zero, view and copy on the device: 4 calls
    from torchport.ops import record
    w = torch.randn(6, 7, 5, requires_grad=True)
    ws = w.detach().to("sim").requires_grad_()
    g = torch.randn_like(view(w))
    view(w).backward(g)
    with record() as rec:
        view(ws).backward(g.to("sim"))
    assert torch.equal(ws.grad.cpu(), w.grad)
    ops = json.loads(rec.to_json())["ops"]
    assert ops[name]["paths"] == {"native": 1}
    assert not {"copy_", "zero_", "empty.memory_format"} & set(ops), sorted(ops)


@sync_path
@pytest.mark.parametrize("index", [0, 1])
def test_the_functional_kernels_inlined_output_is_new_output(index: int) -> None:
    # the functional kernel inlines outputs.new_output on its hot path: the same tensor
    from torchport.ops.hostkernels import outputs
    b = active_backend()
    alloc = b.allocators[index]
    for x in (torch.randn(5, 7), torch.randn(6, 4, 3).permute(2, 0, 1),
              torch.randn(3, 1, 4).expand(3, 2, 4), torch.randn(0, 4)):
        d = x.to(f"sim:{index}")
        torch.add(d, d)  # the first call learns the layout
        with torchport.ops.record() as rec:
            got = torch.add(d, d)
        assert rec.subpaths_of("add.Tensor") == {"native:out": 1}
        made = outputs.new_output(b, index, outputs.spec_for(b, got.shape, got.stride(),
                                                             got.dtype))
        assert got.device == made.device == d.device and got.dtype == made.dtype
        assert (made.shape, made.stride(), made.storage_offset()) == \
            (got.shape, got.stride(), got.storage_offset())
        assert made.untyped_storage().nbytes() == got.untyped_storage().nbytes()
        assert made.untyped_storage().device == got.untyped_storage().device
        if got.numel():
            mine, theirs = alloc.active[made.data_ptr()], alloc.active[got.data_ptr()]
            assert (mine.size, mine.requested, mine.stream, mine.small) == \
                (theirs.size, theirs.requested, theirs.stream, theirs.small)
        assert torch.equal(got.cpu(), x + x)
        held = len(alloc.active)
        del got, made  # both blocks go back when the tensors die
        assert len(alloc.active) == held - (2 if x.numel() else 0)


def test_empty_results_stay_on_their_device() -> None:
    # tensors without elements have no address: a cache keyed by address must not give a
    # sim:1 call the entry (and device) of a sim:0 one
    for index in (0, 1):
        d = torch.randn(0, 4).to(f"sim:{index}")
        for _ in range(2):
            for r in (torch.add(d, d), torch.cat([d, d]), (d * 2).sum(0), d.clone(),
                      torch.zeros_like(d)):
                assert r.device == d.device
