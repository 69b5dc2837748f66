"""``torch.compile`` on sim against ``torch.compile`` on the CPU over OpInfos: a
representative subset of ``python -m torchport.tools.conformance.compiled`` (``make
compiled-conformance`` runs all of op_db), the sweep's classification, and the bugs the
sweep found."""

import copy

import pytest
import torch
import torch._dynamo
import torch._functorch.config
import torch._inductor.config
from torch import nn

import torchport.sim  # noqa: F401
from torchport.tools.conformance.compiled import Comparison, CompiledRunner, run_in_process

pytestmark = pytest.mark.graph  # compiling: the tools slot of make test

# elementwise, true division by a constant, reductions (two-pass variance), normalization,
# extern matmul, indirect indexing, a scan, concatenation, a convolution
# (channels_last layout), an op with no meta kernel (FakeTensor's fallback kernel)
SUBSET = (r"add|div|sum|var|softmax|nn\.functional\.layer_norm|addmm|index_select|cumsum|cat|"
          r"nn\.functional\.conv2d|geqrf")


@pytest.fixture(autouse=True)
def _no_graph_caches():
    """Every graph compiled by the code under test, not loaded from an earlier run."""
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        yield
    torch._dynamo.reset()


def test_subset_has_no_mismatch():
    results = run_in_process(SUBSET, ("float32",), max_samples=1, op_timeout=120)
    assert len(results) >= 15
    bad = {r["id"]: r.get("error") or [s.get("detail") for v in r["dtypes"].values()
                                       for s in v.get("samples", [])]
           for r in results if r["class"] == "MISMATCH"}
    assert not bad, bad
    samples = [s for r in results for v in r["dtypes"].values() for s in v.get("samples", [])]
    # the sim side really ran compiled graphs, and most results are bit for bit
    assert sum(1 for s in samples if s.get("graphs")) >= 13
    assert sum(1 for s in samples if s["class"] == "equal") >= 13


def _compare(a, b) -> Comparison:
    cmp = Comparison()
    CompiledRunner("sim")._compare(cmp, a, b, "output")
    return cmp


def test_classification():
    x = torch.tensor([1.0, float("nan"), 0.0, 3.0])
    assert _compare(x.to("sim"), x).cls == "equal"
    assert _compare(torch.tensor([1.0, 0.0, -0.0]).to("sim"),
                    torch.tensor([1.0, 0.0, 0.0])).cls == "close"  # a signed zero: not bits
    near = x.clone()
    near[0] += 1e-6
    assert _compare(near.to("sim"), x).cls == "close"
    far = x.clone()
    far[3] = 4.0
    cmp = _compare(far.to("sim"), x)
    assert cmp.cls == "MISMATCH" and cmp.abs_err == 1.0
    nan = x.clone()
    nan[0] = float("nan")
    assert _compare(nan.to("sim"), x).cls == "MISMATCH"  # NaN positions differ
    assert _compare(x, x).cls == "MISMATCH"  # the result stayed on the CPU
    assert _compare(x.to("sim").double(), x).cls == "MISMATCH"
    assert _compare((x.to("sim"), 1), (x, 2)).cls == "MISMATCH"
    c = torch.tensor([1 + 2j, -3j]).conj()  # a conjugate view (fft results)
    assert _compare(c.to("sim"), c).cls == "equal"


def test_compiled_cnn_on_sim_has_the_cpus_layouts():
    """FakeTensor predicted contiguous results for the sim's convolutions (PyTorch's rule
    for a PrivateUse1 device), the sim's kernel gives channels_last ones (the CPU's and
    cuDNN's): inductor's layout optimisation made every compiled CNN fail its stride check."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                          nn.Conv2d(8, 4, 3, padding=1, bias=False))
    x = torch.randn(2, 3, 8, 8)
    ref = torch.compile(model)(x.requires_grad_())
    ref.sum().backward()
    sim_model = torch.compile(copy.deepcopy(model).to("sim"))
    xs = x.detach().to("sim").requires_grad_()
    out = sim_model(xs)
    out.sum().backward()
    # the first convolution's bias: an add of its own on the sim (inductor's non-CPU lowering)
    torch.testing.assert_close(out.cpu(), ref, rtol=0, atol=1e-5)
    assert out.stride() == ref.stride()
    torch.testing.assert_close(xs.grad.cpu(), x.grad, rtol=0, atol=1e-5)
    with torch.no_grad():
        inference = sim_model(xs)
    torch.testing.assert_close(inference.cpu(), ref.detach(), rtol=0, atol=1e-5)


def test_compiled_op_without_meta_kernel():
    """``geqrf`` has only a CPU kernel: FakeTensor runs it for real on ``zeros_like(fake,
    device=...)``, which the sim's fill kernel served by reading the fake input's data
    pointer (an error while dynamo traces)."""
    a = torch.randn(5, 3)
    fn = torch.compile(torch.geqrf, dynamic=False)
    ref = fn(a)
    out = fn(a.to("sim"))
    assert all(o.device.type == "sim" for o in out)
    assert all(torch.equal(o.cpu(), r) for o, r in zip(out, ref, strict=True))
