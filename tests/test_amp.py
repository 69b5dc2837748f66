"""Autocast on sim follows CUDA's cast policy; GradScaler and Apex-style AMP train correctly."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchport.device.amp as tamp
import torchport.sim  # noqa: F401
from torchport.core import native
from torchport.device.amp import policy

LOW, FP32, WIDEST = "low", "fp32", "widest"


def _cases() -> dict[str, tuple[str, Callable[[str], torch.Tensor]]]:
    """op -> (expected output dtype class under CUDA autocast, fn(device))."""
    def r(*s: int, dev: str) -> torch.Tensor:
        g = torch.Generator().manual_seed(sum(s))
        return torch.rand(*s, generator=g).add(0.5).to(dev)

    return {
        # lower precision
        "mm": (LOW, lambda d: torch.mm(r(3, 4, dev=d), r(4, 5, dev=d))),
        "matmul": (LOW, lambda d: r(2, 3, 4, dev=d) @ r(4, 5, dev=d)),
        "bmm": (LOW, lambda d: torch.bmm(r(2, 3, 4, dev=d), r(2, 4, 5, dev=d))),
        "addmm": (LOW, lambda d: torch.addmm(r(5, dev=d), r(3, 4, dev=d), r(4, 5, dev=d))),
        "baddbmm": (LOW, lambda d: torch.baddbmm(r(2, 3, 5, dev=d), r(2, 3, 4, dev=d),
                                                 r(2, 4, 5, dev=d))),
        "mv": (LOW, lambda d: torch.mv(r(3, 4, dev=d), r(4, dev=d))),
        "linear": (LOW, lambda d: F.linear(r(3, 4, dev=d), r(5, 4, dev=d), r(5, dev=d))),
        "conv2d": (LOW, lambda d: F.conv2d(r(1, 2, 6, 6, dev=d), r(3, 2, 3, 3, dev=d))),
        "conv1d": (LOW, lambda d: F.conv1d(r(1, 2, 6, dev=d), r(3, 2, 3, dev=d))),
        "einsum": (LOW, lambda d: torch.einsum("ij,jk->ik", r(3, 4, dev=d), r(4, 5, dev=d))),
        "prelu": (LOW, lambda d: F.prelu(r(2, 3, dev=d), r(1, dev=d))),
        "addr": (LOW, lambda d: torch.addr(r(3, 4, dev=d), r(3, dev=d), r(4, dev=d))),
        # fp32 (inputs given in the lower dtype to show the upcast)
        "exp": (FP32, lambda d: torch.exp(r(4, dev=d).half())),
        "log": (FP32, lambda d: torch.log(r(4, dev=d).half())),
        "pow": (FP32, lambda d: torch.pow(r(4, dev=d).half(), 2)),
        "rsqrt": (FP32, lambda d: torch.rsqrt(r(4, dev=d).half())),
        "softplus": (FP32, lambda d: F.softplus(r(4, dev=d).half())),
        "layer_norm": (FP32, lambda d: F.layer_norm(r(2, 4, dev=d).half(), (4,))),
        "group_norm": (FP32, lambda d: F.group_norm(r(2, 4, 3, dev=d).half(), 2)),
        "mse_loss": (FP32, lambda d: F.mse_loss(r(4, dev=d).half(), r(4, dev=d).half())),
        "l1_loss": (FP32, lambda d: F.l1_loss(r(4, dev=d).half(), r(4, dev=d))),
        "nll_loss": (FP32, lambda d: F.nll_loss(r(3, 5, dev=d).half(),
                                                 torch.tensor([0, 2, 4]).to(d))),
        "bce_logits": (FP32, lambda d: F.binary_cross_entropy_with_logits(
            r(4, dev=d).half(), r(4, dev=d).half())),
        "cosine_similarity": (FP32, lambda d: F.cosine_similarity(r(2, 4, dev=d).half(),
                                                                   r(2, 4, dev=d).half())),
        "logsumexp": (FP32, lambda d: torch.logsumexp(r(3, 4, dev=d).half(), 1)),
        "upsample_nearest2d": (FP32, lambda d: F.interpolate(r(1, 1, 2, 2, dev=d).half(),
                                                              scale_factor=2)),
        "vector_norm": (FP32, lambda d: torch.linalg.vector_norm(r(4, dev=d).half())),
        "cdist": (FP32, lambda d: torch.cdist(r(2, 3, dev=d).half(), r(4, 3, dev=d).half())),
        # fp32 set-opt-dtype / append-dtype
        "softmax": (FP32, lambda d: torch.softmax(r(3, 4, dev=d).half(), 1)),
        "log_softmax": (FP32, lambda d: torch.log_softmax(r(3, 4, dev=d).half(), 1)),
        "sum": (FP32, lambda d: r(3, 4, dev=d).half().sum()),
        "sum_dim": (FP32, lambda d: r(3, 4, dev=d).half().sum(1)),
        "cumsum": (FP32, lambda d: torch.cumsum(r(4, dev=d).half(), 0)),
        "prod": (FP32, lambda d: r(4, dev=d).half().prod()),
        "norm": (FP32, lambda d: r(4, dev=d).half().norm()),
        "norm_dim": (FP32, lambda d: torch.norm(r(3, 4, dev=d).half(), 2, 1)),
        # promote (one fp32 and one lower-precision input)
        "addcmul": (WIDEST, lambda d: torch.addcmul(r(4, dev=d), r(4, dev=d).half(),
                                                    r(4, dev=d).half())),
        "addcdiv": (WIDEST, lambda d: torch.addcdiv(r(4, dev=d).half(), r(4, dev=d),
                                                    r(4, dev=d).half())),
        "atan2": (WIDEST, lambda d: torch.atan2(r(4, dev=d).half(), r(4, dev=d))),
        "dot": (WIDEST, lambda d: torch.dot(r(4, dev=d).half(), r(4, dev=d))),
        "cross": (WIDEST, lambda d: torch.cross(r(2, 3, dev=d), r(2, 3, dev=d).half(), dim=1)),
        "scatter_add": (WIDEST, lambda d: torch.zeros(5).to(d).half().scatter_add(
            0, torch.tensor([0, 1, 1]).to(d), r(3, dev=d))),
        # not in any list: runs in the inputs' dtype
        "add": ("same", lambda d: r(4, dev=d).half() + r(4, dev=d).half()),
        "relu": ("same", lambda d: F.relu(r(4, dev=d))),
    }


CASES = _cases()
#: the promote cases whose first input is float32
FLOAT32_FIRST = frozenset({"addcmul", "cross"})


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(CASES))
def test_autocast_output_dtype_matches_cuda_policy(name: str, dtype: torch.dtype) -> None:
    kind, fn = CASES[name]
    if kind == WIDEST and dtype == torch.bfloat16 and name not in FLOAT32_FIRST:
        # CUDA's promote type (at::autocast::prioritize) takes the inputs in order: a
        # float16 input under bfloat16 autocast raises unless a float32 one came first
        with torch.autocast(device_type="sim", dtype=dtype), \
                pytest.raises(RuntimeError, match="Unexpected floating ScalarType"):
            fn("sim")
        return
    with torch.autocast(device_type="sim", dtype=dtype):
        out = fn("sim")
    expected = {LOW: dtype, FP32: torch.float32, WIDEST: torch.float32}.get(kind)
    if kind == "same":
        with torch.autocast(device_type="sim", enabled=False):
            expected = fn("sim").dtype
    assert out.dtype == expected, f"{name}: {out.dtype} != {expected}"
    # Values: the CPU oracle with inputs cast as autocast casts them.
    if kind == LOW:
        ref = fn("cpu").to(torch.float32)
        tol = 3e-2 if dtype == torch.bfloat16 else 5e-3
        torch.testing.assert_close(out.cpu().float(), ref, rtol=tol, atol=tol)
    elif kind in (FP32, WIDEST):
        try:  # CPU computes with the half inputs as given (exactly representable in fp32)
            ref = fn("cpu").to(torch.float32)
        except (NotImplementedError, RuntimeError):  # no CPU half kernel, or mixed dtypes
            return
        torch.testing.assert_close(out.cpu(), ref, rtol=5e-3, atol=5e-3)


@pytest.mark.parametrize("name", ["mm", "matmul", "bmm", "addmm", "baddbmm", "linear",
                                  "conv2d", "conv1d"])
def test_lower_precision_ops_agree_with_cpu_autocast(name: str) -> None:
    """CPU autocast (bf16) uses the same lower-precision policy for these ops."""
    _, fn = CASES[name]
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        ref = fn("cpu")
    with torch.autocast(device_type="sim", dtype=torch.bfloat16):
        out = fn("sim")
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out.cpu(), ref, rtol=2e-2, atol=2e-2)


def test_policy_covers_cuda_autocast_registrations() -> None:
    """Every op PyTorch registers for AutocastCUDA (but cuDNN-only ones) has a sim policy."""
    ours = set()
    for n in policy.policy_table():
        op = policy._overload(n)
        ours.add(op._schema.name + ("." + op._schema.overload_name
                                    if op._schema.overload_name else ""))
    cuda = set(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA"))
    missing = {n for n in cuda - ours if "cudnn" not in n}
    assert not missing, sorted(missing)
    for n in ours:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(n, policy.KEY), n


def test_binary_cross_entropy_is_banned() -> None:
    p = torch.rand(4).to("sim")
    with torch.autocast(device_type="sim"), pytest.raises(RuntimeError, match="unsafe to autocast"):
        F.binary_cross_entropy(p, p)


def test_autocast_backward_and_grad_dtypes() -> None:
    w = torch.randn(4, 4).to("sim").requires_grad_()
    x = torch.randn(3, 4).to("sim")
    with torch.sim.amp.autocast(dtype=torch.bfloat16):
        y = x @ w
        loss = y.float().pow(2).sum()
    assert y.dtype == torch.bfloat16
    loss.backward()
    assert w.grad.dtype == torch.float32
    ref = 2 * x.cpu().t() @ (x.cpu() @ w.detach().cpu())
    torch.testing.assert_close(w.grad.cpu(), ref, rtol=5e-2, atol=5e-2)


def _weight_casts(device: str, cache_enabled: bool) -> tuple[bool, bool]:
    """(the two products of one autocast region read one cast of the weight, the next
    region casts it again)."""
    w = torch.randn(4, 4, device=device, requires_grad=True)
    x = torch.randn(3, 4, device=device)

    def cast_of_weight(y: torch.Tensor) -> object:
        return y.grad_fn.next_functions[1][0]

    with torch.autocast(device, dtype=torch.bfloat16, cache_enabled=cache_enabled):
        a, b = x @ w, x @ w
    with torch.autocast(device, dtype=torch.bfloat16, cache_enabled=cache_enabled):
        c = x @ w
    return cast_of_weight(a) is cast_of_weight(b), cast_of_weight(c) is cast_of_weight(a)


def test_casts_of_a_weight_are_cached_within_an_autocast_region_as_on_the_cpu() -> None:
    if native.load() is None:
        pytest.skip("the Python autocast policy does not cache casts (docs/limitations.md)")
    for cache_enabled in (True, False):
        expected = _weight_casts("cpu", cache_enabled)
        assert expected == (cache_enabled, False)
        assert _weight_casts("sim", cache_enabled) == expected, cache_enabled


def test_autocast_disabled_and_nested() -> None:
    a = torch.randn(2, 2).to("sim")
    with torch.autocast(device_type="sim", dtype=torch.float16):
        assert torch.is_autocast_enabled("sim")
        with torch.autocast(device_type="sim", enabled=False):
            assert (a @ a).dtype == torch.float32
        assert (a @ a).dtype == torch.float16
    assert (a @ a).dtype == torch.float32
    assert (a.double() @ a.double()).dtype == torch.float64


def test_float64_and_cpu_tensors_not_cast() -> None:
    a = torch.randn(2, 2, dtype=torch.float64).to("sim")
    with torch.autocast(device_type="sim"):
        assert (a @ a).dtype == torch.float64
        assert (torch.randn(2, 2) @ torch.randn(2, 2)).dtype == torch.float32


def test_supported_dtypes_and_unsupported_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    assert torch.sim.is_bf16_supported()
    assert set(torch.sim.get_amp_supported_dtype()) == {torch.float16, torch.bfloat16}
    rt = torch.sim.backend.runtime
    monkeypatch.setattr(rt, "unsupported_dtypes", frozenset({torch.bfloat16}))
    assert not torch.sim.is_bf16_supported()
    assert torch.sim.get_amp_supported_dtype() == [torch.float16]
    a = torch.randn(2, 2).to("sim")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        with torch.autocast(device_type="sim", dtype=torch.bfloat16):
            assert (a @ a).dtype == torch.float32  # autocast disabled, not bf16
    assert any("bfloat16" in str(w.message) or "not supported" in str(w.message) for w in rec)


def test_custom_fwd_bwd() -> None:
    class MyMM(torch.autograd.Function):
        @staticmethod
        @torch.sim.amp.custom_fwd(cast_inputs=torch.float32)
        def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(a, b)
            return a.mm(b)

        @staticmethod
        @torch.sim.amp.custom_bwd
        def backward(ctx, g: torch.Tensor):
            a, b = ctx.saved_tensors
            return g.mm(b.t()), a.t().mm(g)

    a = torch.randn(2, 2).to("sim").requires_grad_()
    with torch.autocast(device_type="sim"):
        out = MyMM.apply(a, a)
    assert out.dtype == torch.float32
    out.sum().backward()
    assert a.grad is not None


# ---- GradScaler -------------------------------------------------------------------
def _data(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    w = torch.randn(16, 1, generator=g)
    y = torch.tanh(x @ w) + 0.05 * torch.randn(n, 1, generator=g)
    return x, y


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))


def _train(device: str, steps: int, amp_dtype: torch.dtype | None,
           scaler: torch.amp.GradScaler | None = None) -> float:
    x, y = (t.to(device) for t in _data())
    model = _model().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss = None
    for _ in range(steps):
        opt.zero_grad()
        with torch.autocast(device_type=device.split(":")[0], dtype=amp_dtype or torch.float16,
                            enabled=amp_dtype is not None):
            loss = F.mse_loss(model(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
    return float(loss.item())


def test_gradscaler_bf16_training_matches_fp32() -> None:
    fp32 = _train("cpu", 200, None)
    amp = _train("sim", 200, torch.bfloat16, torch.amp.GradScaler("sim"))
    assert abs(amp - fp32) <= 0.02 * fp32 + 1e-4, (amp, fp32)


def test_gradscaler_skips_inf_step_and_backs_off() -> None:
    model = _model().to("sim")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.sim.amp.GradScaler(init_scale=1024.0, growth_interval=2)
    x, y = (t.to("sim") for t in _data(32))
    before = [p.detach().cpu().clone() for p in model.parameters()]
    with torch.sim.amp.autocast(dtype=torch.float16):
        loss = F.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    model[0].weight.grad[0, 0] = float("inf")  # injected overflow
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 512.0
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.detach().cpu(), b), "step was not skipped"
    for _ in range(2):  # two clean steps: the scale grows (growth_interval=2)
        opt.zero_grad()
        with torch.sim.amp.autocast(dtype=torch.float16):
            loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    assert scaler.get_scale() == 1024.0
    assert not torch.equal(model[0].weight.detach().cpu(), before[0])


def test_gradscaler_unscale_and_nan() -> None:
    p = nn.Parameter(torch.ones(3).to("sim"))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = torch.amp.GradScaler("sim", init_scale=8.0)
    scaler.scale((p * 2).sum()).backward()
    assert torch.equal(p.grad.cpu(), torch.full((3,), 16.0))
    scaler.unscale_(opt)
    assert torch.equal(p.grad.cpu(), torch.full((3,), 2.0))
    scaler.step(opt)
    scaler.update()
    assert torch.equal(p.detach().cpu(), torch.full((3,), -1.0))
    opt.zero_grad()
    scaler.scale((p * float("nan")).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 4.0
    assert torch.equal(p.detach().cpu(), torch.full((3,), -1.0))


def test_gradscaler_state_dict_round_trip() -> None:
    s = torch.sim.amp.GradScaler(init_scale=256.0, growth_factor=3.0, backoff_factor=0.25,
                                 growth_interval=7)
    p = nn.Parameter(torch.ones(2).to("sim"))
    opt = torch.optim.SGD([p], lr=0.1)
    s.scale(p.sum()).backward()
    s.step(opt)
    s.update()
    sd = s.state_dict()
    assert sd["scale"] == 256.0 and sd["_growth_tracker"] == 1 and sd["growth_interval"] == 7
    t = torch.amp.GradScaler("sim")
    t.load_state_dict(sd)
    assert t.state_dict() == sd
    assert t.get_scale() == 256.0 and t.get_growth_factor() == 3.0


# ---- Apex-style AMP -----------------------------------------------------------------
class _BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(16, 32)
        self.bn = nn.BatchNorm1d(32)
        self.fc2 = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def _train_apex(device: str, opt_level: str | None, steps: int = 60,
                loss_scale: str | float = "dynamic") -> tuple[float, nn.Module]:
    x, y = (t.to(device) for t in _data())
    model = _BNNet().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if opt_level is not None:
        model, opt = tamp.initialize(model, opt, opt_level=opt_level, loss_scale=loss_scale)
    loss = None
    for _ in range(steps):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        if opt_level is None:
            loss.backward()
        else:
            with tamp.scale_loss(loss, opt) as scaled:
                scaled.backward()
        opt.step()
    return float(loss.item()), model


def test_apex_o2_matches_fp32() -> None:
    fp32, _ = _train_apex("cpu", None)
    o2, model = _train_apex("sim", "O2")
    assert model.fc1.weight.dtype == torch.float16
    assert model.bn.weight.dtype == torch.float32
    assert abs(o2 - fp32) <= 0.02 * fp32 + 1e-4, (o2, fp32)


def test_apex_o1_matches_fp32_static_scale() -> None:
    fp32, _ = _train_apex("cpu", None, steps=40)
    o1, model = _train_apex("sim", "O1", steps=40, loss_scale=128.0)
    assert model.fc1.weight.dtype == torch.float32
    assert abs(o1 - fp32) <= 0.02 * fp32 + 1e-4, (o1, fp32)


def test_apex_o1_runs_lower_precision_ops_in_fp16() -> None:
    model = nn.Linear(4, 4).to("sim")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = tamp.initialize(model, opt, opt_level="O1")
    assert model(torch.randn(2, 4).to("sim")).dtype == torch.float16


def test_apex_dynamic_scale_skips_overflow() -> None:
    model = nn.Linear(4, 1).to("sim")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = tamp.initialize(model, opt, opt_level="O2")
    stash = opt._torchport_amp
    before = model.weight.detach().cpu().clone()
    out = model(torch.randn(2, 4).to("sim")).sum() * float("inf")
    with tamp.scale_loss(out, opt) as scaled:
        scaled.backward()
    opt.step()
    assert stash.scaler.scale == 2.0**15
    assert torch.equal(model.weight.detach().cpu(), before)


def test_apex_errors() -> None:
    model = nn.Linear(2, 2).to("sim")
    with pytest.raises(ValueError, match="opt_level"):
        tamp.initialize(model, opt_level="O7")
    with pytest.raises(RuntimeError, match="initialize"):
        with tamp.scale_loss(torch.ones(()), torch.optim.SGD(model.parameters(), lr=1.0)):
            pass


def test_linalg_cross_is_not_promoted_as_on_cuda():
    # CUDA's promote list names ``cross`` only: ``linalg.cross`` of mixed dtypes raises
    # under autocast on CUDA, as it does on the CPU and on sim.
    a, b = torch.randn(2, 3), torch.randn(2, 3).half()
    with pytest.raises(RuntimeError) as cpu_err:
        torch.linalg.cross(a, b)
    with torch.autocast(device_type="sim", dtype=torch.float16):
        with pytest.raises(RuntimeError) as sim_err:
            torch.linalg.cross(a.to("sim"), b.to("sim"))
    assert str(sim_err.value).split("(")[0] == str(cpu_err.value).split("(")[0]
