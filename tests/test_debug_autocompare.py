"""Autocompare: device ops re-run on the CPU and compared (the CPU is the oracle)."""

import os

import pytest
import torch

import torchport.ops as ops
from tests.helpers import run_python
from torchport.ops import fallback, hooks, registry
from torchport.tools import debug
from torchport.tools.debug.crosscheck import AutocompareMismatchError, AutocompareReport

pytestmark = pytest.mark.tools

A = torch.ops.aten


@pytest.fixture(autouse=True)
def _quiet():
    old = ops.set_fallback_warn(False)
    yield
    ops.set_fallback_warn(old)


@pytest.fixture
def kernel(sim_backend):
    """Register a test kernel for an overload (through the op layer's wrapper); removed after."""
    libs = []

    def register(name: str, op, fn):
        lib = torch.library.Library("aten", "IMPL")
        lib.impl(name, registry.wrap_kernel(sim_backend, op, fn), "PrivateUse1")
        libs.append(lib)

    yield register
    for lib in libs:
        lib._destroy()


def _hardshrink_cpu(x, lambd=0.5):
    return torch.nn.functional.hardshrink(x.cpu(), lambd).to(x.device)


def test_catches_wrong_kernel_passes_correct_ones(kernel):
    kernel("hardshrink", A.hardshrink.default, lambda x, lambd=0.5: _hardshrink_cpu(x, lambd) * 1.5)
    x = torch.randn(6, device="sim")
    with debug.autocompare() as rep:
        y = (x + 1).mul(2).relu()
        h = torch.nn.functional.hardshrink(y - 2.0, 0.5)
    assert isinstance(rep, AutocompareReport)
    assert rep.mismatched_ops == ["hardshrink"]
    m = rep.mismatches[0]
    assert m.kind == "value" and m.what == "output 0" and m.path == "native"
    assert m.max_abs > 0 and m.max_rel == pytest.approx(0.5) and 0 < m.mismatched <= 6
    assert "float32[6]" in m.args and "stride=(1,)" in m.args
    assert rep.compared["add.Tensor"] == 1 and rep.compared["relu"] == 1
    assert "hardshrink" in rep.summary() and "1 mismatches" in rep.summary()
    assert h.shape == (6,)
    assert not fallback.SLOW and not hooks.ACTIVE  # off again after the block


def test_correct_kernel_no_mismatch(kernel):
    kernel("hardshrink", A.hardshrink.default, _hardshrink_cpu)
    x = torch.randn(4, 5, device="sim")
    with debug.autocompare() as rep:
        torch.nn.functional.hardshrink(x, 0.3)
        (x @ x.t()).sum(1).softmax(0)
        torch.special.bessel_j0(x.double())  # CPU fallback path, compared too
    assert rep.ok and rep.calls >= 5, rep.summary()
    assert "hardshrink" in rep.compared and "special_bessel_j0.out" in rep.compared


def test_raise_on_mismatch(kernel):
    kernel("hardshrink", A.hardshrink.default, lambda x, lambd=0.5: _hardshrink_cpu(x, lambd) + 1)
    x = torch.randn(5, device="sim")
    with pytest.raises(AutocompareMismatchError, match=r"hardshrink.*output 0.*float32\[5\]"):
        with debug.autocompare(raise_on_mismatch=True):
            torch.nn.functional.hardshrink(x)
    assert issubclass(AutocompareMismatchError, RuntimeError)
    assert not hooks.ACTIVE


def test_input_scribbled_on_is_caught(kernel):
    def scribble(x, lambd=0.5):
        r = _hardshrink_cpu(x, lambd)
        x.add_(1)  # writes an input the schema says is read-only
        return r

    kernel("hardshrink", A.hardshrink.default, scribble)
    x = torch.randn(6, device="sim")
    with debug.autocompare() as rep:
        torch.nn.functional.hardshrink(x)
    kinds = {(m.what, m.kind) for m in rep.mismatches}
    assert ("argument self (must not be written)", "input modified") in kinds


def test_written_argument_compared(kernel):
    def bad_out(x, lambd=0.5, *, out):
        out.copy_(_hardshrink_cpu(x, lambd))
        out[0] = 42.0
        return out

    kernel("hardshrink.out", A.hardshrink.out, bad_out)
    x = torch.randn(6, device="sim")
    o = torch.empty(6, device="sim")
    with debug.autocompare() as rep:
        A.hardshrink.out(x, 0.5, out=o)
    assert [m.what for m in rep.mismatches] == ["argument out (written)"]
    assert rep.mismatches[0].mismatched == 1


def test_inplace_and_out_ops_pass():
    x = torch.randn(8, device="sim")
    o = torch.empty(0, device="sim")
    with debug.autocompare() as rep:
        x.add_(1).mul_(0.5)
        torch.add(x, x, out=o)
        x.copy_(o)
        x[2:5] = 3.0
    assert rep.ok, rep.summary()
    assert rep.compared.get("add.out") == 1 and rep.compared.get("add_.Tensor") == 1


def test_random_ops_skipped_with_reason():
    x = torch.ones(100, device="sim")
    with debug.autocompare() as rep:
        torch.rand(10, device="sim")
        torch.nn.functional.dropout(x, 0.5, training=True)
    assert rep.ok
    reasons = {r for (_, r) in rep.skipped}
    assert "random op" in reasons
    assert any(op.startswith(("rand", "bernoulli", "native_dropout"))
               for (op, r) in rep.skipped if r == "random op")
    assert "random op" in rep.summary()


def test_backward_ops_compared(kernel):
    def bad_backward(grad, x, lambd):
        return torch.ops.aten.hardshrink_backward(grad.cpu(), x.cpu(), lambd).to(grad.device) * 3

    kernel("hardshrink_backward", A.hardshrink_backward.default, bad_backward)
    x = torch.randn(6, device="sim", requires_grad=True)
    w = torch.randn(6, 6, device="sim", requires_grad=True)
    with debug.autocompare() as rep:
        y = torch.nn.functional.hardshrink(x @ w, 0.1)
        y.sum().backward()
    assert rep.mismatched_ops == ["hardshrink_backward"]
    assert "mm" in rep.compared  # the matmul backward ran on the device and was checked


def test_ops_filter_and_tolerances(kernel):
    kernel("hardshrink", A.hardshrink.default, lambda x, lambd=0.5: _hardshrink_cpu(x, lambd) * 1.01)
    x = torch.randn(6, device="sim")
    with debug.autocompare(ops=r"add\..*") as rep:
        (x + 1).relu()
        torch.nn.functional.hardshrink(x)
    assert set(rep.compared) == {"add.Tensor"} and rep.ok
    with debug.autocompare(ops="hardshrink", rtol=0.05, atol=0.0) as rep:
        torch.nn.functional.hardshrink(x)
    assert rep.ok and rep.compared == {"hardshrink": 1}
    with debug.autocompare(ops="hardshrink") as rep:
        torch.nn.functional.hardshrink(x)
    assert not rep.ok
    with pytest.raises(ValueError, match="bad regular expression"):
        with debug.autocompare(ops="("):
            pass


def test_hooks_do_not_intercept_tool_ops():
    seen, passive = [], []

    def spy(call, run):
        seen.append((call.name, call.depth))
        with hooks.suspended():
            [a.cpu() for a in call.args if isinstance(a, torch.Tensor)]  # not intercepted
        return run()

    def watcher(call, run):
        passive.append(call.name)
        return run()

    xd = torch.randn(3, device="sim", dtype=torch.float64)
    hooks.register(spy)
    hooks.register(watcher)
    try:
        assert fallback.SLOW
        torch.logaddexp(xd, xd)  # decomposed: its pieces are nested calls
    finally:
        hooks.unregister(spy)
        hooks.unregister(watcher)
    assert not fallback.SLOW and not hooks.ACTIVE
    names = [n for n, _ in seen]
    assert "logaddexp.out" in names and names == passive  # the spy's .cpu() calls unseen
    assert "_to_copy" not in names
    assert any(d > 0 for _, d in seen) and seen[names.index("logaddexp.out")][1] == 0


def test_env_variable_reports_at_exit():
    code = ("import torch, torchport.sim\n"
            "x = torch.randn(4, device='sim')\n"
            "(x * 2 + 1).relu().sum()\n")
    env = {**os.environ, "TORCHPORT_AUTOCOMPARE": r"mul\..*, relu", "TORCHPORT_FALLBACK_WARN": "0"}
    r = run_python(code, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "torchport autocompare: 2 calls of 2 ops compared" in r.stderr
    assert "0 mismatches" in r.stderr
