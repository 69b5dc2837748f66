"""The reference backend (device ``ref``) under the suites that compare with the CPU: what
they found, kept as tests.

* A vendor's derived ``out=``/functional/in-place kernel is promised device tensors of the
  call's device (0-dim CPU inputs aside): a CPU ``out=``, a CPU input of several elements or
  tensors on two devices take the next path, which raises CUDA's device error (the fuzzer's
  ``out:cpu*`` steps: ``ref`` raised ``ValueError`` from the kernel's address lookup, and
  resized the CPU ``out`` first; tensors on ``ref:0`` and ``ref:1`` were accepted).
* A Python meta kernel's error is not the kernel's verdict: the next path raises the CPU's
  error, class and words (``sub(int, int, alpha=0.5)``'s ``ValueError``, the fuzzer's
  ``seq:sub-alpha``; ``mm``'s shape check).
* An ``out=`` over an input's elements raises the CPU's overlap error (PyTorch's
  ``test_errors_cat``/``test_errors_take``: the fallback copied each argument alone).
* An ``out=`` of another dtype than the result's computes in the result's dtype and casts,
  or raises, as the CPU's kernel (the fuzzer's ``out:dtype`` steps: ``ref`` wrote unrounded
  float32 products into a float64 ``out=``, and negated a half tensor into a double one).
* A few fuzz programs on ``ref``, compared within tolerance (``--backend``); the
  ``make test-vendor`` run draws hundreds.

One backend per process and this one has the sim: the ``ref`` code runs in a child.
"""

from __future__ import annotations

import textwrap

import pytest

from tests.helpers import check_python, child_env

pytestmark = pytest.mark.vendor

DEVICE_CHECKS = """
import torch, torchport
import torchport.backends.reference  # noqa: F401
torchport.ops.set_fallback_warn(False)
t = torch.randn(3, 4, device="ref")
on1 = torch.randn(3, 4, device="ref:1")
u = torch.ones(3, 4, device="ref")
# name: (the call, given the out= tensor; a good call of the same op; the out= tensor)
cases = {
    "add out=cpu 0-dim": (lambda o: torch.add(t, 1.0, out=o),
                          lambda: torch.add(t, 1.0, out=torch.empty(3, 4, device="ref")),
                          lambda: torch.tensor(5.0)),
    "add out=cpu": (lambda o: torch.add(t, 1.0, out=o),
                    lambda: torch.add(t, 1.0, out=torch.empty(3, 4, device="ref")),
                    lambda: torch.full((3, 4), 5.0)),
    "mul out=cpu": (lambda o: torch.mul(t, 2, out=o),
                    lambda: torch.mul(t, 2, out=torch.empty(3, 4, device="ref")),
                    lambda: torch.full((3, 4), 5.0)),
    "sum out=cpu": (lambda o: torch.sum(t, 0, out=o),
                    lambda: torch.sum(t, 0, out=torch.empty(4, device="ref")),
                    lambda: torch.full((4,), 5.0)),
    "mm out=cpu": (lambda o: torch.mm(t, t.T, out=o),
                   lambda: torch.mm(t, t.T, out=torch.empty(3, 3, device="ref")),
                   lambda: torch.full((3, 3), 5.0)),
    "add out=ref:1": (lambda o: torch.add(t, 1.0, out=o),
                      lambda: torch.add(t, 1.0, out=torch.empty(3, 4, device="ref")),
                      lambda: torch.zeros(3, 4, device="ref:1")),
    "add cpu input": (lambda o: torch.add(t, torch.ones(3, 4)), lambda: t + u, None),
    "add_ cpu input": (lambda o: t.clone().add_(torch.ones(3, 4)), lambda: t.clone().add_(u),
                       None),
    "mm cpu input": (lambda o: torch.mm(t, torch.ones(4, 2)), lambda: t @ t.T, None),
    "add ref:1 input": (lambda o: torch.add(t, on1), lambda: t + u, None),
    "add_ ref:1 input": (lambda o: t.clone().add_(on1), lambda: t.clone().add_(u), None),
}
for name, (call, good, make_out) in cases.items():
    for _ in range(2):  # the second call meets whatever the first one planned
        good()
        out = make_out() if make_out is not None else None
        before = None if out is None else out.cpu().clone()
        try:
            call(out)
        except RuntimeError as e:
            assert "Expected all tensors to be on the same device" in str(e), (name, str(e))
        else:
            raise AssertionError(f"{name}: no error (CUDA raises)")
        if out is not None:
            assert out.shape == before.shape and torch.equal(out.cpu(), before), name
assert torch.equal((t + torch.tensor(2.0)).cpu(), t.cpu() + 2)  # a wrapped number is fine
# the CPU's error where the Python meta kernel raises ValueError (a float alpha, int tensors)
i = torch.ones(2, 3, dtype=torch.int64, device="ref")
for call in (lambda: torch.sub(i, i, alpha=0.5), lambda: i.clone().add_(i, alpha=0.5),
             lambda: torch.add(i, i, alpha=0.5, out=torch.empty_like(i)),
             lambda: torch.sub(i[:0], i[:0], alpha=0.5)):
    try:
        call()
    except RuntimeError as e:
        assert "alpha must not be a floating point number" in str(e), str(e)
    else:
        raise AssertionError("a float alpha with integer tensors: no error")
# an out= over an input's elements: the fallback's CPU kernel sees the overlap (one host copy
# per device storage) and raises, and the inputs keep their values; mm's meta kernel words a
# shape error otherwise than ATen: the CPU's words
y, z, ind = torch.randn(4, 6, device="ref"), torch.randn(4, 6, device="ref"), \
    torch.tensor([2, 1, 0], device="ref")
for call, kept in ((lambda: torch.cat((y, z), out=z[:2, :]), z),
                   (lambda: torch.take(ind.clone(), ind[1:], out=ind[:-1]), ind),
                   (lambda: torch.mm(y, z), y)):
    before = kept.cpu()
    try:
        call()
    except RuntimeError as e:
        assert "refer to a single memory location" in str(e) or \
            "mat1 and mat2 shapes cannot be multiplied" in str(e), str(e)
    else:
        raise AssertionError("no error (the CPU raises)")
    assert torch.equal(kept.cpu(), before)
# an in-place kernel whose result type does not cast to self's dtype (the derived in-place
# overload asked only the in-place meta kernel, which does not check it): the CPU's error,
# self unchanged; twice, the second call meeting what the first planned
for make, other in ((lambda: torch.ones(3, dtype=torch.int32, device="ref"),
                     torch.full((3,), 1.5, device="ref")),
                    (lambda: torch.ones(3, dtype=torch.bool, device="ref"), 2)):
    for _ in range(2):
        x = make()
        try:
            x.mul_(other)
        except RuntimeError as e:
            assert "can't be cast to the desired output type" in str(e), str(e)
        else:
            raise AssertionError("an in-place result type that does not cast: no error")
        assert torch.equal(x.cpu(), make().cpu())
print("ok")
"""


def test_vendor_kernels_get_tensors_of_the_call_device_only() -> None:
    """CUDA's device errors, and nothing written, for tensors the kernel may not read."""
    out = check_python(textwrap.dedent(DEVICE_CHECKS), timeout=300,
                       env=child_env(drop=("TORCHPORT_SIM_STRICT", "TORCHPORT_SIM_ASYNC",
                                           "TORCHPORT_AUTOLOAD"), importable=True,
                                     OMP_NUM_THREADS="1"))
    assert out.strip().endswith("ok")


OWN_KERNEL_OPS = """
import torch, torchport
import torchport.backends.reference  # noqa: F401
from torchport.ops import plan
torchport.ops.set_fallback_warn(False)
assert {"native_layer_norm", "native_group_norm", "addr"} <= set(plan.composite_elsewhere())
torch.manual_seed(0)
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    x, w, b = torch.randn(2, 6, 5).to(dtype), torch.randn(6).to(dtype), torch.randn(6).to(dtype)
    calls = {
        "group_norm": lambda d: torch.nn.functional.group_norm(
            x.to(d), 3, w.to(d), b.to(d)),
        "native_group_norm": lambda d: torch.ops.aten.native_group_norm(
            x.to(d), w.to(d), b.to(d), 2, 6, 5, 3, 1e-5),
        "layer_norm": lambda d: torch.nn.functional.layer_norm(x.to(d), (5,)),
        "layer_norm of one element": lambda d: torch.nn.functional.layer_norm(
            x[:1, :1, :1].to(d) * 100, (1,)),
    }
    with torchport.ops.record(composites=True) as rec:
        for name, call in calls.items():
            want, got = call("cpu"), call("ref")
            for w_, g in zip(want if isinstance(want, tuple) else (want,),
                             got if isinstance(got, tuple) else (got,), strict=True):
                assert g.dtype == w_.dtype and torch.equal(g.cpu(), w_), (name, dtype)
    paths = {n: rec.path_of(n) for n in rec.ops}
    assert "composite" not in (paths.get("native_group_norm"), paths.get("native_layer_norm")), paths
print("ok")
"""


def test_ops_with_their_own_cpu_and_cuda_kernels_compute_as_those() -> None:
    """``native_group_norm``/``native_layer_norm`` have CPU and CUDA kernels that accumulate
    in float32; other devices got PyTorch's composite, computing in the input's dtype
    (float16 group norm 0.006 off, a float32 layer norm of one element 1e-4). Without a
    kernel of its own the device now takes the CPU's, bit for bit."""
    out = check_python(textwrap.dedent(OWN_KERNEL_OPS), timeout=300,
                       env=child_env(drop=("TORCHPORT_SIM_STRICT", "TORCHPORT_SIM_ASYNC",
                                           "TORCHPORT_AUTOLOAD"), importable=True,
                                     OMP_NUM_THREADS="1"))
    assert out.strip().endswith("ok")


CAST_OUTS = """
import torch, torchport
import torchport.backends.reference  # noqa: F401
torchport.ops.set_fallback_warn(False)
torch.manual_seed(0)
h, f = torch.randn(5, dtype=torch.float16), torch.randn(5)
i, n = torch.arange(-2, 3), torch.arange(-2, 3, dtype=torch.int32)
# (op, inputs, out= dtype): the CPU kernel computes in the result's dtype, then casts
computed = [(torch.mul, (h, h + 0.5), torch.float64), (torch.div, (h, h + 3), torch.float64),
            (torch.add, (h, h), torch.float32), (torch.sub, (h, 1.5), torch.float64),
            (torch.mul, (i, i), torch.float32), (torch.add, (i, 2), torch.float64),
            (torch.mul, (f, f), torch.float64), (torch.exp, (h,), torch.float64)]
# ... or refuses: these keep their input's dtype
refused = [(torch.neg, (h,), torch.float64), (torch.neg, (i,), torch.int32),
           (torch.neg, (f,), torch.float64), (torch.sgn, (f,), torch.float64),
           (torch.bitwise_not, (n,), torch.int64)]
dev = lambda a: a.to("ref") if isinstance(a, torch.Tensor) else a
for _ in range(2):  # the second call meets whatever the first one planned
    for op, args, dtype in computed:
        want = op(*args, out=torch.empty(5, dtype=dtype))
        got = op(*map(dev, args), out=torch.empty(5, dtype=dtype, device="ref"))
        assert got.dtype == dtype and torch.equal(got.cpu(), want), (op, args[0].dtype, dtype)
    for op, args, dtype in refused:
        try:
            op(*args, out=torch.empty(5, dtype=dtype))
        except RuntimeError as e:
            want = str(e)
        out = torch.full((5,), 7, dtype=dtype, device="ref")
        try:
            op(*map(dev, args), out=out)
        except RuntimeError as e:
            assert str(e) == want, (op, str(e), want)
        else:
            raise AssertionError(f"{op.__name__}({args[0].dtype}, out={dtype}): no error")
        assert torch.equal(out.cpu(), torch.full((5,), 7, dtype=dtype)), op
# the CPU kernel computes a cast out=; an out= of the result's dtype keeps ref's kernel
for dtype, path in ((torch.float64, "fallback"), (torch.float16, "native")):
    with torchport.ops.record() as rec:
        torch.mul(h.to("ref"), h.to("ref"), out=torch.empty(5, dtype=dtype, device="ref"))
    assert rec.path_of("mul.out") == path, (dtype, rec.path_of("mul.out"))
print("ok")
"""


def test_an_out_of_another_dtype_than_the_result_computes_or_raises_as_the_cpu() -> None:
    """TensorIterator computes an ``out=`` call in its result's dtype and casts into the
    ``out=`` (``mul(half, half, out=double)`` holds half-precision products), or refuses
    (``neg`` keeps its input's dtype). The Python meta kernels accept both, and ``ref``'s
    kernels wrote float32 products into a float64 ``out=`` and computed ``neg(half,
    out=double)`` (the fuzzer's ``out:dtype`` steps): such calls now take the CPU kernel."""
    out = check_python(textwrap.dedent(CAST_OUTS), timeout=300,
                       env=child_env(drop=("TORCHPORT_SIM_STRICT", "TORCHPORT_SIM_ASYNC",
                                           "TORCHPORT_AUTOLOAD"), importable=True,
                                     OMP_NUM_THREADS="1"))
    assert out.strip().endswith("ok")

@pytest.mark.slow
def test_fuzz_programs_on_ref() -> None:
    """A handful of fuzz programs on ``ref`` against the CPU, within tolerance: no
    unexplained difference."""
    from torchport.tools.fuzz.cli import fuzz
    from torchport.tools.fuzz.runner import add_backend

    mode = add_backend("torchport.backends.reference")
    assert mode == "ref"
    summary = fuzz(seed=0, n=6, modes=[mode])
    assert summary.runs[mode] + summary.skipped[mode] == 6
    assert not summary.unexplained, summary.report()
