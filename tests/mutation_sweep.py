"""Ops that write their arguments, on a device, against the CPU: every argument after the
call, written or not, must hold the CPU's values. Run in a child interpreter on one
backend: ``python -m tests.mutation_sweep BACKEND [--op-db]``, where BACKEND is ``bare``
(the walkthrough with its four kernels forced to the CPU fallback: no kernel at all), ``walk`` (its four kernels: decompositions into them are taken), ``sim``
or a backend module. Prints ``MISMATCH name: ...`` per difference, then ``checked N``.

The named cases are the writes a schema hides or a path may lose: BatchNorm's running
statistics (``native_batch_norm`` marks none of its arguments written), the counters of
``_amp_update_scale_``, ``embedding_renorm_``, foreach in-place lists, the fused optimizer
steps and ``out=`` of ops PyTorch decomposes. ``--op-db`` adds the first sample of every
in-place variant and ``out=`` call of PyTorch's OpInfo database.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable

import torch

from tests.helpers import sweep

warnings.simplefilter("ignore")


def _register(backend: str) -> str:
    if backend == "sim":
        importlib.import_module("torchport.sim")
        return "sim"
    if backend == "bare":  # the walkthrough with its kernels declined: no kernel at all
        from torchport.ops import set_force_fallback
        importlib.import_module("examples.vendor_walkthrough.backend")
        set_force_fallback(["add.*", "mul.*", "mm.*", "sum.*"])
        return "walk"
    if backend == "walk":
        importlib.import_module("examples.vendor_walkthrough.backend")
        return "walk"
    importlib.import_module(backend)
    return torch._C._get_privateuse1_backend_name()


def _cases(g: torch.Generator) -> dict[str, Callable[[str], list]]:
    """name -> f(device) returning every tensor whose values must match the CPU's (``g``
    is seeded again before each call: both sides draw the same inputs)."""

    def r(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g, dtype=dtype)

    x4, w4, b4 = r(8, 4, 5, 5), r(4), r(4)
    x1 = r(16, 6)

    def batchnorm_module(d):
        bn = torch.nn.BatchNorm2d(4).to(d)
        y = bn(x4.to(d))
        bn(x4.to(d) * 2)
        return [y, bn.running_mean, bn.running_var, bn.num_batches_tracked]

    def batchnorm_functional(d):
        rm, rv = torch.zeros(4, device=d), torch.ones(4, device=d)
        y = torch.nn.functional.batch_norm(x4.to(d), rm, rv, w4.to(d), b4.to(d), True, 0.3)
        return [y, rm, rv]

    def native_batch_norm(d):
        rm, rv = torch.zeros(6, device=d), torch.ones(6, device=d)
        outs = torch.ops.aten.native_batch_norm(x1.to(d), None, None, rm, rv, True, 0.1, 1e-5)
        return [*outs, rm, rv]

    def batchnorm1d_momentum_none(d):
        bn = torch.nn.BatchNorm1d(6, momentum=None).to(d)
        for k in range(3):
            bn(x1.to(d) + k)
        return [bn.running_mean, bn.running_var, bn.num_batches_tracked]

    def instance_norm_running(d):
        m = torch.nn.InstanceNorm2d(4, track_running_stats=True).to(d)
        y = m(x4.to(d))
        return [y, m.running_mean, m.running_var]

    def batchnorm_eval_after_train(d):
        bn = torch.nn.BatchNorm2d(4).to(d)
        bn(x4.to(d))
        bn.eval()
        return [bn(x4.to(d) + 1), bn.running_mean]

    def amp_update_scale(d):
        out = []
        for inf in (0.0, 1.0, 0.0, 0.0):
            scale, tracker = torch.full((1,), 4.0, device=d), torch.full((1,), 1, dtype=torch.int32, device=d)
            torch._amp_update_scale_(scale, tracker, torch.tensor([inf], device=d), 2.0, 0.5, 2)
            out += [scale, tracker]
        return out

    def grad_scaler_step(d):
        torch.manual_seed(0)
        m = torch.nn.Linear(4, 3).to(d)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler(d, init_scale=8.0, growth_interval=1)
        for k in range(3):
            loss = m(x1[:, :4].to(d) * (1e30 if k == 1 else 1)).sum()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        return [*m.parameters(), scaler._scale, scaler._growth_tracker]

    def embedding_renorm(d):
        w = r(10, 4) * 3
        wd = w.to(d)
        torch.embedding_renorm_(wd, torch.tensor([1, 3, 3, 7], device=d), 1.0, 2.0)
        return [wd]

    def embedding_max_norm(d):
        e = torch.nn.Embedding(10, 4, max_norm=1.0)
        with torch.no_grad():
            e.weight.copy_(r(10, 4) * 3)
        e = e.to(d)
        y = e(torch.tensor([[1, 2], [2, 9]], device=d))
        return [y, e.weight]

    def foreach_inplace(d):
        a = [r(3, 2).to(d) for _ in range(3)]
        b = [r(3, 2).to(d) for _ in range(3)]
        c = [r(3, 2).abs().add(1).to(d) for _ in range(3)]
        torch._foreach_add_(a, b, alpha=0.5)
        torch._foreach_mul_(b, 3.0)
        torch._foreach_lerp_(a, b, 0.25)
        torch._foreach_addcdiv_(a, b, c, torch.tensor([0.1, 0.2, 0.3]))
        torch._foreach_addcmul_(b, a, c, 0.5)
        torch._foreach_sqrt_(c)
        torch._foreach_maximum_(a, b)
        z = [t.clone() for t in c]
        torch._foreach_zero_(z)
        torch._foreach_copy_(z, b)
        return [*a, *b, *c, *z]

    def _optim_step(d, make):
        m = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
        torch.manual_seed(0)
        for p in m.parameters():
            torch.nn.init.normal_(p, generator=g)
        m = m.to(d)
        opt = make(m.parameters())
        for k in range(3):
            m(x1.to(d) + k).square().mean().backward()
            opt.step()
            opt.zero_grad()
        state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return [*m.parameters(), *state]

    def adam_foreach(d):
        return _optim_step(d, lambda p: torch.optim.Adam(p, lr=0.01, foreach=True))

    def adamw_fused(d):
        return _optim_step(d, lambda p: torch.optim.AdamW(p, lr=0.01, fused=True))

    def adam_fused_amsgrad(d):
        return _optim_step(d, lambda p: torch.optim.Adam(p, lr=0.01, fused=True, amsgrad=True))

    def sgd_fused_momentum(d):
        return _optim_step(d, lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, fused=True))

    def sgd_momentum(d):
        return _optim_step(d, lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, nesterov=True))

    def adagrad_foreach(d):
        return _optim_step(d, lambda p: torch.optim.Adagrad(p, lr=0.05, foreach=True))

    def decomposed_outs(d):
        a, b, c = r(4, 5).to(d), r(4, 5).to(d), r(4, 5).abs().to(d)
        outs = [torch.empty(4, 5, device=d) for _ in range(8)]
        torch.addcmul(a, b, c, value=0.5, out=outs[0])
        torch.lerp(a, b, 0.3, out=outs[1])
        torch.logit(c.sigmoid(), out=outs[2])
        torch.clamp(a, -0.5, 0.5, out=outs[3])
        torch.where(a > 0, a, b, out=outs[4])
        torch.hypot(a, b, out=outs[5])
        torch.xlogy(c, c, out=outs[6])
        torch.cumsum(a, 1, out=outs[7])
        wrong = torch.empty(0, device=d)
        torch.addcdiv(a, b, c, out=wrong)  # resized
        return [*outs, wrong]

    def inplace_decomposed(d):
        a, b = r(4, 5).to(d), r(4, 5).to(d)
        a.addcmul_(b, b, value=2)
        a.lerp_(b, 0.5)
        a.clamp_(-1, 1)
        torch.nn.functional.hardtanh_(b, -0.3, 0.3)
        a.pow_(3)
        b.pow_(2)
        c = a.clone().pow_(0.5)
        return [a, b, c]

    def pow_after_learning(d):
        x = r(6).abs().add(0.5).to(d)
        return [x.pow(2), x.pow(3), x.pow(-0.5), x.pow(1.5), x.rsqrt(),
                torch.linalg.vector_norm(x), torch.nn.functional.rms_norm(x, (6,))]

    def pow_backward(d):
        x = r(6).abs().add(0.5).to(d).requires_grad_()
        (x.pow(3).sum() + x.norm() + x.rsqrt().sum()).backward()
        return [x.grad]

    def index_ops_inplace(d):
        a = r(6, 3).to(d)
        a.index_add_(0, torch.tensor([0, 2, 2], device=d), r(3, 3).to(d))
        a.index_fill_(1, torch.tensor([1], device=d), -2.0)
        a.masked_fill_(a > 1, 0.0)
        a.scatter_add_(0, torch.tensor([[0, 1, 2]], device=d), r(1, 3).to(d))
        return [a]

    return {k: v for k, v in locals().items()
            if callable(v) and not k.startswith("_") and k not in ("r", "g")}


def _op_db_cases(dev: str) -> dict[str, Callable[[str], list]]:
    from torchport.tools.conformance.catalog import load_op_db
    out: dict[str, Callable[[str], list]] = {}
    for info in load_op_db():
        if torch.float32 not in info.supported_dtypes("cpu"):
            continue
        try:
            sample = next(iter(info.sample_inputs("cpu", torch.float32)))
        except Exception:  # noqa: BLE001
            continue
        inp = sample.input
        if not (isinstance(inp, torch.Tensor) or isinstance(inp, list | tuple) and inp
                and all(isinstance(t, torch.Tensor) for t in inp)):
            continue  # a factory: its out= names the device, the CPU call does not
        if "device" in sample.kwargs:
            continue  # the sample names the CPU: an out= on the device is an error there
        ivar = info.inplace_variant
        if ivar is not None:
            out[f"op_db {info.name}{('.' + info.variant_test_name) if info.variant_test_name else ''} (in place)"] = \
                _call(ivar, sample, inplace=True)
        if info.supports_out:
            out[f"op_db {info.name}{('.' + info.variant_test_name) if info.variant_test_name else ''} (out=)"] = \
                _call(info.op, sample, inplace=False)
    return out


def _call(fn: Callable, sample, inplace: bool) -> Callable[[str], list]:  # noqa: ANN001
    from torch.utils._pytree import tree_map

    def run(d: str) -> list:
        def to(v):
            return v.detach().clone().to(d) if isinstance(v, torch.Tensor) else v
        inp, args, kw = tree_map(to, sample.input), tree_map(to, list(sample.args)), \
            tree_map(to, sample.kwargs)
        if inplace:
            fn(inp, *args, **kw)
            return [inp, *[a for a in args if isinstance(a, torch.Tensor)]]
        ref = fn(sample.input, *sample.args, **sample.kwargs)  # the CPU's shape for out=
        if isinstance(ref, torch.Tensor):
            o = torch.empty_like(ref, device=d)
            fn(inp, *args, **kw, out=o)
            return [*(inp if isinstance(inp, list | tuple) else [inp]), o]
        return []
    return run


def _compare(got: list, want: list) -> str | None:
    if len(got) != len(want):
        return f"{len(got)} tensors vs {len(want)}"
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if not isinstance(b, torch.Tensor):
            continue
        a = a.detach().cpu()
        b = b.detach()
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"tensor {i}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
        try:
            torch.testing.assert_close(a, b, equal_nan=True, rtol=1e-4, atol=1e-5)
        except AssertionError as e:
            return f"tensor {i}: {str(e).splitlines()[0]} {a.flatten()[:3].tolist()} vs {b.flatten()[:3].tolist()}"
    return None


def main(argv: list[str]) -> int:
    dev = _register(argv[0])
    g = torch.Generator()
    cases = _cases(g)
    if "--op-db" in argv:
        cases.update(_op_db_cases(dev))
    # two rounds: the second runs the paths the first learnt (C++'s fallback serves them)
    sweep(cases, dev, _compare, rounds=2, before=lambda: g.manual_seed(0), cpu_may_refuse=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
