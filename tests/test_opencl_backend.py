"""The OpenCL backend (``import torchport.opencl``, device ``ocl``) on the machine's OpenCL
driver (PoCL from the ``opencl`` extra on a CPU-only machine): memory the host cannot read,
kernels queued on in-order queues, each kernel against CPU PyTorch (bit for bit where the
math is the same), same-device copies that stay on the device, an MLP and a transformer-ish
block trained with AdamW as on the CPU, dropout from the device generator. The code runs in
a worker process (tests/opencl_worker.py)."""

import pytest

from tests.opencl_support import ocl, ocl2  # noqa: F401  (the worker fixtures)

pytestmark = pytest.mark.opencl

# Runs in the worker before the tests: helpers shared by them.
HELPERS = """
import torch
from torchport.backends.opencl.runtime import OpenCLRuntime, select_devices

def same(dev, cpu):
    got = dev.cpu()
    assert got.dtype == cpu.dtype and got.shape == cpu.shape, (got.dtype, cpu.dtype, got.shape, cpu.shape)
    assert torch.equal(got, cpu) or (got.isnan() == cpu.isnan()).all() and torch.equal(
        got.nan_to_num(), cpu.nan_to_num()), (got, cpu)

def close(dev, cpu, rtol=1.3e-6, atol=1e-5):
    got = dev.cpu()
    assert got.dtype == cpu.dtype and got.shape == cpu.shape, (got.dtype, cpu.dtype)
    torch.testing.assert_close(got, cpu, rtol=rtol, atol=atol, equal_nan=True)

def native_only(fn):
    import json
    with torchport.ops.record() as rec:
        fn()
    ops = json.loads(rec.to_json())["ops"]
    assert ops and not [n for n, row in ops.items() if "fallback" in json.dumps(row)], ops

class Calls:
    '''Counts the runtime's copies while in the with block.'''
    def __init__(self):
        self.rt = ocl.runtime
    def __enter__(self):
        self.counts, self.saved = {}, {}
        for name in ("copy_h2d", "copy_d2h", "copy_d2d"):
            orig = getattr(self.rt, name)
            self.saved[name] = orig
            def counted(*a, _n=name, _o=orig, **k):
                self.counts[_n] = self.counts.get(_n, 0) + 1
                return _o(*a, **k)
            setattr(self.rt, name, counted)
        return self
    def __exit__(self, *exc):
        for name in self.saved:
            delattr(self.rt, name)
"""


@pytest.fixture(scope="module", autouse=True)
def _helpers(ocl):  # noqa: F811
    ocl.run(HELPERS)


def test_device_memory_is_device_only_and_round_trips_every_dtype(ocl):  # noqa: F811
    ocl.run("""
    assert torch.ocl.is_available() and torch.ocl.device_count() == ocl.runtime.device_count() >= 1
    rt = ocl.runtime
    assert not rt.host_addressable and rt.asynchronous
    assert torch.ocl.get_device_properties(0).total_memory == rt.devices[0].global_mem_size
    for dt in (torch.float32, torch.float16, torch.int64, torch.int32, torch.bool, torch.uint8):
        x = (torch.randn(5, 7) * 10).to(dt)
        d = x.to("ocl")
        same(d, x)
        same(d.t(), x.t())                       # a strided view read back
        same(d[1:, ::2].contiguous(), x[1:, ::2].contiguous())  # the device's strided copy
    assert torch.empty(0, 3, device="ocl").cpu().shape == (0, 3)
    v = d[2:]                                   # an interior address: the same buffer
    buf, off = rt.locate(torchport.device_index(v), torchport.device_address(v))
    base_buf, base_off = rt.locate(torchport.device_index(d), torchport.device_address(d))
    assert buf == base_buf and off == base_off + 2 * 7 * d.element_size()
    # locate remembers its answers (every launch asks) until the block goes back, and still
    # checks the bytes asked for against the block's end
    ptr = rt.malloc(0, 1024)
    assert rt.locate(0, ptr + 1000, 24) == rt.locate(0, ptr + 1000)
    for call in (lambda: rt.locate(0, ptr + 1000, 25), lambda: (rt.free(0, ptr), rt.locate(0, ptr + 1000))):
        try:
            call()
        except RuntimeError as e:
            assert "illegal address" in str(e), e
        else:
            raise AssertionError("locate answered for memory no block holds")
    """)


@pytest.mark.opencl_full
def test_elementwise_broadcasting_type_promotion_and_scalars(ocl):  # noqa: F811
    ocl.run("""
    a = torch.randn(4, 1, 3)
    b = torch.randint(-5, 5, (2, 3), dtype=torch.int64)
    m = torch.rand(4, 2, 3) > 0.5
    da, db, dm = a.to("ocl"), b.to("ocl"), m.to("ocl")
    same(da + db, a + b)                  # float32 + int64 -> float32, broadcast
    same(db * 3, b * 3)                   # int64 * Python int
    same(db / 2, b / 2)                   # int64 true division -> float32
    same(da - db * 2.5, a - b * 2.5)
    same(torch.add(da, db, alpha=2), torch.add(a, b, alpha=2))
    same(dm * db, m * b)                  # bool * int64
    same(da > db, a > b)
    same(db.eq(2), b.eq(2))
    same(torch.where(dm, da, db.double()), torch.where(m, a, b.double()))
    same(torch.maximum(da, torch.full_like(da, float("nan")).to("ocl")[:, :, :1]),
         torch.maximum(a, torch.full_like(a, float("nan"))[:, :, :1]))
    same(da * torch.tensor(2.0), a * torch.tensor(2.0))       # a 0-dim CPU tensor operand
    x = torch.randn(6, 5)
    dx = x.to("ocl")
    same(dx.t()[1:] * dx.t()[:-1], x.t()[1:] * x.t()[:-1])    # transposed and offset views
    h = x.half()
    same(h.to("ocl") * 3 + h.to("ocl"), h * 3 + h)            # float16 through opmath float
    y = dx.clone(); y.mul_(2).add_(1)
    same(y, x * 2 + 1)                                        # in-place, derived from out=
    out = torch.empty(6, 5, dtype=torch.float64, device="ocl")
    torch.mul(dx, 10, out=out)                                # computed in float32, stored wider
    same(out, torch.mul(x, 10, out=torch.empty(6, 5, dtype=torch.float64)))
    same(dx.neg().abs(), x.neg().abs())
    same(torch.relu(dx), torch.relu(x))
    close(dx.exp(), x.exp()); close(dx.abs().sqrt(), x.abs().sqrt()); close(dx.tanh(), x.tanh())
    close(dx.sigmoid(), x.sigmoid()); close(dx.abs().log(), x.abs().log())
    close(dx.abs().pow(1.7), x.abs().pow(1.7))
    same(dx.pow(2), x.pow(2))
    native_only(lambda: (da + db, dm * db, da > db, torch.where(dm, da, da), dx.exp()))
    """)
    ocl.run("""
    # masked_fill: a broadcast mask, a strided self, the value as the CPU converts it
    # (float16's rounding of 2.7, 2.7 to int64, to bool), its three overloads and out=
    for dt in (torch.float32, torch.float16, torch.int64, torch.bool):
        x, m = (torch.randn(4, 6) * 5).to(dt), torch.rand(6) > 0.5
        dx, dm = x.to("ocl"), m.to("ocl")
        for v in (2.7, -1, True):
            same(dx.masked_fill(dm, v), x.masked_fill(m, v))
        same(dx.t().masked_fill(dm[:, None], 0.1), x.t().masked_fill(m[:, None], 0.1))
        same(dx[:, ::2].masked_fill(dm[:3], 3), x[:, ::2].masked_fill(m[:3], 3))
        y = dx[1:].clone().t()
        y.masked_fill_(dm[:, None], torch.tensor(-2))                 # a CPU 0-dim value
        same(y, x[1:].t().masked_fill(m[:, None], -2))
        y.masked_fill_(dm[:, None], torch.tensor(5).to("ocl"))          # a device value
        same(y, x[1:].t().masked_fill(m[:, None], 5))
        out = torch.empty(0, dtype=dt, device="ocl")
        torch.ops.aten.masked_fill.Scalar_out(dx, dm, 1, out=out)
        same(out, x.masked_fill(m, 1))
        same(dx[:0].masked_fill(dm, 1), x[:0].masked_fill(m, 1))           # 0-size
        native_only(lambda: (dx.masked_fill(dm, 1), dx.clone().masked_fill_(dm, torch.tensor(1)),
                             torch.ops.aten.masked_fill.Scalar_out(dx, dm, 1, out=out)))
    for call in (lambda d: torch.zeros(3, dtype=torch.half, device=d).masked_fill_(
                     torch.ones(3, dtype=torch.bool, device=d), 1e10),      # overflows float16
                 lambda d: torch.zeros(3, device=d).masked_fill_(torch.ones(3, dtype=torch.uint8,
                                                                            device=d), 1)):
        try:
            call("cpu")
        except RuntimeError as e:
            want = str(e)
        try:
            call("ocl")
        except RuntimeError as e:
            assert str(e) == want, (str(e), want)
        else:
            raise AssertionError(want)
    # logical ops: NaN is true, broadcasting, a CPU scalar rounded to float16 (1e-8 -> 0), out=
    for dt in (torch.float32, torch.float16, torch.int64, torch.bool):
        a, b = (torch.randn(4, 5) * 2).round().to(dt), (torch.randn(5) * 2).round().to(dt)
        if dt.is_floating_point:
            a[0, 0] = float("nan")
        da, db = a.to("ocl"), b.to("ocl")
        for f in (torch.logical_and, torch.logical_or, torch.logical_xor):
            same(f(da.t(), db[:, None]), f(a.t(), b[:, None]))
            same(f(da, torch.tensor(1e-8)), f(a, torch.tensor(1e-8)))
            same(f(da, db, out=torch.empty(0, device="ocl")), f(a, b, out=torch.empty(0)))
        same(torch.logical_not(da.t()), torch.logical_not(a.t()))
        same(da[:, :0].logical_and(db[:0]), a[:, :0].logical_and(b[:0]))
        same(torch.sign(da.t()), torch.sign(a.t())); same(torch.sgn(da), torch.sgn(a))
        native_only(lambda: (torch.logical_and(da, db), da.logical_or_(db), torch.logical_xor(da, db),
                             torch.logical_not(da), torch.sign(da), torch.sgn(da)))
    s = torch.tensor([float("nan"), -0.0, 0.0, -3, 2, float("inf"), -float("inf")])
    same(torch.sign(s.to("ocl")), torch.sign(s))
    assert not torch.sign(s.to("ocl")).cpu()[:2].signbit().any()      # NaN, -0.0: +0.0
    # pow with a tensor exponent: int64 exactly (negative exponents, wrapping products),
    # float16 exactly, float32 within an ulp (the CPU's own pow differs by position)
    i, e = torch.randint(-4, 5, (6, 7)), torch.randint(-3, 9, (7,))
    same(i.to("ocl").pow(e.to("ocl")), i.pow(e))
    big, be = torch.tensor([3, -3, 7, 2, -1, 1, 0, -2]), torch.tensor([40, 41, 30, 63, -5, -7, 0, -1])
    same(big.to("ocl").pow(be.to("ocl")), big.pow(be))
    same(torch.pow(3, e.to("ocl")), torch.pow(3, e))
    a, b = torch.rand(6, 7) * 4, torch.randn(7) * 3
    for dt, check in ((torch.float16, same), (torch.float32, close)):
        ha, hb = a.to(dt), b.to(dt)
        check(ha.to("ocl").t().pow(hb.to("ocl")[:, None]), ha.t().pow(hb[:, None]))
        check(torch.pow(2.5, hb.to("ocl")), torch.pow(2.5, hb))
        check(ha.to("ocl").pow(torch.tensor(0.1)), ha.pow(torch.tensor(0.1)))
    h = (torch.rand(2000) * 4).half()                  # the exponent in float16, as the CPU
    same(h.to("ocl").pow(0.1), h.pow(0.1)); same(h.to("ocl").pow(3), h.pow(3))
    native_only(lambda: (i.to("ocl").pow(e.to("ocl")), torch.pow(2, e.to("ocl")),
                         a.to("ocl").pow(a.to("ocl"))))
    # division with a rounding mode: bit for bit, float16 in its own steps, a one-element
    # divisor by its original value, IEEE specials, integers by negative divisors
    z = torch.tensor([0.0, -0.0, float("nan"), float("inf"), 1e-30, 7.5, -7.5, 1e38])
    n = torch.tensor([1.0, -2.0, 0.0, -0.0, 3.0, 2.0, -0.1, 1e-3])
    for mode in ("trunc", "floor"):
        for dt in (torch.float32, torch.float16, torch.int64):
            a, b = (torch.randn(40, 37) * 100).to(dt), (torch.randn(37) * 3).to(dt)
            if dt == torch.int64:
                b = torch.randint(1, 9, (37,)) * (torch.randint(0, 2, (37,)) * 2 - 1)
            da, db = a.to("ocl"), b.to("ocl")
            same(torch.div(da, db, rounding_mode=mode), torch.div(a, b, rounding_mode=mode))
            same(torch.div(da.t(), db[:, None], rounding_mode=mode),
                 torch.div(a.t(), b[:, None], rounding_mode=mode))
            same(torch.div(da, 0.7, rounding_mode=mode), torch.div(a, 0.7, rounding_mode=mode))
            same(torch.div(da, -3, rounding_mode=mode), torch.div(a, -3, rounding_mode=mode))
            same(torch.div(da, db[:1], rounding_mode=mode), torch.div(a, b[:1], rounding_mode=mode))
            if dt.is_floating_point:
                for p, q in ((n, z), (z, n), (n[:, None], z)):
                    p, q = p.to(dt), q.to(dt)
                    same(torch.div(p.to("ocl"), q.to("ocl"), rounding_mode=mode),
                         torch.div(p, q, rounding_mode=mode))
            native_only(lambda: (torch.div(da, db, rounding_mode=mode), torch.div(da, 2, rounding_mode=mode),
                                 da // db))
    same(torch.div(torch.tensor([-2**63, 5, -7]).to("ocl"), torch.tensor([-1, -1, 2]).to("ocl"),
                   rounding_mode="floor"), torch.tensor([-2**63, -5, -4]))   # no trap
    # a zero divisor: the CPU's error for a host one; on the device unchecked, as CUDA's
    # kernel (0 here)
    i = torch.tensor([4, -9, 7])
    for mode in ("trunc", "floor"):
        try:
            torch.div(i.to("ocl"), 0, rounding_mode=mode)
        except RuntimeError as err:
            assert str(err) == "ZeroDivisionError", str(err)
        else:
            raise AssertionError("no ZeroDivisionError")
        same(torch.div(i.to("ocl"), torch.tensor([0, 2, 0]).to("ocl"), rounding_mode=mode),
             torch.tensor([0, -9 // 2 if mode == "floor" else -4, 0]))
        # an empty quotient: the CPU's kernel never runs, so nothing to refuse
        same(torch.div(i[:0].to("ocl"), 0, rounding_mode=mode), i[:0])
    same(torch.tril_indices(21, 0, device="ocl"), torch.tril_indices(21, 0))
    # a kernel's meta kernel (a Python reference) words its errors otherwise than ATen: the
    # CPU's error, class and words
    for call in (lambda d: torch.amin(torch.ones(3, 4, device=d), 0,
                                      out=torch.empty(4, dtype=torch.int32, device=d)),
                 lambda d: torch.ones(2, 2, device=d).masked_fill(torch.ones((), dtype=torch.bool,
                                                                             device=d), 1j),
                 lambda d: torch.add(torch.ones(3, device=d), torch.ones(4, device=d))):
        errors = []
        for d in ("cpu", "ocl"):
            try:
                call(d)
            except Exception as e:
                errors.append((type(e), str(e)))
        assert len(errors) == 2 and errors[0] == errors[1], errors
    """)


@pytest.mark.opencl_full
def test_reductions_over_dims(ocl):  # noqa: F811
    ocl.run("""
    x = torch.randn(3, 4, 5)
    x[1, 2, 3] = float("nan")
    dx = x.to("ocl")
    for dims, keep in (((1,), False), ((0, 2), True), ((), False), ((-1,), True)):
        close(dx.nan_to_num().sum(dims, keepdim=keep), x.nan_to_num().sum(dims, keepdim=keep))
        close(dx.nan_to_num().mean(dims, keepdim=keep), x.nan_to_num().mean(dims, keepdim=keep))
        same(dx.amax(dims, keepdim=keep), x.amax(dims, keepdim=keep))   # NaN propagates
        same(dx.amin(dims, keepdim=keep), x.amin(dims, keepdim=keep))
    same(dx.argmax(2), x.argmax(2)); same(dx.argmin(1, keepdim=True), x.argmin(1, keepdim=True))
    same(dx.argmax(), x.argmax())
    t = torch.tensor([[1, 3, 3, 0], [2, 2, 1, 2]])
    same(t.to("ocl").argmax(1), t.argmax(1))                 # ties: the first index
    i = torch.randint(-100, 100, (7, 9))
    same(i.to("ocl").sum(0), i.sum(0)); same(i.to("ocl").t().sum(1), i.t().sum(1))
    same((i > 0).to("ocl").sum(), (i > 0).sum())             # bool -> int64
    same(torch.empty(0, 4).to("ocl").sum(0), torch.empty(0, 4).sum(0))
    native_only(lambda: (dx.sum(1), dx.amax(0), dx.argmax(2), dx.mean((0, 2))))
    """)


@pytest.mark.opencl_full
def test_gemm_and_softmax_with_their_backward(ocl):  # noqa: F811
    ocl.run("""
    a, b, c = torch.randn(37, 19), torch.randn(23, 19), torch.randn(23)
    da, db, dc = a.to("ocl"), b.to("ocl"), c.to("ocl")
    close(da @ db.t(), a @ b.t())
    close(torch.addmm(dc, da, db.t(), beta=0.5, alpha=2), torch.addmm(c, a, b.t(), beta=0.5, alpha=2))
    p, q = torch.randn(3, 5, 17), torch.randn(3, 4, 17)
    close(torch.bmm(p.to("ocl"), q.to("ocl").transpose(1, 2)), torch.bmm(p, q.transpose(1, 2)))
    i, j = torch.randint(-9, 9, (5, 6)), torch.randint(-9, 9, (6, 4))
    same(i.to("ocl") @ j.to("ocl"), i @ j)                   # int64: exact
    x = torch.randn(6, 9, requires_grad=True)
    dx = x.detach().to("ocl").requires_grad_()
    for f in (torch.softmax, torch.log_softmax):
        for dim in (1, 0):
            g = torch.randn(6, 9)
            y, dy = f(x, dim), f(dx, dim)
            close(dy, y.detach())
            gx, = torch.autograd.grad(y, x, g)
            gdx, = torch.autograd.grad(dy, dx, g.to("ocl"))
            close(gdx, gx)
    h = (torch.randn(40, 7) * 9).half()
    same(torch.log_softmax(h.to("ocl"), 1), torch.log_softmax(h, 1))  # the CPU's roundings
    same(torch.log_softmax(h.to("ocl"), 0), torch.log_softmax(h, 0))
    native_only(lambda: (torch.log_softmax(dx.detach(), 1), da @ db.t(), torch.addmm(dc, da, db.t())))
    """)


@pytest.mark.opencl_full
def test_gemm_vector_widths_transposed_weights_and_ragged_rows(ocl):  # noqa: F811
    ocl.run("""
    # columns in vectors of 16, 8 and 4 (and one at a time), rows not a multiple of the
    # rows per work-item, a transposed weight (copied, then read by rows), bias, batches
    for m, k, n in ((13, 33, 48), (9, 7, 24), (21, 5, 12), (3, 17, 16), (11, 6, 10)):
        a, w, c = torch.randn(m, k), torch.randn(n, k), torch.randn(n)
        da, dw, dc = a.to("ocl"), w.to("ocl"), c.to("ocl")
        close(da @ dw.t(), a @ w.t())
        close(da @ dw.t().contiguous(), a @ w.t())
        close(torch.addmm(dc, da, dw.t(), beta=0.5, alpha=2), torch.addmm(c, a, w.t(), beta=0.5, alpha=2))
        close(torch.nn.functional.linear(da, dw, dc), torch.nn.functional.linear(a, w, c))
        p, q = torch.randn(2, m, k), torch.randn(2, k, n)
        close(torch.bmm(p.to("ocl"), q.to("ocl")), torch.bmm(p, q))
        close(torch.baddbmm(dc, p.to("ocl"), q.to("ocl"), beta=0.25), torch.baddbmm(c, p, q, beta=0.25))
        i, j = torch.randint(-9, 9, (m, k)), torch.randint(-9, 9, (k, n))
        same(i.to("ocl") @ j.to("ocl"), i @ j)                       # int64: exact
        same(i.to("ocl") @ j.t().contiguous().to("ocl").t(), i @ j)
        h, g = torch.randn(m, k).half(), torch.randn(k, n).half()
        close(h.to("ocl") @ g.to("ocl"), h @ g, rtol=1e-3, atol=1e-2)   # float16 sums in float
        x = torch.randn(m, k, dtype=torch.float64)
        y = torch.randn(k, n, dtype=torch.float64)
        if ocl.runtime.fp64[0]:
            close(x.to("ocl") @ y.to("ocl"), x @ y, rtol=1e-12, atol=1e-12)
    native_only(lambda: (da @ dw.t(), torch.addmm(dc, da, dw.t())))
    """)


def test_same_device_copies_stay_on_the_device(ocl):  # noqa: F811
    ocl.run("""
    x, y = torch.randn(8, 6), torch.randn(8, 2)
    a, b, dy = x.to("ocl"), torch.empty(8, 6, device="ocl"), y.to("ocl")
    with Calls() as calls:
        b.copy_(a)                              # same dtype, dense: one runtime copy
    assert calls.counts == {"copy_d2d": 1}, calls.counts
    with Calls() as calls:
        h = a.to(torch.float16)                 # dtype conversion: the device's copy kernel
        a[:, :2] = dy                           # a strided destination
        c = a.t().contiguous()
    assert calls.counts == {}, calls.counts
    same(b, x); same(h, x.half())
    x[:, :2] = y
    same(a, x); same(c, x.t().contiguous())
    """)


def test_mlp_trains_with_adamw_and_sgd_as_on_the_cpu(ocl):  # noqa: F811
    ocl.run("""
    def train(device, opt_cls, steps=4):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(),
                                    torch.nn.Linear(32, 5)).to(device)
        opt = opt_cls(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(64, 20, generator=gen).to(device)
        y = torch.randint(0, 5, (64,), generator=gen).to(device)
        losses = []
        for _ in range(steps):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, [p.detach().cpu() for p in model.parameters()]

    for opt_cls in (torch.optim.AdamW, lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9)):
        cpu_losses, cpu_params = train("cpu", opt_cls)
        ocl_losses, ocl_params = train("ocl", opt_cls)
        torch.testing.assert_close(ocl_losses, cpu_losses, rtol=1e-5, atol=1e-6)
        for p, q in zip(ocl_params, cpu_params):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    """)


def test_a_cnn_with_batchnorm_trains_as_on_the_cpu(ocl):  # noqa: F811
    ocl.run("""
    import copy

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4),
                              torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(144, 2))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 3, 8, 8, generator=gen)
    y = torch.randint(0, 2, (8,), generator=gen)
    models = {d: copy.deepcopy(net).to(d) for d in ("cpu", "ocl")}
    opts = {d: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for d, m in models.items()}
    for _ in range(3):
        for d, m in models.items():
            torch.nn.functional.cross_entropy(m(x.to(d)), y.to(d)).backward()
            opts[d].step()
            opts[d].zero_grad()
    want, got = models["cpu"].state_dict(), models["ocl"].state_dict()
    assert got["1.running_mean"].abs().sum().item() > 0  # the statistics were updated
    for k in want:
        torch.testing.assert_close(got[k].cpu(), want[k], rtol=1e-5, atol=1e-6)
    for m in models.values():
        m.eval()
    torch.testing.assert_close(models["ocl"](x.to("ocl")).cpu(), models["cpu"](x),
                               rtol=1e-5, atol=1e-5)
    """)


def test_bool_fills_take_any_number_as_a_truth_value(ocl):  # noqa: F811
    ocl.run("""
    for v in (-5, 0, 2, 0.5, -0.0, True):
        same(torch.scalar_tensor(v, dtype=torch.bool, device="ocl"),
             torch.scalar_tensor(v, dtype=torch.bool))
        same(torch.full((3,), v, dtype=torch.bool, device="ocl"),
             torch.full((3,), v, dtype=torch.bool))
    """)


def test_nll_loss_runs_on_the_device_bit_for_bit(ocl):  # noqa: F811
    ocl.run("""
    # the CPU's order of the sums (its cascade of partial sums: 70000 targets take levels of
    # 16), weights, ignore_index, every reduction, strided inputs, a 1-d input; no copies
    F = torch.nn.functional
    torch.manual_seed(0)
    for dt in (torch.float32, torch.float64):
        for n, c in ((1, 3), (128, 10), (70000, 2)):
            x, w = torch.randn(n, c, dtype=dt) * 5, torch.rand(c, dtype=dt)
            t = torch.randint(0, c, (n,))
            for red in ("mean", "sum", "none"):
                for weight in (None, w):
                    for ign in (-100, 1):
                        tt = t.clone(); tt[::7] = ign
                        for xv in (x, x.t().contiguous().t()):
                            xd, xc = xv.to("ocl").requires_grad_(), xv.clone().requires_grad_()
                            wd = None if weight is None else weight.to("ocl")
                            ld = F.nll_loss(xd, tt.to("ocl"), wd, ignore_index=ign, reduction=red)
                            lc = F.nll_loss(xc, tt, weight, ignore_index=ign, reduction=red)
                            same(ld.detach(), lc.detach())
                            go = torch.randn(lc.shape, dtype=dt)
                            ld.backward(go.to("ocl")); lc.backward(go)
                            same(xd.grad, xc.grad)
        x1, t1, w1 = torch.randn(4, dtype=dt), torch.tensor(3), torch.rand(4, dtype=dt)
        for red, weight in (("mean", w1), ("sum", None), ("none", w1)):
            xd, xc = x1.to("ocl").requires_grad_(), x1.clone().requires_grad_()
            wd = None if weight is None else weight.to("ocl")
            ld = F.nll_loss(xd, t1.to("ocl"), wd, reduction=red)
            lc = F.nll_loss(xc, t1, weight, reduction=red)
            same(ld.detach(), lc.detach()); ld.backward(); lc.backward(); same(xd.grad, xc.grad)
    x, y = torch.randn(128, 10), torch.randint(0, 10, (128,))
    dx, dy = x.to("ocl").requires_grad_(), y.to("ocl")
    with Calls() as calls:
        native_only(lambda: F.cross_entropy(dx, dy).backward())
    assert not calls.counts, calls.counts
    # what the kernels leave to the CPU: a uint8 target, an empty mean (the CPU's NaN)
    u = torch.randint(0, 10, (128,), dtype=torch.uint8)
    same(torch.ops.aten.nll_loss_forward(x.to("ocl"), u.to("ocl"), None, 1, -100)[0],
         torch.ops.aten.nll_loss_forward(x, u, None, 1, -100)[0])
    e = torch.zeros(0, dtype=torch.long)
    same(F.nll_loss(torch.zeros(0, 3, device="ocl"), e.to("ocl")), F.nll_loss(torch.zeros(0, 3), e))
    """)


def test_in_place_updates_with_new_numbers_skip_the_meta_kernel(ocl):  # noqa: F811
    ocl.run("""
    # an optimizer's in-place updates take a new learning rate or bias correction every
    # step: the bits of the functional overload (the same out= kernel), without running the
    # meta kernel again for each new number (once per layout, the first step)
    import torchport.ops.derive as derive
    metas = []
    real = derive._meta_result
    x, y, z = torch.randn(16, 8), torch.randn(8), torch.rand(16, 8) + 0.5
    d, dy, dz = x.to("ocl"), y.to("ocl"), z.to("ocl")
    updates = [(lambda t, a, b, v: t.add_(a, alpha=-v), lambda t, a, b, v: t.add(a, alpha=-v)),
               (lambda t, a, b, v: t.sub_(b, alpha=v), lambda t, a, b, v: t.sub(b, alpha=v)),
               (lambda t, a, b, v: t.mul_(1 - v), lambda t, a, b, v: t.mul(1 - v)),
               (lambda t, a, b, v: t.div_(v), lambda t, a, b, v: t.div(v)),
               (lambda t, a, b, v: t.addcmul_(a, b, value=v),
                lambda t, a, b, v: t.addcmul(a, b, value=v)),
               (lambda t, a, b, v: t.addcdiv_(a, b, value=-v),
                lambda t, a, b, v: t.addcdiv(a, b, value=-v)),
               (lambda t, a, b, v: t.lerp_(b, v), lambda t, a, b, v: t.lerp(b, v))]
    spying = [False]
    derive._meta_result = lambda op, a, k: (spying[0] and metas.append(str(op)), real(op, a, k))[1]
    try:
        for step in range(1, 5):
            v = 0.9 ** step / 3
            for update, functional in updates:
                want = functional(d, dy, dz, v)
                spying[0] = step > 1
                update(d, dy, dz, v)
                spying[0] = False
                update(x, y, z, v)
                same(d, want.cpu())
                close(d, x)
        assert not metas, metas
        # anything else takes the derived kernel: a float16 update by another dtype, and
        # what the CPU refuses (broadcasting into self, casts, integer addcdiv) raises
        dh, dx = d.half(), d.clone()
        same(dh.clone().mul_(dx), dh.mul(dx).half().cpu())
        for call in (lambda t: t.add_(t.new_ones(5, 8)), lambda t: t[:1].add_(t),
                     lambda t: t.long().div_(2.0), lambda t: t.addcdiv_(t.long(), t.long()),
                     lambda t: t.lerp_(t.double(), 0.5)):
            for t in (x, d):
                try:
                    call(t)
                except RuntimeError:
                    pass
                else:
                    raise AssertionError(f"{t.device} took it")
    finally:
        derive._meta_result = real
    """)


def test_an_op_without_a_kernel_falls_back_to_the_cpu(ocl):  # noqa: F811
    ocl.run("""
    x = torch.randn(5, 7)
    dx = x.to("ocl")
    with torchport.ops.record() as rec:
        got = torch.cumsum(dx, 1)
    same(got, torch.cumsum(x, 1))
    assert "fallback" in rec.table() and "cumsum" in rec.table()
    assert "cumsum.out" not in torchport.ops.native_overloads()
    """)


def test_streams_events_and_out_of_memory(ocl):  # noqa: F811
    ocl.run("""
    x = torch.randn(256, 256)
    dx = x.to("ocl")
    s = torch.ocl.Stream()
    start, end = torch.ocl.Event(enable_timing=True), torch.ocl.Event(enable_timing=True)
    s.wait_stream(torch.ocl.current_stream())
    with torch.ocl.stream(s):
        start.record()
        y = dx @ dx
        z = y.sum(1)
        end.record()
        close(z, (x @ x).sum(1), rtol=1e-4, atol=1e-3)   # a blocking read on the side stream
    end.synchronize()
    assert end.query() and start.elapsed_time(end) >= 0
    torch.ocl.current_stream().wait_stream(s)
    close(y, x @ x, rtol=1e-4, atol=1e-3)
    torch.ocl.synchronize()
    total = torch.ocl.get_device_properties(0).total_memory
    try:
        torch.empty(total // 4 * 2, dtype=torch.float32, device="ocl")
    except torch.OutOfMemoryError as e:
        assert "ocl" in str(e)
    else:
        raise AssertionError("no OutOfMemoryError")
    """)


def test_no_device_is_a_clear_error(ocl):  # noqa: F811
    ocl.run("""
    import os
    from torchport.backends.opencl import OpenCLUnavailable, make_backend
    os.environ["TORCHPORT_OPENCL_PLATFORM"] = "no such platform"
    try:
        assert select_devices() == []
    finally:
        del os.environ["TORCHPORT_OPENCL_PLATFORM"]
    try:
        make_backend(OpenCLRuntime(devices=[]))
    except OpenCLUnavailable as e:
        assert isinstance(e, ImportError) and "pocl-binary-distribution" in str(e)
    else:
        raise AssertionError("no error")
    """)


@pytest.mark.opencl_full
def test_indexing_kernels_against_the_cpu(ocl):  # noqa: F811
    ocl.run("""
    x = torch.randn(6, 5)
    dx = x.to("ocl")
    i = torch.tensor([4, 0, 2, 2, 5])
    di = i.to("ocl")
    for dim in (0, 1):
        same(dx.index_select(dim, di[:5 - dim]), x.index_select(dim, i[:5 - dim]))
    same(dx.t()[1:].index_select(1, di), x.t()[1:].index_select(1, i))   # a strided view
    h = x.half()
    same(h.to("ocl").index_select(0, di), h.index_select(0, i))
    g = torch.randint(0, 6, (3, 5))
    same(dx.gather(0, g.to("ocl")), x.gather(0, g))
    g1 = torch.randint(0, 5, (6, 2))
    same(dx.gather(1, g1.to("ocl")), x.gather(1, g1))
    src = torch.randn(3, 5)
    same(dx.scatter_add(0, g.to("ocl"), src.to("ocl")), x.scatter_add(0, g, src))  # in order
    t = torch.zeros(4, 7, dtype=torch.int64)
    ti, ts = torch.randint(0, 7, (4, 9)), torch.randint(-9, 9, (4, 9))
    same(t.to("ocl").scatter_add_(1, ti.to("ocl"), ts.to("ocl")), t.scatter_add(1, ti, ts))
    same(dx.index_select(0, di[:0]), x.index_select(0, i[:0]))           # 0-size
    native_only(lambda: (dx.index_select(0, di), dx.gather(0, g.to("ocl")),
                         dx.scatter_add(0, g.to("ocl"), src.to("ocl"))))
    """)


@pytest.mark.opencl_full
def test_embedding_layer_norm_variance_and_half_gemm(ocl):  # noqa: F811
    ocl.run("""
    emb = torch.nn.Embedding(10, 4, padding_idx=1)
    demb = torch.nn.Embedding(10, 4, padding_idx=1).to("ocl")
    demb.load_state_dict(emb.state_dict())
    ix = torch.tensor([[1, 2, 3], [3, 3, 9]])
    o, do = emb(ix), demb(ix.to("ocl"))
    same(do, o.detach())
    (o * o).sum().backward(); (do * do).sum().backward()
    same(demb.weight.grad, emb.weight.grad)       # rows summed in order: bit for bit
    x = torch.randn(3, 4, 7) * 3 + 1
    ln = torch.nn.LayerNorm(7)
    with torch.no_grad():
        ln.weight.normal_(); ln.bias.normal_()
    dln = torch.nn.LayerNorm(7).to("ocl")
    dln.load_state_dict(ln.state_dict())
    xr, xd = x.clone().requires_grad_(), x.to("ocl").requires_grad_()
    g = torch.randn(3, 4, 7)
    y, yd = ln(xr), dln(xd)
    close(yd, y.detach())
    y.backward(g); yd.backward(g.to("ocl"))
    close(xd.grad, xr.grad, rtol=1e-5); close(dln.weight.grad, ln.weight.grad, rtol=1e-5)
    close(dln.bias.grad, ln.bias.grad)
    out, mean, rstd = torch.native_layer_norm(xd.detach(), [4, 7], None, None, 1e-5)
    ref = torch.native_layer_norm(x, [4, 7], None, None, 1e-5)
    close(out, ref[0]); close(mean, ref[1]); close(rstd, ref[2])
    for dims, corr, keep in ((1, 1, False), ((0, 2), 0, True), (None, 2.5, False)):
        close(xd.detach().var(dims, correction=corr, keepdim=keep),
              x.var(dims, correction=corr, keepdim=keep))
        v, m = torch.var_mean(xd.detach(), dims, correction=corr, keepdim=keep)
        rv, rm = torch.var_mean(x, dims, correction=corr, keepdim=keep)
        close(v, rv); close(m, rm)
    same(torch.ones(1).to("ocl").var(), torch.ones(1).var())      # m - correction = 0: NaN
    a, b = torch.randn(9, 33).half(), torch.randn(33, 5).half()
    close(a.to("ocl") @ b.to("ocl"), a @ b, rtol=1e-3, atol=1e-2)
    p, q = torch.randn(2, 9, 33).half(), torch.randn(2, 33, 5).half()
    close(torch.bmm(p.to("ocl"), q.to("ocl")), torch.bmm(p, q), rtol=1e-3, atol=1e-2)
    native_only(lambda: (demb(ix.to("ocl")), dln(xd), xd.var(1), a.to("ocl") @ b.to("ocl")))
    """)


@pytest.mark.opencl_full
def test_dropout_mask_is_reproducible_from_the_device_generator(ocl):  # noqa: F811
    ocl.run("""
    x = torch.randn(64, 50)
    x[0, 0] = float("inf")
    dx = x.to("ocl")
    torch.ocl.manual_seed(7)
    out, mask = torch.native_dropout(dx, 0.3, True)
    state = torch.ocl.get_rng_state()
    out2, mask2 = torch.native_dropout(dx, 0.3, True)
    assert not torch.equal(mask.cpu(), mask2.cpu())           # the generator moved on
    torch.ocl.manual_seed(7)
    again, amask = torch.native_dropout(dx, 0.3, True)
    same(amask, mask.cpu()); same(again, out.cpu())
    torch.ocl.set_rng_state(state)
    same(torch.native_dropout(dx, 0.3, True)[1], mask2.cpu())
    assert mask.dtype == torch.bool and abs(mask.cpu().float().mean().item() - 0.7) < 0.03
    same(out, x.mul(mask.cpu()).mul_(1 / 0.7))                # the CPU's scaling, exactly
    h = x.half()
    ho, hm = torch.native_dropout(h.to("ocl"), 0.5, True)
    same(ho, h.mul(hm.cpu()).mul_(2.0))
    g = torch.randn(64, 50)
    same(torch.ops.aten.native_dropout_backward(g.to("ocl"), mask, 1 / 0.7),
         torch.ops.aten.native_dropout_backward(g, mask.cpu(), 1 / 0.7))
    same(torch.native_dropout(dx, 0.3, False)[0], x)           # eval: the identity
    gb, mb = torch.rand(5, 5) > 0.5, torch.rand(5, 5) > 0.5       # a bool gradient: float32
    same(torch.ops.aten.native_dropout_backward(gb.to("ocl"), mb.to("ocl"), 2.0),
         torch.ops.aten.native_dropout_backward(gb, mb, 2.0))
    native_only(lambda: torch.nn.functional.dropout(dx, 0.2))
    # in-place dropout is PyTorch's bernoulli_ then mul_: the same elements kept, from the
    # same generator state, as the functional one (op_db's variant consistency)
    torch.ocl.manual_seed(5)
    functional = torch.nn.functional.dropout(dx, 0.3, True)
    torch.ocl.manual_seed(5)
    in_place = torch.nn.functional.dropout(dx.clone(), 0.3, True, inplace=True)
    same(in_place, functional.cpu())
    native_only(lambda: dx.clone().t().bernoulli_(0.25))
    b = torch.empty(100, 100, device="ocl").bernoulli_(0.25).cpu()
    assert set(b.unique().tolist()) == {0.0, 1.0} and abs(b.mean().item() - 0.25) < 0.03
    """)


@pytest.mark.opencl_full
def test_a_transformer_block_trains_as_on_the_cpu(ocl):  # noqa: F811
    ocl.run("""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(50, 32)
            self.norm = torch.nn.LayerNorm(32)
            # no bias: a key bias shifts each softmax row by a constant, so its gradient is
            # rounding noise, which AdamW scales up to a full step
            self.qkv = torch.nn.Linear(32, 96, bias=False)
            self.out = torch.nn.Linear(32, 32)
            self.head = torch.nn.Linear(32, 50)

        def forward(self, tokens):
            h = self.norm(self.emb(tokens))
            q, k, v = self.qkv(h).chunk(3, -1)
            att = torch.softmax(q @ k.transpose(1, 2) / 32 ** 0.5, -1)
            h = h + self.out(att @ v)
            return self.head(h)

    def train(device, steps=3):
        torch.manual_seed(0)
        model = Block().to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, 50, (4, 10), generator=gen).to(device)
        target = torch.randint(0, 50, (4, 10), generator=gen).to(device)
        losses = []
        for _ in range(steps):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), target.flatten())
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, [p.detach().cpu() for p in model.parameters()]

    cpu_losses, cpu_params = train("cpu")
    import json
    with torchport.ops.record() as rec:
        ocl_losses, ocl_params = train("ocl")
    torch.testing.assert_close(ocl_losses, cpu_losses, rtol=1e-5, atol=1e-5)
    for p, q in zip(ocl_params, cpu_params):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    ops = json.loads(rec.to_json())["ops"]
    for name in ("native_layer_norm", "native_layer_norm_backward", "embedding_dense_backward",
                 "index_select", "bmm", "_softmax"):
        assert name in ops and "fallback" not in json.dumps(ops[name]), (name, ops.get(name))
    """)


def test_fallback_warnings_one_per_user_line_pointing_at_it(ocl):  # noqa: F811
    ocl.run("""
    import warnings
    from torchport.ops import fallback
    x = torch.randn(3, 4).to("ocl")
    old = torchport.ops.set_fallback_warn(True)
    fallback._WARNED.clear(); fallback._WARNED_SITES.clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            text = repr(x)                       # formatting runs several ops ocl lacks
            y = torch.cumsum(x, 0)               # another line: its own warning
            y = torch.cumsum(x, 1)               # an op warned about already: quiet
    finally:
        torchport.ops.set_fallback_warn(old)
    got = [w for w in caught if issubclass(w.category, torchport.ops.FallbackWarning)]
    assert "tensor(" in text and len(got) == 2, [str(w.message) for w in got]
    assert {w.filename for w in got} == {"<opencl test>"}, [w.filename for w in got]
    assert got[1].lineno == got[0].lineno + 1 and "cumsum" in str(got[1].message)
    assert len(fallback._WARNED) > 2             # formatting's other ops count as warned
    """)


# ---- device-side index errors ----
INDEX_CASES = """
F = torch.nn.functional

def index_cases(bad):
    '''(op the error names, dimension, its size, the call, whether the CPU checks) for one
    bad index value ``bad(size)``; each call takes (x, src, grad) on one device.'''
    def t(*rows):
        return torch.tensor(rows)
    return [
        ("index_select", 0, 5, lambda x, s, g, dev: x.index_select(0, t(0, bad(5), 2).to(dev)), True),
        ("index_select", 1, 3, lambda x, s, g, dev: x.index_select(1, t(bad(3), 0).to(dev)), True),
        ("gather", 0, 5, lambda x, s, g, dev: x.gather(0, t([0, 1, 2], [bad(5), 0, 1]).to(dev)), True),
        ("gather", 1, 3, lambda x, s, g, dev: x.gather(1, t(*[[0, bad(3)]] * 5).to(dev)), True),
        ("scatter_add", 0, 5, lambda x, s, g, dev: x.scatter_add(
            0, t([0, 1, 2], [bad(5), 0, 1]).to(dev), s), True),
        ("scatter_add", 0, 5, lambda x, s, g, dev: x.clone().scatter_add_(
            0, t([bad(5), 1, 2]).to(dev), s[:1]), True),
        ("index_select", 0, 5, lambda x, s, g, dev: F.embedding(t([1, bad(5)], [0, 2]).to(dev), x), True),
        # the CPU's embedding backward does not check (it writes out of bounds)
        ("embedding_dense_backward", 0, 5, lambda x, s, g, dev: torch.ops.aten.embedding_dense_backward(
            g, t(1, bad(5)).to(dev), 5, -1, False), False),
        ("nll_loss_forward", 1, 3, lambda x, s, g, dev: F.nll_loss(x, t(0, 1, bad(3), 0, 2).to(dev)), True),
        ("nll_loss_backward", 1, 3, lambda x, s, g, dev: torch.ops.aten.nll_loss_backward(
            x.sum(), x, t(0, bad(3), 1, 0, 2).to(dev), None, 1, -100, x.sum()), True),
    ]

def raises_later(call, op, dim, size, bad, sync=lambda r: r.cpu()):
    '''``call()`` raises nothing (the kernel is queued); ``sync`` of its result raises the
    device's error, naming the device, op, index and range.'''
    r = call()
    try:
        sync(r)
    except RuntimeError as e:
        msg = str(e)
        assert msg.startswith(f"ocl:0: {op}: index {bad} is out of bounds for dimension {dim} "
                              f"with size {size} (valid: 0 to {size - 1})"), msg
        assert "TORCHPORT_LAUNCH_BLOCKING=1" in msg
        return e
    raise AssertionError(f"{op}: no error for index {bad}")
"""


def test_a_bad_index_raises_at_the_next_synchronisation(ocl):  # noqa: F811
    """As CUDA's device-side assert: not at the op, at the next synchronising call, with
    what was wrong; nothing read or written out of bounds, the device usable after."""
    ocl.run(INDEX_CASES)
    ocl.run("""
    from torchport.backends.opencl.runtime import DeviceIndexError
    x = torch.randn(5, 3)
    dx = x.to("ocl")
    i = torch.tensor([4, 9, 0]).to("ocl")
    e = raises_later(lambda: dx.index_select(0, i), "index_select", 0, 5, 9)
    assert isinstance(e, DeviceIndexError) and isinstance(e, torch.AcceleratorError)
    assert isinstance(e, IndexError)          # as the CPU's index_select raises
    same(dx.index_select(0, i.clamp(max=4)), x.index_select(0, i.cpu().clamp(max=4)))
    same(dx, x); same(i, torch.tensor([4, 9, 0]))
    g = torch.tensor([[0, -1, 2]]).to("ocl")
    e = raises_later(lambda: dx.gather(0, g), "gather", 0, 5, -1,
                     sync=lambda r: torch.ocl.synchronize())
    assert not isinstance(e, IndexError)      # the CPU's gather raises RuntimeError
    try:
        x.gather(0, g.cpu())
    except RuntimeError as cpu:
        assert str(cpu) in str(e), (str(cpu), str(e))
    same(dx.gather(0, g.abs()), x.gather(0, g.cpu().abs()))
    """)


@pytest.mark.opencl_full
def test_every_index_kernel_reports_bad_indices_as_the_cpu_refuses_them(ocl):  # noqa: F811
    ocl.run(INDEX_CASES)
    ocl.run("""
    x, s, g = torch.randn(5, 3), torch.randn(2, 3), torch.randn(2, 3)
    dx, ds, dg = x.to("ocl"), s.to("ocl"), g.to("ocl")
    for bad in (lambda n: n, lambda n: -1, lambda n: n + 4, lambda n: -n - 1):
        for op, dim, size, call, cpu_checks in index_cases(bad):
            if cpu_checks:
                try:
                    call(x, s, g, "cpu")
                except (IndexError, RuntimeError) as cpu:
                    cpu_error = cpu
                else:
                    raise AssertionError(f"the CPU's {op} took index {bad(size)}")
            e = raises_later(lambda: call(dx, ds, dg, "ocl"), op, dim, size, bad(size))
            if cpu_checks:  # what catches the CPU's error catches it
                assert isinstance(e, type(cpu_error)), (op, e, cpu_error)
            same(dx, x); same(ds, s); same(dg, g)                # inputs unchanged
    # after the errors, valid calls give the CPU's results
    for op, dim, size, call, _ in index_cases(lambda n: n - 1):
        close(call(dx, ds, dg, "ocl"), call(x, s, g, "cpu"))
    # other synchronising calls: .item(), printing, an event, a stream
    i = torch.tensor([7]).to("ocl")
    raises_later(lambda: dx.index_select(0, i), "index_select", 0, 5, 7, sync=lambda r: r.sum().item())
    raises_later(lambda: dx.index_select(0, i), "index_select", 0, 5, 7, sync=repr)
    def on_event(r):
        ev = torch.ocl.Event(); ev.record(); ev.synchronize()
    raises_later(lambda: dx.index_select(0, i), "index_select", 0, 5, 7, sync=on_event)
    s1 = torch.ocl.Stream()
    def on_stream(r):
        s1.synchronize()
    with torch.ocl.stream(s1):
        raises_later(lambda: dx.index_select(0, i), "index_select", 0, 5, 7, sync=on_stream)
    # several bad ops before one synchronisation: the first is reported, then all is clear
    bad_rows = torch.tensor([[0, 0, 6]]).to("ocl")    # a copy to the device synchronises too
    dx.index_select(0, i); dx.gather(0, bad_rows)
    raises_later(lambda: None, "index_select", 0, 5, 7, sync=lambda r: torch.ocl.synchronize())
    torch.ocl.synchronize()
    same(dx.index_select(0, i - 3), x.index_select(0, torch.tensor([4])))
    # TORCHPORT_LAUNCH_BLOCKING=1: the op itself raises, as CUDA_LAUNCH_BLOCKING=1
    import os
    os.environ["TORCHPORT_LAUNCH_BLOCKING"] = "1"
    try:
        raises_later(lambda: None, "index_select", 0, 5, 7, sync=lambda r: dx.index_select(0, i))
    finally:
        del os.environ["TORCHPORT_LAUNCH_BLOCKING"]
    same(dx.index_select(0, i - 7), x.index_select(0, torch.tensor([0])))
    """)


def test_what_the_cpu_refuses_or_wraps_the_device_does_too(ocl):  # noqa: F811
    """What the fuzzer found on ocl: a bool subtraction with a Python bool and ``abs`` of bool
    computed where the CPU raises; a fill value out of the dtype's range raised Python's
    OverflowError (the CPU: its RuntimeError, nothing written); an integer scalar operand out
    of range raised where the CPU wraps it (``where(c, uint8, -5)`` takes 251); a sum into a
    complex dtype raised KeyError; building some kernels warned pyopencl's compiler output."""
    ocl.run("""
    import warnings
    cases = {
        "bool - True": lambda d: torch.tensor([True, False], device=d) - True,
        "True - bool": lambda d: True - torch.tensor([True, False], device=d),
        "abs of bool": lambda d: torch.tensor([True, False], device=d).abs(),
        "fill_ int8 1000": lambda d: torch.zeros(2, dtype=torch.int8, device=d).fill_(1000),
        "fill_ int8 1e10": lambda d: torch.zeros(2, dtype=torch.int8, device=d).fill_(1e10),
        "fill_ half 1e5": lambda d: torch.zeros(2, dtype=torch.half, device=d).fill_(1e5),
        "fill_ half inf": lambda d: torch.zeros(2, dtype=torch.half, device=d).fill_(float("inf")),
        "where uint8 -5": lambda d: torch.where(torch.tensor([True, False], device=d),
                                                torch.ones(2, dtype=torch.uint8, device=d), -5),
        "where int8 300": lambda d: torch.where(torch.tensor([True, False], device=d),
                                                torch.ones(2, dtype=torch.int8, device=d), 300),
        "sum into complex": lambda d: torch.ones(3, dtype=torch.uint8, device=d).sum(
            dtype=torch.complex64),
        "floor_divide uint8": lambda d: torch.floor_divide(
            torch.tensor([4, 5], dtype=torch.uint8, device=d), 2),
        "neg int8, out float32": lambda d: torch.neg(torch.ones(3, dtype=torch.int8, device=d),
                                                     out=torch.empty(3, device=d)),
        "int32 mul_ float32": lambda d: torch.ones(3, dtype=torch.int32, device=d).mul_(
            torch.full((3,), 1.5, device=d)),
        "bool mul_ 2": lambda d: torch.ones(3, dtype=torch.bool, device=d).mul_(2),
    }
    for name, f in cases.items():
        got = []
        for d in ("cpu", "ocl"):
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                try:
                    r = f(d).cpu()
                except Exception as e:
                    r = (type(e), str(e))
            said = [str(w.message) for w in said if w.category.__name__ != "FallbackWarning"]
            got.append((r, said))
        (want, wwarn), (have, hwarn) = got
        assert wwarn == hwarn, (name, wwarn, hwarn)
        if isinstance(want, tuple):
            assert have == want, (name, have, want)
        else:
            same_dtype = isinstance(have, torch.Tensor) and have.dtype == want.dtype
            assert same_dtype and torch.equal(have, want), (name, have, want)
    """)


def test_overlapping_outputs_raise_as_on_the_cpu(ocl):  # noqa: F811
    """The CPU's memory-overlap errors for out=/in-place calls of the device's kernels (an
    out= kernel's derived overloads, a plain in-place kernel, the copies), the same type
    and message; full overlap (in place on itself) still computes."""
    ocl.run("""
    cases = {
        "add, out a shifted input": lambda a, m, i: torch.add(a[1:], a[:-1], out=a[1:]),
        "add_ of its transpose": lambda a, m, i: m.add_(m.t()),
        "mul_ into an expanded self": lambda a, m, i: a[:1].expand(3).mul_(2),
        "mul, out expanded": lambda a, m, i: torch.mul(a[:3], 2, out=a[:1].expand(3)),
        "relu_ (a plain kernel) expanded": lambda a, m, i: torch.relu_(a[:1].expand(3)),
        "copy_ into an expanded view": lambda a, m, i: a[:1].expand(3).copy_(a[2:5]),
        "copy_ from the host into an expanded view": lambda a, m, i: a[:1].expand(3).copy_(
            torch.ones(3)),
        "copy_ shifted": lambda a, m, i: a[1:].copy_(a[:-1]),
        "index_select, out its input": lambda a, m, i: torch.index_select(a, 0, i, out=a[:3]),
        "where, out a shifted input": lambda a, m, i: torch.where(a[:5] > 0, a[:5], a[1:], out=a[1:]),
        "addcmul_ shifted": lambda a, m, i: a[1:].addcmul_(a[:-1], a[:-1]),
        "neg, out shifted": lambda a, m, i: torch.neg(a[:-1], out=a[1:]),
        "masked_fill_ by a shifted mask": lambda a, m, i: (b := (m > 0).view(-1))[1:].masked_fill_(
            b[:-1], False),
        # ops on the CPU fallback: one host copy per device storage, its overlap seen
        "cat, out one of its inputs' rows": lambda a, m, i: torch.cat((m, m[:2]), out=m[2:]),
        "take, out over its index": lambda a, m, i: torch.take(a, i[1:], out=i[:-1]),
    }
    fine = {
        "add_ of itself": lambda a, m, i: a.add_(a),
        "exp, out its input": lambda a, m, i: torch.exp(a, out=a),
        "relu_": lambda a, m, i: torch.relu_(m),
        "masked_fill_ by itself": lambda a, m, i: (b := m > 0).masked_fill_(b, False),
        "fill_ expanded": lambda a, m, i: a[:1].expand(3).fill_(2),
        "copy_ to a wider dtype, shifted": lambda a, m, i: a[1:].copy_(a[:-1].double()),
        "gather, out beside its input": lambda a, m, i: torch.gather(m[:, :2], 0, i[None, :2].expand(2, 2), out=m[:2, 2:]),
    }
    def outcome(dev, f):
        torch.manual_seed(0)
        a, m, i = torch.randn(6).to(dev), torch.randn(4, 4).to(dev), torch.tensor([0, 2, 1]).to(dev)
        try:
            f(a, m, i)
        except Exception as e:
            return type(e), str(e), a.cpu(), m.cpu()
        return None, None, a.cpu(), m.cpu()
    for name, f in {**cases, **fine}.items():
        want, got = outcome("cpu", f), outcome("ocl", f)
        assert (want[0] is None) == (name in fine), (name, want)
        assert got[:2] == want[:2], (name, got[:2], want[:2])
        assert torch.equal(got[2], want[2]) and torch.equal(got[3], want[3]), name
    """)


# ---- two devices ----
@pytest.fixture(scope="module")
def two(ocl2):  # noqa: F811
    ocl2.run(HELPERS)
    return ocl2


@pytest.mark.opencl_full
def test_two_devices_copy_between_them_strided_and_both_ways(two):
    two.run("""
    rt = ocl.runtime
    assert rt.device_count() == 2 and rt.contexts[0] is not rt.contexts[1]
    x = torch.randn(6, 5)
    a = x.to("ocl:0")
    b = a.to("ocl:1")
    assert b.device == torch.device("ocl:1") and torchport.device_index(b) == 0  # reversed
    rt.locate(0, torchport.device_address(b))              # the runtime's device 0's memory
    same(b, x); same(b.to("ocl:0"), x); same(a.to("ocl:1", non_blocking=True), x)
    same(a.t().to("ocl:1"), x.t())                         # a strided source
    same(a[1:, ::2].to("ocl:1"), x[1:, ::2])
    same(a.to("ocl:1", torch.float64), x.double())          # and a dtype conversion
    same(a.t().to("ocl:1", torch.float16), x.t().half())
    for src, dst, want in ((a.t(), torch.empty(5, 6, device="ocl:1"), x.t()),
                           (a.t(), torch.empty(6, 5, device="ocl:1").t(), x.t()),
                           (a[:, :2], torch.zeros(6, 4, device="ocl:1")[:, 1:3], x[:, :2]),
                           (b[::2], torch.empty(3, 5, device="ocl:0"), x[::2])):
        dst.copy_(src)
        same(dst, want)
    c = torch.zeros(6, 10, device="ocl:1")
    c[:, ::2] = a                                        # a strided destination
    want = torch.zeros(6, 10); want[:, ::2] = x
    same(c, want)
    same(b.t().contiguous().to("ocl:0"), x.t().contiguous())
    try:
        a + b
    except RuntimeError as e:
        assert "ocl:0 and ocl:1" in str(e)
    else:
        raise AssertionError("no error for operands on two devices")
    """)


@pytest.mark.opencl_full
def test_kernels_on_the_second_device_run_there_and_a_model_moves(two):
    two.run("""
    rt = ocl.runtime
    queues = []
    orig = rt.queue
    def queue(index, stream):
        queues.append(index)
        return orig(index, stream)
    x = torch.randn(8, 5)
    b = x.to("ocl:1")
    rt.queue = queue
    try:
        y = torch.relu(b * 2 + 1) @ b.t()
    finally:
        del rt.queue
    assert y.device == torch.device("ocl:1") and queues and set(queues) == {0}, queues
    close(y, torch.relu(x * 2 + 1) @ x.t())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    ref = model(x)
    model.to("ocl:0")
    y0 = model(x.to("ocl:0"))
    model.to("ocl:1")
    assert {p.device for p in model.parameters()} == {torch.device("ocl:1")}
    y1 = model(b)
    assert y1.device == torch.device("ocl:1")
    same(y1, y0.cpu()); close(y1, ref.detach())
    y1.sum().backward()
    assert model[0].weight.grad.device == torch.device("ocl:1")
    with torch.ocl.device(1):                            # the current device, its streams
        s = torch.ocl.Stream()
        with torch.ocl.stream(s):
            z = torch.ones(4, device="ocl") * 3
        s.synchronize()
    assert z.device == torch.device("ocl:1")
    same(z, torch.full((4,), 3.0))
    # each device's own generator, by torch.ocl's numbering
    with torch.ocl.device(0):
        torch.ocl.manual_seed(6)
    with torch.ocl.device(1):
        torch.ocl.manual_seed(5)
    mask = torch.native_dropout(b, 0.5, True)[1].cpu()
    torch.native_dropout(a := x.to("ocl:0"), 0.5, True)   # moves device 0's generator on
    with torch.ocl.device(1):
        torch.ocl.manual_seed(5)
    same(torch.native_dropout(b, 0.5, True)[1], mask)
    i = torch.tensor([0, 8]).to("ocl:1")                 # device 1's own error word
    b.index_select(0, i)
    try:
        torch.ocl.synchronize(1)
    except RuntimeError as e:
        assert str(e).startswith("ocl:1: index_select: index 8 is out of bounds"), str(e)
    else:
        raise AssertionError("no error on ocl:1")
    torch.ocl.synchronize(0); torch.ocl.synchronize(1)
    same(b.index_select(0, i.clamp(max=7)), x.index_select(0, torch.tensor([0, 7])))
    """)
