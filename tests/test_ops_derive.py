"""Out= kernels: torchport derives the functional and in-place overloads from one kernel."""

from __future__ import annotations

import pytest
import torch

import torchport
from tests.conftest import chip_view
from torchport import ops
from torchport.ops import derive, registry

pytestmark = pytest.mark.modes

A = torch.ops.aten


@pytest.fixture(scope="module")
def hypot_calls():
    """A vendor out= kernel for hypot (sim has none), counting its calls."""
    b = torchport.active_backend()
    calls: list[tuple] = []
    ks = ops.KernelSet("test-derive")

    @ks.out_kernel("hypot.out", dtypes=[torch.float32, torch.float64])
    def hypot_out(self, other, *, out):
        calls.append((tuple(self.shape), tuple(other.shape), tuple(out.shape), out.dtype))
        # the "device" computes on its own views of its memory, in the stream's order (on
        # an asynchronous runtime, after the work queued before the call)
        h = chip_view
        views = h(self), h(other), h(out)
        torchport.launch(out, lambda: torch.hypot(views[0], views[1], out=views[2]), "hypot")
        return out

    done = b.add_kernels(ks)
    yield calls, done
    b.remove_kernels(ks)


def test_declaration_lists_derived_overloads(hypot_calls):
    _, done = hypot_calls
    assert set(done) == {"hypot.out", "hypot", "hypot_"}
    native = ops.native_overloads()
    assert native["hypot"].derived_from == "hypot.out"
    assert native["hypot_"].derived_from == "hypot.out"
    assert native["hypot.out"].kind == "out" and native["hypot.out"].derived_from is None
    assert native["hypot"].dtypes == frozenset({torch.float32, torch.float64})


def test_functional_gets_ready_broadcast_outputs(hypot_calls):
    calls, _ = hypot_calls
    a, c = torch.randn(4, 1), torch.randn(1, 5)
    calls.clear()
    with ops.record() as rec:
        r = torch.hypot(a.to("sim"), c.to("sim"))
    assert calls == [((4, 1), (1, 5), (4, 5), torch.float32)]
    assert rec.path_of("hypot") == "native"
    assert r.device.type == "sim" and torch.equal(r.cpu(), torch.hypot(a, c))


def test_functional_keeps_channels_last_strides(hypot_calls):
    a = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    r = torch.hypot(a.to("sim"), a.to("sim"))
    want = torch.hypot(a, a)
    assert r.stride() == want.stride() and torch.equal(r.cpu(), want)


def test_inplace_writes_self_and_checks_shape(hypot_calls):
    calls, _ = hypot_calls
    a, c = torch.randn(3, 4), torch.randn(4)
    d = a.to("sim")
    calls.clear()
    r = d.hypot_(c.to("sim"))
    assert r is d and torch.equal(d.cpu(), torch.hypot(a, c))
    assert calls[0][2] == (3, 4)
    with pytest.raises(RuntimeError, match="doesn't match the broadcast shape"):
        torch.randn(4, device="sim").hypot_(torch.randn(3, 4, device="sim"))


def test_out_is_resized_to_the_meta_result(hypot_calls):
    a = torch.randn(2, 3)
    out = torch.empty(0, device="sim")
    torch.hypot(a.to("sim"), a.to("sim"), out=out)
    assert out.shape == (2, 3) and torch.equal(out.cpu(), torch.hypot(a, a))


def test_out_that_is_also_an_input_is_checked_as_on_cpu(hypot_calls):
    """The meta kernel sees ``out`` and the input as one tensor: CPU's error, nothing
    resized, even after the same shapes were seen without aliasing (cached specs)."""
    calls, _ = hypot_calls
    a, b = torch.arange(3.0), torch.ones(2, 3)
    with pytest.raises(RuntimeError) as cpu_error:
        torch.hypot(b, a, out=a)
    da, db = a.to("sim"), b.to("sim")
    torch.hypot(db, da, out=torch.empty(3, device="sim"))  # same shapes, no aliasing
    calls.clear()
    with pytest.raises(RuntimeError, match="doesn't match the broadcast shape") as error:
        torch.hypot(db, da, out=da)
    assert str(error.value) == str(cpu_error.value)
    assert calls == [] and da.shape == (3,) and torch.equal(da.cpu(), a)
    torch.hypot(da, da, out=da)  # aliasing at the broadcast shape is fine
    assert torch.equal(da.cpu(), torch.hypot(a, a))


def test_other_dtypes_decline_to_the_next_path(hypot_calls):
    calls, _ = hypot_calls
    a = torch.randn(3).half()
    calls.clear()
    with ops.record() as rec:
        r = torch.hypot(a.to("sim"), a.to("sim"))
    assert calls == []
    assert rec.ops["hypot"].declined == 1
    assert torch.equal(r.cpu(), torch.hypot(a, a))


def test_derivation_rules_from_schemas():
    assert derive.functional_overloads(A.add.out) == [A.add.Tensor]
    assert derive.inplace_overloads(A.add.out) == [A.add_.Tensor]
    assert derive.functional_overloads(A.max.dim_max) == [A.max.dim]
    assert derive.inplace_overloads(A.max.dim_max) == []
    assert registry.overload_name(A.mm.default) == "mm"
    with pytest.raises(ValueError, match="no out= overload"):
        registry._expand(ops.KernelDecl("mm.default", lambda *a: None, kind="out"))


def _raises_as_on_cpu(fn, cpu_args, dev_args):
    with pytest.raises(RuntimeError) as cpu_error:
        fn(*cpu_args)
    with pytest.raises(type(cpu_error.value)) as error:
        fn(*dev_args)
    assert type(error.value) is type(cpu_error.value)
    assert str(error.value) == str(cpu_error.value)
    return str(error.value)


def test_inplace_partial_overlap_raises_as_on_cpu(hypot_calls):
    calls, _ = hypot_calls
    a = torch.randn(4, 4)
    d = a.to("sim")
    calls.clear()
    msg = _raises_as_on_cpu(lambda x: x.hypot_(x.t()), [a.clone()], [d])
    assert "some elements of the input tensor and the written-to tensor" in msg
    assert calls == [] and torch.equal(d.cpu(), a)  # nothing written


def test_out_partial_overlap_raises_as_on_cpu(hypot_calls):
    calls, _ = hypot_calls
    x = torch.randn(5)
    d = x.to("sim")
    calls.clear()
    msg = _raises_as_on_cpu(lambda t: torch.hypot(t[:-1], t[:-1], out=t[1:]), [x.clone()], [d])
    assert "some elements of the input tensor" in msg
    # another partial overlap, where the meta result's shape differs from out's
    _raises_as_on_cpu(lambda t: torch.hypot(t, t, out=t[1:]), [x.clone()], [d])
    assert calls == [] and torch.equal(d.cpu(), x)


def test_expanded_out_raises_as_on_cpu(hypot_calls):
    calls, _ = hypot_calls
    x, c = torch.randn(4), torch.randn(3, 4)
    d, dc = x.to("sim"), c.to("sim")
    calls.clear()
    msg = _raises_as_on_cpu(lambda t, u: torch.hypot(u, u, out=t.expand(3, 4)), [x, c],
                            [d, dc])
    assert "more than one element of the written-to tensor" in msg
    _raises_as_on_cpu(lambda t, u: t.expand(3, 4).hypot_(u), [x, c], [d, dc])
    assert calls == [] and torch.equal(d.cpu(), x)


def test_full_overlap_and_strided_outputs_still_work(hypot_calls):
    calls, _ = hypot_calls
    a, c = torch.randn(4, 4), torch.randn(4, 4)
    d, dc = a.to("sim"), c.to("sim")
    calls.clear()
    assert d.hypot_(d) is d and torch.equal(d.cpu(), torch.hypot(a, a))
    a = d.cpu()
    torch.hypot(d, dc, out=d)  # out= is an input, same memory: allowed
    assert torch.equal(d.cpu(), torch.hypot(a, c))
    a = d.cpu()
    torch.hypot(d.view(16), dc.view(16), out=d.view(16))  # another tensor, same memory
    assert torch.equal(d.cpu(), torch.hypot(a, c))
    out = torch.zeros(4, 8, device="sim")
    torch.hypot(d, dc, out=out[:, ::2])  # strided, no overlap with the inputs
    want = torch.zeros(4, 8)
    want[:, ::2] = torch.hypot(d.cpu(), c)
    assert torch.equal(out.cpu(), want) and len(calls) == 4


def test_plain_layouts_skip_the_cpu_check(hypot_calls):
    a, c = torch.randn(3, 5, device="sim"), torch.randn(3, 5, device="sim")
    out = torch.empty(3, 5, device="sim")
    derive._OVERLAP.clear()
    torch.hypot(a, c, out=out)
    a.hypot_(c)
    torch.hypot(a, c)
    assert derive._OVERLAP == {}
    a.hypot_(a)  # full overlap: asks the CPU once per layout
    a.hypot_(a)
    assert list(derive._OVERLAP.values()) == [None]


def test_overlap_of_an_index_op_is_found_whatever_the_made_up_indices():
    """The CPU's overlap check runs before it reads an index; the run without aliasing
    then fails on the made-up index values (bytes of ones: out of range) with another
    error. The overlap error is still the CPU's verdict."""
    a, i = torch.randn(6), torch.tensor([0, 2, 1])
    with pytest.raises(RuntimeError) as cpu_error:
        torch.index_select(a, 0, i, out=a[:3])
    err = derive._cpu_overlap_error(A.index_select.out, (a, 0, i), {"out": a[:3]})
    assert err == (type(cpu_error.value), str(cpu_error.value))
    # an out= of its own memory: both runs fail on the indices alike, no overlap error
    assert derive._cpu_overlap_error(A.index_select.out, (a, 0, i),
                                     {"out": torch.empty(3)}) is None


def test_output_specs_key_floats_by_type_where_the_op_reads_a_tensor(monkeypatch):
    """A learning rate that changes every step runs no meta kernel again (its value decides
    no layout of an op reading a tensor); an op reading none keeps the values in its key
    (``arange``'s length is a float's)."""
    ran: list[object] = []
    real = derive._meta_result

    def counted(op, args, kwargs):
        ran.append(op)
        return real(op, args, kwargs)

    monkeypatch.setattr(derive, "_meta_result", counted)
    a = torch.randn(3, 5, device="sim")
    for lr in (0.125, 0.25, 0.5):
        ((shape, _, dtype),) = derive.output_specs(A.add.Tensor, (a, a), {"alpha": lr})
        assert shape == (3, 5) and dtype == torch.float32
    assert ran == [A.add.Tensor]
    ((shape, _, dtype),) = derive.output_specs(A.add.Tensor, (a, a), {"alpha": 2})
    assert len(ran) == 2  # an integer: its value (and its type) is another key
    out = torch.empty(0, device="sim")
    for end, n in ((4.5, 5), (6.5, 7)):
        ((shape, _, _),) = derive.output_specs(A.arange.out, (end,), {"out": out})
        assert shape == (n,)


def test_a_meta_kernels_error_is_raised_in_the_kernels_words(hypot_calls):
    # hypot's meta kernel is a Python reference, whose broadcast error is worded otherwise
    # than ATen's: the call takes the next path, whose CPU kernel raises the CPU's error
    calls, _ = hypot_calls
    a, b = torch.randn(3), torch.randn(4)
    with pytest.raises(RuntimeError) as cpu:
        torch.hypot(a, b)
    assert "must match the size of tensor b" in str(cpu.value)
    calls.clear()
    for call in (lambda x, y: torch.hypot(x, y),
                 lambda x, y: torch.hypot(x, y, out=torch.empty(3, device="sim"))):
        with pytest.raises(RuntimeError) as dev:
            call(a.to("sim"), b.to("sim"))
        assert str(dev.value) == str(cpu.value)
    assert calls == []
    old = ops.set_fallback_enabled(False)
    try:  # no CPU kernel to ask: the meta kernel's own error, not "the fallback is off"
        with pytest.raises(RuntimeError, match="Attempting to broadcast a dimension"):
            torch.hypot(a.to("sim"), b.to("sim"))
    finally:
        ops.set_fallback_enabled(old)
