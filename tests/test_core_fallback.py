"""CPU fallback and sim kernels honour the op schema (issue 2, items 7-8)."""

import pytest
import torch

from torchport.ops import native_overloads

pytestmark = pytest.mark.modes


def test_op_without_kernel_falls_back():
    assert "cosine_similarity" not in native_overloads()
    c = torch.randn(4, 8)
    d = c.to("sim")
    for f in (lambda x: torch.special.bessel_j0(x), lambda x: x.kthvalue(2, 1).values,
              lambda x: torch.fft.fft(x).abs(), lambda x: x.logcumsumexp(1)):
        r = f(d)
        assert r.device.type == "sim"
        assert torch.equal(r.cpu(), f(c))


def test_out_argument_receives_result_and_resizes():
    c = torch.randn(3, 4)
    d = c.to("sim")
    out = torch.empty(0, device="sim")
    r = torch.add(d, d, out=out)
    assert r is out and torch.equal(out.cpu(), c + c)
    out2 = torch.empty(0, device="sim")
    torch.special.bessel_j0(d, out=out2)  # fallback path
    assert out2.shape == (3, 4) and torch.equal(out2.cpu(), torch.special.bessel_j0(c))
    vals, idx = torch.empty(0, device="sim"), torch.empty(0, dtype=torch.long, device="sim")
    torch.max(d, 1, out=(vals, idx))
    assert torch.equal(vals.cpu(), c.max(1).values) and torch.equal(idx.cpu(), c.max(1).indices)


@pytest.mark.parametrize("op", [torch.add, torch.special.xlog1py, torch.atan2])
def test_out_that_is_also_an_input_is_checked_as_on_cpu(op):
    """The CPU kernel sees ``out`` and the input it also is as one tensor: an ``out``
    that would have to grow raises CPU's error and keeps its values."""
    a, b = torch.arange(3.0) + 1, torch.ones(2, 3) * 2
    with pytest.raises(RuntimeError) as cpu_error:
        op(b, a, out=a)
    da = a.to("sim")
    with pytest.raises(RuntimeError) as error:
        op(b.to("sim"), da, out=da)
    assert str(error.value) == str(cpu_error.value)
    assert da.shape == (3,) and torch.equal(da.cpu(), a)
    c = a.clone()
    op(c, a, out=a)  # aliasing at the result's shape: the values CPU gives
    op(da.clone(), da, out=da)
    assert torch.equal(da.cpu(), a)


def test_out_argument_with_strides_kept():
    c = torch.randn(4, 4)
    d = c.to("sim")
    out = torch.empty(4, 4, device="sim").t()
    torch.special.bessel_j0(d, out=out)
    assert out.stride() == (1, 4)
    assert torch.equal(out.cpu(), torch.special.bessel_j0(c))


def test_inplace_argument_mutated():
    c = torch.randn(4, 4)
    d = c.to("sim")
    ptr = d.data_ptr()
    d.logit_(eps=0.1)
    c.logit_(eps=0.1)
    assert d.data_ptr() == ptr and torch.equal(d.cpu(), c)
    dv = d[:, 1]
    torch.special.bessel_j0(dv, out=dv)
    c[:, 1] = torch.special.bessel_j0(c[:, 1])
    assert torch.equal(d.cpu(), c)


def test_view_ops_keep_aliasing():
    d = torch.randn(4, 4, device="sim")
    for v in (d.diagonal(), d.unfold(0, 2, 1), torch.view_as_real(d.to(torch.complex64))):
        assert v.device.type == "sim"
    diag = d.diagonal()
    diag.zero_()
    assert d.cpu().diagonal().abs().sum() == 0


def test_factory_ops_land_on_device():
    for t in (torch.zeros(2, 3, device="sim:1"), torch.arange(5, device="sim:1"),
              torch.full((2,), 3.0, device="sim:1"), torch.eye(3, device="sim:1"),
              torch.linspace(0, 1, 5, device="sim:1"), torch.tril_indices(3, 3, device="sim:1")):
        assert t.device == torch.device("sim", 1)
    assert torch.equal(torch.eye(3, device="sim").cpu(), torch.eye(3))
    assert torch.equal(torch.linspace(0, 1, 5, device="sim").cpu(), torch.linspace(0, 1, 5))


@pytest.mark.parametrize("name,fn", [
    ("add", lambda x, y: x + y), ("mul_scalar", lambda x, y: x * 3), ("div", lambda x, y: x / y),
    ("matmul", lambda x, y: x @ y.t()), ("sum_dim", lambda x, y: x.sum(1)),
    ("mean", lambda x, y: x.mean()), ("softmax", lambda x, y: x.softmax(-1)),
    ("log_softmax", lambda x, y: x.log_softmax(0)), ("relu", lambda x, y: x.relu()),
    ("gelu", lambda x, y: torch.nn.functional.gelu(x)),
    ("layer_norm", lambda x, y: torch.nn.functional.layer_norm(x, (8,))),
    ("index", lambda x, y: x[torch.tensor([2, 0])]), ("bool_mask", lambda x, y: x[x > 0]),
    ("gather", lambda x, y: x.gather(1, torch.zeros(4, 2, dtype=torch.long, device=x.device))),
    ("cat", lambda x, y: torch.cat([x, y], 0)), ("where", lambda x, y: torch.where(x > 0, x, y)),
    ("sort", lambda x, y: x.sort(1).values), ("topk", lambda x, y: x.topk(3, 1).indices),
    ("cumsum", lambda x, y: x.cumsum(1)), ("max_dim", lambda x, y: x.max(1).indices),
    ("nonzero", lambda x, y: (x > 0).nonzero()), ("unique", lambda x, y: x.round().unique()),
    ("mse", lambda x, y: torch.nn.functional.mse_loss(x, y)),
    ("cross_entropy", lambda x, y: torch.nn.functional.cross_entropy(x, torch.tensor([1, 0, 3, 2], device=x.device))),
    ("embedding", lambda x, y: torch.nn.functional.embedding(torch.tensor([[0, 3]], device=x.device), x)),
    ("clamp", lambda x, y: x.clamp(-0.5, 0.5)), ("pow", lambda x, y: x.abs().pow(1.5)),
])
def test_ops_match_cpu_bitwise(name, fn):
    c1, c2 = torch.randn(4, 8), torch.randn(4, 8)
    r = fn(c1.to("sim"), c2.to("sim"))
    ref = fn(c1, c2)
    assert r.device.type == "sim"
    assert r.dtype == ref.dtype and r.shape == ref.shape
    assert torch.equal(r.cpu(), ref)


def test_conv_pool_batchnorm_match_cpu():
    x = torch.randn(2, 3, 8, 8)
    conv = torch.nn.Conv2d(3, 4, 3, padding=1)
    bn = torch.nn.BatchNorm2d(4)
    f = lambda m1, m2, t: torch.nn.functional.max_pool2d(m2(m1(t)), 2)  # noqa: E731
    import copy
    dc, db = copy.deepcopy(conv).to("sim"), copy.deepcopy(bn).to("sim")
    ref = f(conv, bn, x)
    out = f(dc, db, x.to("sim"))
    assert torch.equal(out.cpu(), ref)
    assert torch.equal(db.running_mean.cpu(), bn.running_mean)


def test_cpu_index_tensor_allowed_like_cuda():
    d = torch.arange(10.0, device="sim")
    assert torch.equal(d[torch.tensor([1, 3])].cpu(), torch.tensor([1.0, 3.0]))
