"""The op layer: forced fallback, fallback off, warnings, Decline, decompositions, statistics."""

import json
import warnings

import pytest
import torch

import torchport.ops as ops
from tests.conftest import chip_view
from tests.helpers import mode_independent, run_python
from torchport.ops import fallback, registry, stats
from torchport.ops.fallback import FallbackWarning
from torchport.ops.plan import plan_for

pytestmark = pytest.mark.strict

A = torch.ops.aten


@pytest.fixture(autouse=True)
def _clean_settings():
    old_force = ops.set_force_fallback([])
    old_enabled = ops.set_fallback_enabled(True)
    old_warn = ops.set_fallback_warn(False)
    yield
    ops.set_force_fallback(old_force)
    ops.set_fallback_enabled(old_enabled)
    ops.set_fallback_warn(old_warn)


def test_flags_off_by_default():
    assert not fallback.SLOW and not stats.ENABLED


def test_force_fallback_at_runtime():
    a, b = torch.randn(8, device="sim"), torch.randn(8, device="sim")
    with ops.record() as rec:
        c = a + b
    assert rec.path_of("add.Tensor") == "native"
    ops.set_force_fallback([r"add\.Tensor", r".*\.Scalar"])
    assert fallback.SLOW
    with ops.record() as rec:
        d = a + b
        e = a.mul(2.0)
        f = a.sub(b)
    assert rec.path_of("add.Tensor") == "fallback"
    assert rec.path_of("mul.Scalar") in ("fallback", None)  # may reach us as mul.Tensor
    assert rec.path_of("sub.Tensor") == "native"
    assert torch.equal(c.cpu(), d.cpu()) and torch.equal(e.cpu(), a.cpu() * 2)
    assert torch.equal(f.cpu(), a.cpu() - b.cpu())
    ops.set_force_fallback(None)
    assert not fallback.SLOW


def test_force_fallback_matches_in_full():
    ops.set_force_fallback("add")  # not add.Tensor
    assert not fallback.is_forced("add.Tensor") and fallback.is_forced("add")
    ops.set_force_fallback(r"add\..*")
    assert fallback.is_forced("add.Tensor") and fallback.is_forced("add.out")
    assert not fallback.is_forced("addmm")
    with pytest.raises(ValueError, match="bad regular expression"):
        ops.set_force_fallback(["("])


def test_force_fallback_env():
    r = run_python("import torch, torchport.sim, torchport.ops as o\n"
                   "a = torch.ones(3, device='sim')\n"
                   "with o.record() as rec:\n    a + a\n    a * a\n"
                   "print(rec.path_of('add.Tensor'), rec.path_of('mul.Tensor'))",
                   TORCHPORT_FORCE_FALLBACK_OPS=r"add\..*, foo", TORCHPORT_FALLBACK_WARN="0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["fallback", "native"]


def test_fallback_off_raises_with_op_and_dtypes():
    ops.set_fallback_enabled(False)
    x = torch.randn(4, device="sim", dtype=torch.float64)
    with pytest.raises(NotImplementedError, match=r"bessel_j0.*float64.*TORCHPORT_FALLBACK=0"):
        torch.special.bessel_j0(x)
    ops.set_force_fallback([r"add\.Tensor"])  # an explicitly forced op still runs
    assert torch.equal((x + x).cpu(), x.cpu() * 2)


def test_fallback_off_env():
    r = run_python("import torch, torchport.sim\n"
                   "x = torch.ones(3, device='sim')\n"
                   "try:\n    torch.special.bessel_j0(x)\nexcept NotImplementedError as e:\n"
                   "    print('raised', e)\n", TORCHPORT_FALLBACK="0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("raised special_bessel_j0")


def test_fallback_warns_once_per_op():
    ops.set_fallback_warn(True)
    fallback._WARNED.discard("special_bessel_y0.out")
    x = torch.rand(4, device="sim") + 0.5
    with pytest.warns(FallbackWarning, match="special_bessel_y0.out"):
        torch.special.bessel_y0(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.special.bessel_y0(x)
    ops.set_fallback_warn(False)
    fallback._WARNED.discard("special_bessel_y1.out")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.special.bessel_y1(x)


def test_views_are_not_fallbacks():
    ops.set_fallback_enabled(False)
    x = torch.randn(4, 4, device="sim")
    with ops.record() as rec:
        u = x.unfold(0, 2, 1)
    assert u.device.type == "sim"
    assert rec.path_of("unfold") == "view"


def _sim():
    import torchport.sim
    return torchport.sim.BACKEND


def test_decline_takes_decomposition_then_fallback():
    def declining(*args, **kwargs):
        raise ops.Decline("not this input")

    b = _sim()
    x = torch.randn(6, device="sim")
    k = registry.wrap_kernel(b, A.hardshrink.default, declining)
    with ops.record() as rec:
        r = k(x, 0.5)
    assert torch.equal(r.cpu(), torch.nn.functional.hardshrink(x.cpu(), 0.5))
    assert rec.path_of("hardshrink") == "decomposed" and rec.ops["hardshrink"].declined == 1
    k2 = registry.wrap_kernel(b, A.special_bessel_j0.default, declining)
    r2 = k2(x)  # no decomposition: CPU fallback
    assert torch.equal(r2.cpu(), torch.special.bessel_j0(x.cpu()))
    with ops.record() as rec:
        k2(x)
    assert rec.path_of("special_bessel_j0") == "fallback"


def test_a_wrapped_kernel_is_forced_to_the_cpu_like_a_native_one():
    calls = []

    def wrong(x, lambd=0.5):
        calls.append(1)
        return x * 0

    k = registry.wrap_kernel(_sim(), A.hardshrink.default, wrong)
    x = torch.randn(6, device="sim")
    old = ops.set_force_fallback(["hardshrink"])
    try:
        with ops.record() as rec:
            r = k(x, 0.5)
    finally:
        ops.set_force_fallback(old)
    assert calls == [] and rec.path_of("hardshrink") == "fallback"
    assert torch.equal(r.cpu(), torch.nn.functional.hardshrink(x.cpu(), 0.5))
    assert torch.equal(k(x, 0.5).cpu(), torch.zeros(6)) and calls == [1]


def test_declared_dtypes_decline_others():
    b = _sim()
    decl = ops.KernelDecl("neg", None, chip_view, frozenset({torch.float32}))
    k = registry._host_kernel(b, A.neg.default, "neg", decl, fallback.Route("neg"))
    x32 = torch.randn(3, device="sim")
    x64 = x32.double()
    with ops.record() as rec:
        assert torch.equal(k(x32).cpu(), -x32.cpu())
        assert torch.equal(k(x64).cpu(), -x64.cpu())
    assert rec.ops["neg"].paths == {"native": 1, "fallback": 1}
    assert rec.ops["neg"].declined == 1


def test_decomposition_used_and_matches_cpu():
    c = torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    d = tuple(t.to("sim") for t in c)
    with ops.record() as rec:
        r = torch.logaddexp(*d)
    assert rec.path_of("logaddexp.out") == "decomposed"
    assert rec.ops["exp"].paths.get("native")
    torch.testing.assert_close(r.cpu(), torch.logaddexp(*c))


def test_decomposed_functional_op_returns_a_new_tensor():
    """``take``'s decomposition (``flat[index]``) selects a view of its input for a 0-dim
    index; the op's result must be a new tensor, as its kernels make it (the gradients of
    ``put``'s two inputs shared one buffer through it, and accumulated into each other)."""
    from torchport.ops import paths

    paths.forget_decisions()  # the decision follows the first call: a 1-d index
    x = torch.arange(6.0, device="sim").view(2, 3)
    with ops.record() as rec:
        assert x.take(torch.tensor([4, 1], device="sim")).cpu().tolist() == [4.0, 1.0]
    assert rec.path_of("take") == "decomposed"
    s = torch.tensor(3.0, device="sim")
    r = s.take(torch.tensor(0, device="sim"))
    assert r.untyped_storage().data_ptr() != s.untyped_storage().data_ptr()
    r.add_(1)
    assert s.item() == 3.0 and r.item() == 4.0
    a = torch.tensor(2.0, device="sim", requires_grad=True)
    b = torch.tensor(5.0, device="sim", requires_grad=True)
    torch.put(a, torch.tensor(0, device="sim"), b, True).sum().backward()
    first = a.grad
    a.grad = None
    a.put(torch.tensor(0, device="sim"), b, True).sum().backward()
    assert (first.item(), a.grad.item(), b.grad.item()) == (1.0, 1.0, 2.0)


def test_decomposition_skipped_when_a_piece_falls_back():
    d = torch.randn(8, device="sim"), torch.randn(8, device="sim")
    ops.set_force_fallback([r"log1p"])
    with ops.record() as rec:
        r = torch.logaddexp(*d)
    assert rec.path_of("logaddexp.out") == "fallback"
    torch.testing.assert_close(r.cpu(), torch.logaddexp(d[0].cpu(), d[1].cpu()))


def test_record_table_and_json():
    x = torch.randn(4, 4, device="sim")
    with ops.record() as rec:
        y = (x @ x).relu()
        torch.special.bessel_j0(y[0].double())
    assert not stats.ENABLED
    text = rec.table()
    assert "mm" in text and "relu" in text and "fallback" in text
    data = json.loads(rec.to_json())
    assert data["ops"]["mm"]["calls"] == 1 and data["ops"]["mm"]["paths"] == {"native": 1}
    assert data["ops"]["mm"]["dtypes"] == ["float32"]
    assert data["ops"]["special_bessel_j0.out"]["dtypes"] == ["float64"]
    assert data["totals"]["fallback"] >= 1 and data["totals"]["native"] >= 2
    assert all(s["host_time_s"] >= 0 for s in data["ops"].values())


def test_nested_recorders():
    x = torch.randn(3, device="sim")
    with ops.record() as outer:
        x.neg()
        with ops.record() as inner:
            x.neg()
    assert outer.ops["neg"].calls == 2 and inner.ops["neg"].calls == 1


@mode_independent
def test_op_stats_env_prints_at_exit():
    r = run_python("import torch, torchport.sim\nx = torch.ones(3, device='sim')\n(x * 2).sum()\n",
                   TORCHPORT_OP_STATS="1")
    assert r.returncode == 0, r.stderr
    assert "torchport op statistics" in r.stderr and "mul.Tensor" in r.stderr


def test_core_aten_opset_is_native():
    missing = []
    for name in dir(A):
        packet = getattr(A, name)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        for ov in packet.overloads():
            op = getattr(packet, ov)
            if torch.Tag.core not in op.tags or not registry._has_backend_slot(op):
                continue
            full = op._schema.name + ("." + ov if ov != "default" else "")
            has = torch._C._dispatch_has_kernel_for_dispatch_key
            # a composite view (select, expand...) runs PyTorch's composite kernel while
            # the C++ view kernels serve: metadata only, never the fallback
            if not has(full, "PrivateUse1") and not (
                    plan_for(op).is_view and has(full, "CompositeExplicitAutograd")):
                missing.append(full)
    assert not missing, missing


def test_decomposition_result_lands_in_out():
    # replication_pad1d.out's decomposition computes bf16 in float32 and returns a new
    # tensor instead of filling out=; the op layer copies it where the schema says.
    c = torch.randn(1, 3).bfloat16()
    with ops.record() as rec:
        r = torch.nn.functional.pad(c.to("sim"), (1, 2), "replicate")
    assert rec.path_of("replication_pad1d.out") == "decomposed"
    assert torch.equal(r.cpu(), torch.nn.functional.pad(c, (1, 2), "replicate"))


def test_empty_inplace_keeps_shape():
    x = torch.empty(0, 5, 0, device="sim")
    assert torch.rand_like(x).shape == (0, 5, 0)
    assert x.uniform_().shape == (0, 5, 0)
    out = torch.empty(0, device="sim")
    torch.add(torch.ones(2, 3, device="sim"), 1, out=out)
    assert out.shape == (2, 3)
