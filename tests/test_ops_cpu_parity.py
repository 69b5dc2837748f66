"""Ops the CPU computes with a fused kernel compute the CPU's bits on the device.

Two ways an op used to leave the CPU's kernel on the device, with other rounding:

* a CompositeImplicitAutograd overload that also has a CPU kernel (``silu_backward``,
  ``mish_backward``): the dispatcher runs the CPU kernel on the CPU, but the device's
  declaration was skipped as "decomposed above the backend";
* an op with a ``torch._decomp`` decomposition and no device kernel: the op layer
  prefers the decomposition to the CPU fallback (``log_sigmoid_forward``,
  ``multi_margin_loss``, ``_weight_norm_interface``...). The sim declares those whose
  decomposition rounds otherwise than the CPU kernel (found by comparing each
  decomposition with the CPU kernel over op_db's samples).

``_weight_norm`` itself does not branch on the device type in PyTorch 2.13: it calls
the fused ``_weight_norm_interface`` when ``dim`` is the first or last dimension, on
every device, so the device takes the CPU's branch without help.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchport import ops
from torchport.ops import registry

pytestmark = pytest.mark.modes

A = torch.ops.aten
has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key

FLOATS = [torch.float32, torch.float64, torch.bfloat16]

# What the sweep over ``torch._decomp`` found: decompositions of ops with a CPU kernel
# that round otherwise than that kernel, now native on the sim.
DECOMPOSED_OTHERWISE = [
    "log_sigmoid_forward", "log_sigmoid_backward", "multi_margin_loss",
    "multi_margin_loss_backward", "multilabel_margin_loss_forward",
    "multilabel_margin_loss_backward", "_weight_norm_interface",
    "_weight_norm_interface_backward", "renorm", "renorm_", "trace", "special_entr",
    "special_i0e", "special_log_ndtr", "special_xlog1py", "xlogy", "xlogy_", "sinc", "sinc_",
    "linspace", "_addmm_activation",
]


def composite_overloads_with_cpu_kernel() -> list[str]:
    """ATen overloads with both a CompositeImplicitAutograd and a CPU kernel: the CPU runs
    its own kernel for them, so the device must be able to as well."""
    found, seen = [], set()
    for s in torch._C._jit_get_all_schemas():
        name = s.name + ("." + s.overload_name if s.overload_name else "")
        if not name.startswith("aten::") or name in seen:
            continue
        seen.add(name)
        try:
            if has_kernel(name, "CompositeImplicitAutograd") and has_kernel(name, "CPU"):
                found.append(name)
        except RuntimeError:  # TorchScript-only overloads
            continue
    return found


def _op(full: str) -> torch._ops.OpOverload:
    base, _, overload = full.removeprefix("aten::").partition(".")
    return getattr(getattr(A, base), overload or "default")


def test_composites_with_a_cpu_kernel_keep_a_backend_slot():
    found = composite_overloads_with_cpu_kernel()
    assert {"aten::silu_backward", "aten::mish_backward"} <= set(found)
    assert all(registry._has_backend_slot(_op(n)) for n in found)
    # the other composites still decompose above the backend
    assert not registry._has_backend_slot(A.log_sigmoid.default)
    assert not registry._has_backend_slot(A.multilabel_margin_loss.default)


def test_declared_composites_with_a_cpu_kernel_are_registered():
    from torchport.backends.sim import kernels
    declared = set(kernels.MODEL_OPS + kernels.CORE_OPS + kernels.EXACT_OPS)
    found = [n for n in composite_overloads_with_cpu_kernel()
             if n.removeprefix("aten::").split(".")[0] in declared]
    assert {"aten::silu_backward", "aten::mish_backward"} <= set(found)
    missing = [n for n in found if not has_kernel(n, "PrivateUse1")]
    assert not missing, missing


@pytest.mark.parametrize("name", DECOMPOSED_OTHERWISE)
def test_sweep_findings_are_native(name):
    packet = getattr(A, name)
    assert any(has_kernel(getattr(packet, o).name(), "PrivateUse1")
               for o in packet.overloads()), name


def _grad_parity(fn, dtype, *inputs, grad_of=(0,)):
    """``fn`` on the CPU and the device: results and gradients bit for bit; returns the
    device run's op record."""
    cpu = [x.clone().requires_grad_(i in grad_of) for i, x in enumerate(inputs)]
    dev = [x.to("sim").requires_grad_(i in grad_of) for i, x in enumerate(inputs)]
    want = fn(*cpu)
    want.backward(torch.ones_like(want))
    with ops.record() as rec:
        got = fn(*dev)
        got.backward(torch.ones_like(got))
        got_cpu = got.cpu()
        grads = [dev[i].grad.cpu() for i in grad_of]
    assert got_cpu.dtype == dtype and torch.equal(got_cpu, want)
    for i, g in zip(grad_of, grads, strict=True):
        assert torch.equal(g, cpu[i].grad), f"gradient of input {i}"
    return rec


def _no_decomposition(rec, *names):
    for n in names:
        assert rec.path_of(n) == "native", (n, rec.ops.get(n))
    assert not any(s.paths.get("decomposed") for s in rec.ops.values()), \
        {n: s.paths for n, s in rec.ops.items() if s.paths.get("decomposed")}


@pytest.mark.parametrize("dtype", FLOATS)
def test_silu_mish_backward(dtype):
    x = torch.randn(37, 19, dtype=dtype) * 4
    rec = _grad_parity(F.silu, dtype, x)
    _no_decomposition(rec, "silu", "silu_backward")
    rec = _grad_parity(F.mish, dtype, x)
    _no_decomposition(rec, "mish", "mish_backward")


@pytest.mark.parametrize("fn", [F.silu, F.mish, F.logsigmoid])
def test_double_backward(fn):
    """The device's kernel for a derivative op keeps that op's own derivative."""
    x = torch.randn(33, dtype=torch.float64) * 3
    got = []
    for t in (x.clone(), x.to("sim")):
        t.requires_grad_()
        (g,) = torch.autograd.grad(fn(t).sum(), t, create_graph=True)
        (gg,) = torch.autograd.grad((g * g).sum(), t)
        got.append((g.detach().cpu(), gg.cpu()))
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])


@pytest.mark.parametrize("dtype", FLOATS)
def test_silu_mish_backward_ops(dtype):
    g, x = torch.randn(5, 33, dtype=dtype), torch.randn(5, 33, dtype=dtype) * 4
    for op in (A.silu_backward.default, A.mish_backward.default):
        assert torch.equal(op(g.to("sim"), x.to("sim")).cpu(), op(g, x))
    out = torch.empty(5, 33, dtype=dtype, device="sim")
    A.silu_backward.grad_input(g.to("sim"), x.to("sim"), grad_input=out)
    assert torch.equal(out.cpu(), A.silu_backward.default(g, x))


@pytest.mark.parametrize("dtype", FLOATS)
def test_logsigmoid(dtype):
    x = torch.randn(41, 23, dtype=dtype) * 6
    rec = _grad_parity(F.logsigmoid, dtype, x)
    _no_decomposition(rec, "log_sigmoid_forward", "log_sigmoid_backward")
    out, buf = A.log_sigmoid_forward.default(x.to("sim"))
    want, _ = A.log_sigmoid_forward.default(x)
    assert torch.equal(out.cpu(), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("p,margin,weighted,reduction",
                         [(1, 1.0, False, "mean"), (2, 0.7, True, "sum"),
                          (1, 1.3, True, "none")])
def test_multi_margin_loss(dtype, p, margin, weighted, reduction):
    x = torch.randn(29, 11, dtype=dtype)
    t = torch.randint(0, 11, (29,))
    w = torch.rand(11, dtype=dtype) if weighted else None

    def fn(a, target):
        return F.multi_margin_loss(a, target, p=p, margin=margin, weight=None if w is None
                                   else w.to(a.device), reduction=reduction)
    rec = _grad_parity(fn, dtype, x, t)
    _no_decomposition(rec, "multi_margin_loss", "multi_margin_loss_backward")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_multilabel_margin_loss(dtype, reduction):
    x = torch.randn(17, 9, dtype=dtype)
    t = torch.randint(-1, 9, (17, 9))
    rec = _grad_parity(lambda a, target: F.multilabel_margin_loss(a, target,
                                                                  reduction=reduction),
                       dtype, x, t)
    _no_decomposition(rec, "multilabel_margin_loss_forward",
                      "multilabel_margin_loss_backward")


def test_margin_losses_raise_where_the_cpu_has_no_kernel():
    # the decomposition computed bfloat16, which the CPU kernels refuse
    x, t = torch.randn(4, 5).bfloat16(), torch.randint(0, 5, (4,))
    for fn in (lambda a, b: F.multi_margin_loss(a, b),
               lambda a, b: F.multilabel_margin_loss(a, b.unsqueeze(1).expand(4, 5))):
        with pytest.raises(RuntimeError) as cpu:
            fn(x, t)
        with pytest.raises(RuntimeError) as dev:
            fn(x.to("sim"), t.to("sim"))
        assert str(dev.value) == str(cpu.value)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("dim", [0, 2, 1, None])
def test_weight_norm_op(dtype, dim):
    v = torch.randn(6, 5, 4, dtype=dtype)
    g_shape = [1, 1, 1]
    if dim is not None:
        g_shape[dim] = v.shape[dim]
    g = torch.rand(*g_shape, dtype=dtype) + 0.5
    d = -1 if dim is None else dim
    rec = _grad_parity(lambda a, b: torch._weight_norm(a, b, d), dtype, v, g, grad_of=(0, 1))
    if dim in (0, 2):  # PyTorch's fused branch, on the CPU and the device alike
        _no_decomposition(rec, "_weight_norm_interface", "_weight_norm_interface_backward")


def _module_parity(make, wrap, dtype):
    torch.manual_seed(1)
    cpu = wrap(make().to(dtype))
    dev = wrap(make().to(dtype))
    dev.load_state_dict(cpu.state_dict())
    dev.to("sim")
    x = torch.randn(7, 6, 10, dtype=dtype)
    cpu(x).square().sum().backward()
    dev(x.to("sim")).square().sum().backward()
    for (n, a), (_, b) in zip(cpu.named_parameters(), dev.named_parameters(), strict=True):
        assert torch.equal(a.grad, b.grad.cpu()), n


@pytest.mark.parametrize("dtype", FLOATS)
def test_weight_norm_modules(dtype):
    conv = lambda: nn.Conv1d(6, 8, 3)  # noqa: E731
    _module_parity(conv, nn.utils.weight_norm, dtype)
    _module_parity(conv, lambda m: nn.utils.weight_norm(m, dim=1), dtype)
    _module_parity(conv, nn.utils.parametrizations.weight_norm, dtype)
    _module_parity(conv, lambda m: nn.utils.parametrizations.weight_norm(m, dim=None), dtype)


@pytest.mark.parametrize("dtype", FLOATS)
def test_other_sweep_findings(dtype):
    x = torch.randn(12, 7, dtype=dtype) * 3
    cases = [
        lambda t: torch.renorm(t, 2, 0, 1.5),
        lambda t: t.clone().renorm_(1, 1, 2.0),
        lambda t: torch.trace(t),
        lambda t: torch.special.entr(t.abs()),
        lambda t: torch.special.i0e(t),
        lambda t: torch.xlogy(t, t.abs()),
        lambda t: t.abs().xlogy_(t.abs() + 1),
        lambda t: torch.special.xlog1py(t, t.abs()),
        lambda t: torch.sinc(t),
        lambda t: torch.linspace(-2.5, 3.5, 1001, dtype=t.dtype, device=t.device),
        lambda t: A._addmm_activation(t[:, 0], t, t.t(), use_gelu=True),
        lambda t: A._addmm_activation(t[:, 0], t, t.t()),
    ]
    if dtype != torch.bfloat16:  # no bfloat16 CPU kernel
        cases.append(lambda t: torch.special.log_ndtr(t))
    for i, f in enumerate(cases):
        with ops.record() as rec:
            got = f(x.to("sim")).cpu()
        assert torch.equal(got, f(x)), i
        _no_decomposition(rec)
