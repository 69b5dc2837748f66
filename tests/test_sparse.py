"""Sparse tensors on the device (COO, CSR/CSC/BSR): creation, moves, ops, sparse gradients
and the optimizers that take them, serialization, a vendor's sparse kernel. The oracle is
the same op on CPU sparse tensors, bit for bit."""

import io
import warnings

import pytest
import torch

from tests.helpers import check_python
from torchport.ops import fallback, sparse

pytestmark = [pytest.mark.modes,
              pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning"),
              pytest.mark.filterwarnings("ignore:.*is in beta:UserWarning")]

COMPRESSED = {torch.sparse_csr: ("crow_indices", "col_indices"),
              torch.sparse_bsr: ("crow_indices", "col_indices"),
              torch.sparse_csc: ("ccol_indices", "row_indices"),
              torch.sparse_bsc: ("ccol_indices", "row_indices")}


def bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bits (``-0.0`` is not ``0.0``, NaN is its own payload)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype == torch.bool or a.numel() == 0:
        return torch.equal(a, b)
    return torch.equal(a.reshape(-1).contiguous().view(torch.uint8),
                       b.reshape(-1).contiguous().view(torch.uint8))


def same(dev, cpu) -> None:
    """``dev`` is ``cpu`` on the device: layout, shape, dtype, members bit for bit."""
    assert dev.device.type == "sim", dev.device
    assert (dev.layout, dev.shape, dev.dtype) == (cpu.layout, cpu.shape, cpu.dtype)
    if cpu.layout == torch.sparse_coo:
        assert dev.is_coalesced() == cpu.is_coalesced()
        assert dev._indices().device == dev.device and dev._values().device == dev.device
        assert bits(dev._indices().cpu(), cpu._indices())
        assert bits(dev._values().cpu(), cpu._values())
    elif cpu.layout in COMPRESSED:
        for member in (*COMPRESSED[cpu.layout], "values"):
            d, c = getattr(dev, member)(), getattr(cpu, member)()
            assert d.device == dev.device and bits(d.cpu(), c), member
    else:
        assert bits(dev.cpu(), cpu)


def coo(seed: int = 0, shape=(5, 6), nnz: int = 12, dtype=torch.float32) -> torch.Tensor:
    """An uncoalesced CPU COO matrix (duplicate entries included)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randint(0, n, (nnz,), generator=g) for n in shape])
    return torch.sparse_coo_tensor(idx, torch.randn(nnz, generator=g).to(dtype), shape)


def dense(*shape, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---- creation and moves ------------------------------------------------------------------

def test_constructors_on_device():
    c = coo()
    i, v = c._indices(), c._values()
    same(torch.sparse_coo_tensor(i, v, c.shape, device="sim"), c)
    same(torch.sparse_coo_tensor(i.to("sim"), v.to("sim"), c.shape), c)
    t = torch.sparse_coo_tensor(i, v, c.shape, device="sim")
    assert t._nnz() == c._nnz() and t.sparse_dim() == 2 and t.dense_dim() == 0
    crow, col = torch.tensor([0, 1, 2]), torch.tensor([1, 0])
    same(torch.sparse_csr_tensor(crow.to("sim"), col.to("sim"), v[:2].to("sim"), (2, 6)),
         torch.sparse_csr_tensor(crow, col, v[:2], (2, 6)))
    same(torch.sparse_csc_tensor(crow, col, v[:2], (6, 2), device="sim"),
         torch.sparse_csc_tensor(crow, col, v[:2], (6, 2)))
    e = torch.sparse_coo_tensor(size=(3, 4), device="sim")
    same(e, torch.sparse_coo_tensor(size=(3, 4)))
    same(torch.empty((3, 4), layout=torch.sparse_coo, device="sim"),
         torch.empty((3, 4), layout=torch.sparse_coo))


def test_moves_both_ways_keep_coalesced_flag():
    for c in (coo(), coo().coalesce()):
        d = c.to("sim")
        same(d, c)
        back = d.cpu()
        assert back.device.type == "cpu" and back.is_coalesced() == c.is_coalesced()
        assert torch.equal(back._indices(), c._indices())
        assert torch.equal(back._values(), c._values())
        same(d.to("sim:1"), c)
        assert d.to("sim:1").device == torch.device("sim", 1)


def test_hybrid_and_dtypes():
    x = dense(4, 3, 2).relu()
    for s in (x.to_sparse(2), x.to_sparse(1), x.double().to_sparse(), x.to(torch.int64).to_sparse()):
        same(s.to("sim"), s)
        same(s.to("sim").coalesce(), s.coalesce())
        same(s.to("sim").to_dense(), s.to_dense())
    same(x.to_sparse().to("sim").double(), x.to_sparse().double())


@pytest.mark.parametrize("convert", [
    lambda x: x.to_sparse(), lambda x: x.to_sparse(1), lambda x: x.to_sparse_csr(),
    lambda x: x.to_sparse_csc(), lambda x: x.to_sparse_bsr((2, 3)),
    lambda x: x.to_sparse_bsc((2, 2)), lambda x: x.to_sparse(layout=torch.sparse_csr)],
    ids=["coo", "coo1", "csr", "csc", "bsr", "bsc", "layout"])
def test_dense_device_tensor_to_sparse(convert):
    x = dense(4, 6).relu()
    got = convert(x.to("sim"))
    same(got, convert(x))
    same(got.to_dense(), x)


def test_indices_values_and_errors_match_cpu():
    c = coo()
    d = c.to("sim")
    with pytest.raises(RuntimeError) as cpu_err:
        c.indices()
    with pytest.raises(RuntimeError) as dev_err:
        d.indices()
    assert str(dev_err.value) == str(cpu_err.value)
    cc, dc = c.coalesce(), d.coalesce()
    assert torch.equal(dc.indices().cpu(), cc.indices())
    assert torch.equal(dc.values().cpu(), cc.values())
    assert dc.values().device == d.device and dc.is_coalesced()
    # values() aliases the tensor's values, as on the CPU
    dc.values().mul_(2)
    cc.values().mul_(2)
    same(dc, cc)


# ---- ops ---------------------------------------------------------------------------------

COO_OPS = {
    "coalesce": lambda s: s.coalesce(),
    "to_dense": lambda s: s.to_dense(),
    "add": lambda s: s + s.coalesce(),
    "add_alpha": lambda s: torch.add(s, s, alpha=-2.5),
    "sub": lambda s: s - s.coalesce() * 3,
    "neg": lambda s: -s,
    "mul_scalar": lambda s: s * 1.5,
    "div_scalar": lambda s: s / 3,
    "mul_sparse": lambda s: s * s.coalesce(),
    "abs_sqrt": lambda s: s.abs().sqrt(),
    "sparse_mm": lambda s: torch.sparse.mm(s, dense(6, 3).to(s.device)),
    "sparse_sparse_mm": lambda s: torch.sparse.mm(s, s.t().coalesce()),
    "matmul": lambda s: s @ dense(6, 3).to(s.device),
    "mv": lambda s: s @ dense(6).to(s.device),
    "addmm": lambda s: torch.addmm(dense(5, 3, seed=2).to(s.device), s, dense(6, 3).to(s.device),
                                   beta=0.5, alpha=2.0),
    "sparse_addmm": lambda s: torch.sparse.addmm(dense(5, 3, seed=2).to(s.device), s,
                                                 dense(6, 3).to(s.device)),
    "sum": lambda s: s.sum(),
    "sum_dim": lambda s: s.sum(dim=1),
    "sparse_sum": lambda s: torch.sparse.sum(s),
    "sparse_sum_dim": lambda s: torch.sparse.sum(s, dim=0),
    "index_select": lambda s: s.index_select(1, torch.tensor([5, 0, 2, 2], device=s.device)),
    "t": lambda s: s.t(),
    "transpose": lambda s: s.transpose(0, 1).coalesce(),
    "permute": lambda s: s.permute(1, 0),
    "unsqueeze": lambda s: s.unsqueeze(1),
    "clone": lambda s: s.clone(),
    "cat": lambda s: torch.cat([s, s.coalesce()], dim=1),
    "narrow_copy": lambda s: s.narrow_copy(1, 2, 3),
    "sparse_mask": lambda s: dense(5, 6).to(s.device).sparse_mask(s.coalesce()),
    "softmax": lambda s: torch.sparse.softmax(s.coalesce(), dim=1),
    "to_csr": lambda s: s.coalesce().to_sparse_csr(),
}


@pytest.mark.parametrize("name", list(COO_OPS))
def test_coo_ops_match_cpu(name):
    fn = COO_OPS[name]
    c = coo()
    same(fn(c.to("sim")), fn(c))


CSR_OPS = {
    "to_dense": lambda s: s.to_dense(),
    "mm": lambda s: s @ dense(6, 3).to(s.device),
    "mv": lambda s: s @ dense(6).to(s.device),
    "addmm": lambda s: torch.addmm(dense(5, 3, seed=2).to(s.device), s, dense(6, 3).to(s.device)),
    "add": lambda s: s + s,
    "mul_scalar": lambda s: s * 2.5,
    "neg_sin": lambda s: (-s).sin(),
    "sum": lambda s: s.sum(),
    "clone": lambda s: s.clone(),
    "t": lambda s: s.t(),
    "to_coo": lambda s: s.to_sparse(),
    "to_csc": lambda s: s.to_sparse_csc(),
    "select": lambda s: s.select(0, 2),
}


@pytest.mark.parametrize("name", list(CSR_OPS))
def test_csr_ops_match_cpu(name):
    fn = CSR_OPS[name]
    c = coo().coalesce().to_sparse_csr()
    same(fn(c.to("sim")), fn(c))


def test_in_place_ops_write_the_device_tensor():
    c, d = coo(), coo().to("sim")
    for fn in (lambda s: s.mul_(2.0), lambda s: s.add_(s.coalesce()), lambda s: s.div_(4),
               lambda s: s.neg_()):
        r_dev, r_cpu = fn(d), fn(c)
        assert r_dev is d and r_cpu is c
        same(d, c)
    same(d.zero_(), c.zero_())
    target = torch.sparse_coo_tensor(size=(5, 6), device="sim")
    same(target.copy_(coo(3).to("sim")), torch.sparse_coo_tensor(size=(5, 6)).copy_(coo(3)))
    # a dense tensor written with a sparse operand
    x = dense(5, 6)
    xd = x.to("sim")
    assert xd.add_(coo().to("sim")) is xd
    same(xd, x.add_(coo()))
    out = torch.empty(5, 3, device="sim")
    torch.addmm(dense(5, 3).to("sim"), coo().to("sim"), dense(6, 3).to("sim"), out=out)
    same(out, torch.addmm(dense(5, 3), coo(), dense(6, 3)))


def test_complex_views_of_sparse_tensors_alias_their_values():
    """``view_as_complex``/``view_as_real`` of a sparse tensor are views, as on the CPU:
    the same indices, the values viewed (a write through one shows in the other)."""
    hybrid = torch.sparse_coo_tensor(torch.tensor([[0, 2], [0, 1]]),
                                     torch.tensor([[2.0, 3.0], [4.0, 5.0]]), (3, 3, 2))
    for xs in (hybrid, hybrid.to("sim")):
        c = torch.view_as_complex(xs)
        r = torch.view_as_real(c)
        for v in (c, r):
            assert v._is_view() and v._values().untyped_storage().data_ptr() == \
                xs._values().untyped_storage().data_ptr()
        assert c._base is xs
        c._values().mul_(2)
    dev = hybrid.to("sim")  # (the CPU one was doubled through its view)
    same(torch.view_as_complex(dev), torch.view_as_complex(hybrid))
    same(torch.view_as_real(torch.view_as_complex(dev)), hybrid)


def test_op_statistics_name_the_sparse_path():
    import torchport.ops as ops
    d = coo().to("sim")
    with ops.record() as r:
        d.coalesce()
    assert r.ops["_coalesce"].subpaths == {"native:sparse": 1}  # the sim's own kernels


@pytest.fixture
def without_sparse_host_ops(monkeypatch):
    """The sim as a backend that did not declare the CPU's sparse kernels its own."""
    monkeypatch.setattr(sparse, "_HOST_VIEW", [])
    monkeypatch.setattr(fallback, "_WARNED", set())
    monkeypatch.setattr(fallback, "_WARNED_SITES", set())


@pytest.mark.usefixtures("without_sparse_host_ops")
@pytest.mark.filterwarnings("ignore::torchport.ops.fallback.FallbackWarning")
def test_cpu_kernels_are_the_fallback_of_other_backends():
    import torchport.ops as ops
    c = coo()
    d = c.to("sim")
    with pytest.warns(ops.FallbackWarning, match="_coalesce"), ops.record() as r:
        got = d.coalesce()
    same(got, c.coalesce())
    assert r.ops["_coalesce"].subpaths == {"fallback:sparse": 1}
    same(torch.sparse.mm(d, dense(6, 3).to("sim")), torch.sparse.mm(c, dense(6, 3)))
    x = dense(5, 6)
    xd = x.to("sim")
    same(xd.add_(d), x.add_(c))


@pytest.mark.usefixtures("without_sparse_host_ops")
def test_fallback_off_refuses_kernel_ops_only():
    d = coo().to("sim")
    old = fallback.set_fallback_enabled(False)
    try:
        assert d._nnz() == 12 and d.clone()._values().device == d.device  # structural
        with pytest.raises(NotImplementedError, match="sparse_kernel"):
            d.coalesce()
    finally:
        fallback.set_fallback_enabled(old)


def test_csr_in_place_ops_write_the_device_tensor():
    c = coo().coalesce().to_sparse_csr()
    d = c.to("sim")
    other = coo(5).coalesce().to_sparse_csr()  # another pattern: nnz changes
    for fn in (lambda s, o: s.mul_(2.0), lambda s, o: s.add_(o), lambda s, o: s.neg_(),
               lambda s, o: s.zero_()):
        r_dev, r_cpu = fn(d, other.to("sim")), fn(c, other)
        assert r_dev is d and r_cpu is c
        same(d, c)


@pytest.mark.parametrize("op", ["add_", "sub_", "mul_"])
@pytest.mark.parametrize("offset", [0, 5])
def test_dense_in_place_by_sparse_writes_the_dense_tensor(op, offset):
    """``dense.add_(sparse)``: the sum lands in the dense device tensor, a view starting
    past its storage's beginning included, and nothing else in that storage changes
    (the CPU's kernel writes such a view at the storage's beginning; CUDA's does not)."""
    s = (torch.eye(3) + torch.diag(torch.ones(2), 1)).to_sparse()
    want = getattr(torch.arange(9.0).view(3, 3), op)(s)  # a fresh tensor: the math
    base = torch.arange(20.0).to("sim")
    d = base[offset:offset + 9].view(3, 3).copy_(torch.arange(9.0).view(3, 3))
    before = base.cpu()
    r = getattr(d, op)(s.to("sim"))
    assert r is d and r.layout == torch.strided
    assert bits(d.cpu(), want)
    rest = torch.ones(20, dtype=torch.bool)
    rest[offset:offset + 9] = False
    assert bits(base.cpu()[rest], before[rest])


def test_device_mismatch_raises_as_cuda():
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.sparse.mm(coo().to("sim"), dense(6, 3))


# ---- gradients and training --------------------------------------------------------------

def _embedding_run(device: str, make_opt, steps: int = 5):
    torch.manual_seed(0)
    emb = torch.nn.Embedding(12, 4, sparse=True)
    head = torch.nn.Linear(4, 1)
    emb.to(device)
    head.to(device)
    opt = make_opt(emb.parameters())
    head_opt = torch.optim.SGD(head.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    grads = []
    for _ in range(steps):
        idx = torch.randint(0, 12, (3, 4), generator=g).to(device)
        loss = head(emb(idx)).pow(2).mean()
        opt.zero_grad()
        head_opt.zero_grad()
        loss.backward()
        grads.append(emb.weight.grad)
        opt.step()
        head_opt.step()
    return emb.weight.detach(), head.weight.detach(), grads


@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.SparseAdam(list(p), lr=0.05),
    lambda p: torch.optim.SGD(p, lr=0.1),
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    lambda p: torch.optim.Adagrad(p, lr=0.1),
], ids=["SparseAdam", "SGD", "SGD-momentum", "Adagrad"])
def test_embedding_sparse_training_matches_cpu(make_opt):
    w_cpu, h_cpu, g_cpu = _embedding_run("cpu", make_opt)
    w_dev, h_dev, g_dev = _embedding_run("sim", make_opt)
    for gd, gc in zip(g_dev, g_cpu, strict=True):
        assert gd.layout == torch.sparse_coo
        same(gd, gc)
    same(w_dev, w_cpu)
    same(h_dev, h_cpu)


def test_sparse_grads_accumulate_and_zero_in_place():
    """Two backwards sum sparse gradients (AccumulateGrad's sparse add); ``zero_grad`` with
    ``set_to_none=False`` zeroes the sparse gradient in place."""
    def run(device):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(10, 3, sparse=True).to(device)
        opt = torch.optim.SGD(emb.parameters(), lr=0.1)
        grads = []
        for k in range(3):
            opt.zero_grad(set_to_none=k == 0)
            for idx in ([1, 2, 2, 5], [0, 2, 9]):
                emb(torch.tensor(idx).to(device)).pow(2).sum().backward()
            grads.append(emb.weight.grad.clone())
            opt.step()
        return emb.weight.detach(), grads
    (w, gs), (cw, cgs) = run("sim"), run("cpu")
    same(w, cw)
    for g, cg in zip(gs, cgs, strict=True):
        same(g, cg)


def test_gcn_step_matches_cpu():
    """One step of a GCN layer: ``relu(adj @ (x @ W))``, loss, backward, SGD."""
    def step(device):
        torch.manual_seed(0)
        adj = (torch.rand(8, 8) < 0.3).float()
        adj = (adj + torch.eye(8)).to_sparse().to(device)
        x = dense(8, 5).to(device)
        w = torch.nn.Parameter(dense(5, 3, seed=4).to(device))
        opt = torch.optim.SGD([w], lr=0.1)
        out = torch.sparse.mm(adj, x @ w).relu()
        loss = torch.nn.functional.cross_entropy(out, torch.arange(8).remainder(3).to(device))
        loss.backward()
        grad = w.grad.clone()
        opt.step()
        return out.detach(), loss.detach(), grad, w.detach()
    for got, want in zip(step("sim"), step("cpu"), strict=True):
        same(got, want)


def test_sparse_mm_backward_to_both_operands():
    def run(device):
        a = coo().coalesce().to(device).requires_grad_()
        b = dense(6, 3).to(device).requires_grad_()
        torch.sparse.mm(a, b).pow(2).sum().backward()
        return a.grad, b.grad
    (ga, gb), (ca, cb) = run("sim"), run("cpu")
    same(ga, ca)
    same(gb, cb)


@pytest.mark.parametrize("reduce", ["sum", "mean", "amax", "amin"])
def test_sparse_mm_reduce_backward(reduce):
    """A CPU kernel that keeps what its backward needs only for inputs requiring grad
    (``arg_out`` of amax/amin) sees the device inputs' flag."""
    def run(device):
        a = coo().coalesce().to_sparse_csr().to(device).requires_grad_()
        b = dense(6, 3).to(device).requires_grad_()
        out = torch.sparse.mm(a, b, reduce)
        out.pow(2).sum().backward()
        return out.detach(), a.grad, b.grad
    for got, want in zip(run("sim"), run("cpu"), strict=True):
        same(got, want)


def test_to_dense_backward():
    def run(device):
        a = coo().coalesce().to(device).requires_grad_()
        (a.to_dense() * dense(5, 6).to(device)).sum().backward()
        return a.grad
    same(run("sim"), run("cpu"))


# ---- serialization -----------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["coo", "coalesced", "csr", "csc"])
def test_save_load_both_ways(layout):
    c = {"coo": coo(), "coalesced": coo().coalesce(), "csr": coo().coalesce().to_sparse_csr(),
         "csc": coo().coalesce().to_sparse_csc()}[layout]
    buf = io.BytesIO()
    torch.save({"t": c.to("sim")}, buf)
    for where, device in ((None, "sim"), ("cpu", "cpu"), ("sim:1", "sim")):
        buf.seek(0)
        got = torch.load(buf, map_location=where)["t"]
        assert got.device.type == device
        same(got if device == "sim" else got.to("sim"), c)
    buf = io.BytesIO()
    torch.save(c, buf)
    buf.seek(0)
    same(torch.load(buf, map_location="sim"), c)


# ---- a vendor's sparse kernel ------------------------------------------------------------

def test_vendor_sparse_kernel_takes_the_op_and_may_decline():
    out = check_python("""
        import torch, torchport.sim
        from torchport.ops import Decline, KernelSet
        calls = []
        ks = KernelSet("vendor-sparse")

        @ks.sparse_kernel("mm.default")
        def mm(a, b):
            calls.append(a.dtype)
            if a.dtype == torch.float64:
                raise Decline("float64: PyTorch's CPU kernel serves")
            return torch.sparse.mm(a.cpu(), b.cpu()).to(a.device)

        @ks.sparse_kernel("_nnz", layout=torch.sparse_csr)
        def nnz(a):
            calls.append("csr")
            return a.values().numel()

        added = torchport.sim.BACKEND.add_kernels(ks)
        assert added == ["mm", "_nnz"], added
        i = torch.tensor([[0, 1, 1], [2, 0, 2]])
        for dtype in (torch.float32, torch.float64):
            s = torch.sparse_coo_tensor(i, torch.tensor([3., 4., 5.], dtype=dtype), (2, 3))
            b = torch.randn(3, 2, dtype=dtype)
            got = torch.mm(s.to("sim"), b.to("sim"))
            assert got.device.type == "sim" and torch.equal(got.cpu(), torch.mm(s, b))
        assert s.to_sparse_csr().to("sim")._nnz() == 3
        print(calls)
    """)
    assert out.strip() == "[torch.float32, torch.float64, 'csr']"


def test_sparse_kernel_layout_must_be_sparse():
    from torchport.ops import KernelSet
    with pytest.raises(ValueError, match="sparse layout"):
        KernelSet().sparse_kernel("mm", layout=torch.strided)


def test_no_fallback_warning_for_structural_ops():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        d = torch.sparse_coo_tensor([[0, 1]], [1.0, 2.0], (3,), device="sim", check_invariants=False)
        d._indices(), d._values(), d._nnz(), d.clone(), d.is_coalesced()


def test_printing_matches_cpu():
    c = coo()
    assert repr(c.to("sim")).replace("device='sim:0', ", "") == repr(c)
    assert "layout=torch.sparse_csr" in repr(c.coalesce().to_sparse_csr().to("sim"))
