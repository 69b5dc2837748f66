"""``torch.compile`` (inductor) on ``ocl`` with the OpenCL backend's own code generator
(``torchport.backends.opencl.inductor.OpenCLScheduling``): fused OpenCL C kernels against
eager CPU and compiled CPU, bit for bit where the math is the same (loads, stores, +, *,
comparisons, max/min/argmax), within float rounding where OpenCL's library functions or a
sum's order differ; kernels launched fewer than eager ops; a clear compile-time error for
what the generator does not write; CPU and sim compiles unchanged. The ocl code runs in a
worker process (tests/opencl_worker.py): the sim owns this one."""

from __future__ import annotations

import types

import pytest
import torch

from tests.opencl_support import ocl, ocl2  # noqa: F401  (the worker fixtures)

# the first test is in `make test`'s OpenCL subset; the rest in make test-opencl / test-graph
pytestmark = [pytest.mark.opencl, pytest.mark.graph]

# Runs in the worker before the tests.
HELPERS = """
import torch, pyopencl as cl

def same(dev, cpu):
    got = dev.cpu()
    assert dev.device.type == "ocl", dev.device
    assert got.dtype == cpu.dtype and got.shape == cpu.shape, (got.dtype, cpu.dtype, got.shape, cpu.shape)
    torch.testing.assert_close(got, cpu, rtol=0, atol=0, equal_nan=True)

def close(dev, cpu, rtol=1.3e-6, atol=1e-5):
    got = dev.cpu()
    assert dev.device.type == "ocl" and got.dtype == cpu.dtype and got.shape == cpu.shape
    torch.testing.assert_close(got, cpu, rtol=rtol, atol=atol, equal_nan=True)

def compiled(fn, *args):
    '''fn compiled and run on ocl, and eagerly on the CPU.'''
    torch._dynamo.reset()
    out = torch.compile(fn)(*[a.to("ocl") for a in args])
    return out, fn(*args)

class Launches:
    '''Counts the OpenCL kernels enqueued in the with block (eager and compiled alike).'''
    def __enter__(self):
        self.count, self.saved = 0, cl.Kernel.__call__
        @torch._dynamo.disable
        def counted(kernel, *a, **k):
            self.count += 1
            return self.saved(kernel, *a, **k)
        cl.Kernel.__call__ = counted
        return self
    def __exit__(self, *exc):
        cl.Kernel.__call__ = self.saved
"""


@pytest.fixture(scope="module", autouse=True)
def _helpers(ocl):  # noqa: F811
    ocl.run(HELPERS)


def test_a_fused_pointwise_chain_with_broadcasting_is_one_kernel(ocl):  # noqa: F811
    # in the `make test` subset: one small graph, bit for bit (+, *, max, where)
    ocl.run("""
    from torchport.backends.opencl.inductor import OpenCLScheduling
    from torch._inductor.codegen import common
    a, b = torch.randn(33, 17), torch.randn(17)
    f = lambda x, y: torch.where(x > 0, x * y + 1.5, torch.maximum(x, y * 0.5))
    out, ref = compiled(f, a, b)
    same(out, ref)
    assert isinstance(common.get_scheduling_for_device("ocl")(None), OpenCLScheduling)
    x, y = a.to("ocl"), b.to("ocl")
    with Launches() as eager:
        f(x, y)
    g = torch.compile(f)
    g(x, y)
    with Launches() as fused:
        g(x, y)
    assert fused.count == 1 < eager.count, (fused.count, eager.count)
    """)


@pytest.mark.opencl_full
def test_strided_inputs_float16_integers_and_bools(ocl):  # noqa: F811
    ocl.run("""
    a, b = torch.randn(6, 9), torch.randn(9, 6)
    # transposed, sliced and broadcast reads; a column of a contiguous tensor
    f = lambda x, y: (x + y.t()) * x[:, :1] - y.t()[::1, 2:3].abs()
    out, ref = compiled(f, a, b)
    same(out, ref)
    # float16 computed in float and rounded once, as PyTorch's opmath
    h = (torch.randn(5, 7) * 4).half()
    out, ref = compiled(lambda x: (x * 1.5 + 0.25).relu(), h)
    same(out, ref)
    # int64 and bool
    i = torch.randint(-50, 50, (4, 8))
    out, ref = compiled(lambda x: (x * 3 - 7, x > 2, (x % 5), x // 3, (x > 0) & (x < 20)), i)
    for o, r in zip(out, ref):
        same(o, r)
    # library functions: OpenCL's own, within rounding
    out, ref = compiled(lambda x: (x.exp() + x.sin() * x.tanh()).sigmoid(), a)
    close(out, ref)
    # a concatenation and a padding: masked loads
    out, ref = compiled(lambda x, y: torch.cat([x, y.t()], 1).sum(0), a, b)
    close(out, ref)
    out, ref = compiled(lambda x: torch.nn.functional.pad(x, (1, 2, 0, 1), value=-1.0), a)
    same(out, ref)
    # an empty input beside a full one (it has no memory to locate)
    e = torch.randn(0, 6)
    out, ref = compiled(lambda x, y: (torch.cat([x, y]) * 2, y.sum(0) + x.sum(0)), e, a.t())
    same(out[0], ref[0])
    close(out[1], ref[1])  # a sum: in index order, the CPU's vectorised
    """)


@pytest.mark.opencl_full
def test_reductions_over_every_dim_transposed_inputs_variance_and_layer_norm(ocl):  # noqa: F811
    ocl.run("""
    t3 = torch.randn(4, 5, 6)
    t3[1, 2, 3] = float("nan")
    for dim in range(3):
        for x in (t3, t3.transpose(0, 2)):
            out, ref = compiled(lambda v: (v.amax(dim), v.amin(dim), v.argmax(dim), v.argmin(dim)), x)
            for o, r in zip(out, ref):
                same(o, r)
            out, ref = compiled(lambda v: (v.sum(dim), v.mean(dim), v.prod(dim), v.var(dim)), x)
            for o, r in zip(out, ref):
                close(o, r)
    a = torch.randn(7, 5)
    a[2, 1] = a[4, 1] = 9.0  # ties: the first index, as the CPU
    # argmax of a transposed input: indices along the logical dimension
    out, ref = compiled(lambda v: (v.t().argmax(1), v.t().argmin(0), v.argmax(), (v > 1).any(1)), a)
    for o, r in zip(out, ref):
        same(o, r)
    # a reduction feeding pointwise code feeding a reduction (softmax, log-softmax)
    out, ref = compiled(lambda v: (v.softmax(1), v.t().log_softmax(1)), a)
    for o, r in zip(out, ref):
        close(o, r)
    # long reductions: Welford's variance, one work-item summing in index order
    w = torch.randn(4, 5000)
    out, ref = compiled(lambda v: (v.var(1), torch.var_mean(v.t(), 0)), w)
    for o, r in zip(torch.utils._pytree.tree_leaves(out), torch.utils._pytree.tree_leaves(ref)):
        close(o, r, rtol=1e-5)
    # layer norm, forward and backward
    torch._dynamo.reset()
    norm = torch.nn.LayerNorm(300)
    on_ocl = torch.nn.LayerNorm(300).to("ocl")
    on_ocl.load_state_dict(norm.state_dict())
    x = torch.randn(6, 300, requires_grad=True)
    xo = x.detach().to("ocl").requires_grad_()
    loss = torch.compile(lambda m, t: (m(t) * t).sum())
    loss(on_ocl, xo).backward()
    (norm(x) * x).sum().backward()
    close(xo.grad, x.grad, rtol=1e-4, atol=1e-4)
    close(on_ocl.weight.grad, norm.weight.grad, rtol=1e-4, atol=1e-4)
    close(on_ocl.bias.grad, norm.bias.grad, rtol=1e-4, atol=1e-4)
    """)


@pytest.mark.opencl_full
def test_a_compiled_mlp_training_step_matches_the_cpu_with_fewer_launches(ocl):  # noqa: F811
    result = ocl.run("""
    import copy, json
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))

    def train(dev, compile_it, opt_cls, steps=3):
        m = copy.deepcopy(model).to(dev)
        opt = opt_cls(m.parameters(), lr=0.01, foreach=True)
        def step(x, y):
            loss = torch.nn.functional.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        f = torch.compile(step) if compile_it else step
        xs, ys = x.to(dev), y.to(dev)
        losses = []
        for _ in range(steps):  # nothing patched: eager kernels run inside compiled frames
            losses.append(f(xs, ys).detach())
        with Launches() as launches, torchport.ops.record() as rec:  # one more, counted
            losses.append(f(xs, ys).detach())
        return ([l.cpu() for l in losses], [p.detach().cpu() for p in m.parameters()],
                (launches.count, computing_ops(rec)))

    def computing_ops(rec):
        # device ops of a step that compute (no views, no allocations), whichever path
        ops = json.loads(rec.to_json())["ops"]
        return sum(r["calls"] for r in ops.values()
                   if r["dtypes"] and not any("view" in k for k in [*r["paths"], *r["subpaths"]]))

    counts = {}
    for opt_cls in (torch.optim.SGD, torch.optim.AdamW):
        torch._dynamo.reset()
        losses_cpu, params_cpu, _ = train("cpu", False, opt_cls)
        torch._dynamo.reset()
        losses_ccpu, params_ccpu, _ = train("cpu", True, opt_cls)
        torch._dynamo.reset()
        _, _, eager = train("ocl", False, opt_cls)
        torch._dynamo.reset()
        losses, params, launched = train("ocl", True, opt_cls)
        for got, want, want_c in zip(losses + params, losses_cpu + params_cpu, losses_ccpu + params_ccpu):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got, want_c, rtol=1e-5, atol=1e-6)
        # fused: fewer launches than the eager step's ops (some of which, nll_loss, take
        # the CPU fallback there: the compiled step runs all of it on the device)
        assert launched[0] < eager[1], (opt_cls, launched, eager)
        counts[opt_cls.__name__] = {"eager launches": eager[0], "eager ops": eager[1],
                                    "compiled launches": launched[0]}
    result = counts
    """)
    # AdamW's foreach ops are many small kernels eagerly, a few fused ones compiled
    assert result["AdamW"]["compiled launches"] < result["AdamW"]["eager launches"], result
    print(result)


@pytest.mark.opencl_full
def test_compiled_kernels_keep_stream_order_and_check_indices(ocl):  # noqa: F811
    ocl.run("""
    a = torch.randn(128, 128)
    f = torch.compile(lambda t: (t * 2 + 1).amax(1))
    d = a.to("ocl")
    outs = []
    for i in range(3):
        b = d @ d + i  # queued before the compiled kernel that reads it
        outs.append((f(b), b))
    for out, b in outs:
        same(out, (b.cpu() * 2 + 1).amax(1))
    # on a stream of its own: the kernel goes to that stream's queue
    s = torch.ocl.Stream()
    with torch.ocl.stream(s):
        out = f(d + 1)
    s.synchronize()
    same(out, (a + 1).mul(2).add(1).amax(1))
    # an index read from a tensor is checked on the device, as the eager gather
    torch._dynamo.reset()
    g = torch.compile(lambda w, i: w[i] * 2)
    w, idx = torch.randn(5, 3), torch.tensor([4, 0, 2])
    same(g(w.to("ocl"), idx.to("ocl")), w[idx] * 2)
    bad = g(w.to("ocl"), torch.tensor([1, 7]).to("ocl"))
    try:
        torch.ocl.synchronize()
    except IndexError as e:
        assert "out of bounds" in str(e) and "7" in str(e), e
    else:
        raise AssertionError("an out-of-range index went unreported")
    same(g(w.to("ocl"), idx.to("ocl")), w[idx] * 2)  # the device stays usable
    """)


@pytest.mark.opencl_full
def test_what_the_generator_does_not_write_fails_at_compile_time_clearly(ocl):  # noqa: F811
    ocl.run("""
    import re
    cases = [(lambda v: v * 2, torch.randn(3, dtype=torch.float64), "torch.float64"),
             (lambda v: torch.nn.functional.dropout(v, 0.5), torch.randn(8), "the op '")]
    for fn, arg, what in cases:
        torch._dynamo.reset()
        try:
            torch.compile(fn)(arg.to("ocl"))
        except Exception as e:
            msg = str(e)
            assert "OpenCL code generator does not support" in msg and what in msg, msg
            assert "backend='aot_eager'" in msg and "register_graph_compiler" in msg, msg
        else:
            raise AssertionError(f"compiled {what} without an error")
        torch._dynamo.reset()  # the way out named in the message works
        out = torch.compile(fn, backend="aot_eager")(arg.to("ocl"))
        assert out.device.type == "ocl"
    """)


@pytest.mark.opencl_full
def test_compiling_on_the_cpu_is_unchanged_in_the_ocl_process(ocl):  # noqa: F811
    ocl.run("""
    from torch._inductor import utils
    from torch._inductor.codegen import common
    from torch._inductor.codegen.cpp import CppScheduling
    torch.compile(lambda t: t * 3)(torch.ones(2, device="ocl"))
    assert isinstance(common.get_scheduling_for_device("cpu")(None), CppScheduling)
    assert utils.get_current_backend("cpu") == "cpp"
    from torchport.graph import inductor
    assert inductor.launcher("ocl").mode == "own:torchport.backends.opencl.inductor:OpenCLScheduling"
    a = torch.randn(6, 4)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(lambda t: (t / 3.0).var(0))(a), (a / 3.0).var(0))
    """)


@pytest.mark.opencl_full
def test_the_sim_keeps_the_host_codegen() -> None:
    # this process: the sim compiles with inductor's C++ codegen, as before
    import torchport.sim  # noqa: F401
    from torchport.graph import inductor

    assert "sim" not in inductor._OWN
    assert inductor.launcher("sim").mode in ("direct", "views", "queued")
    fake = types.SimpleNamespace(name="nochip")
    with pytest.raises(ValueError, match="views= is for codegen='host'"):
        inductor.enable_inductor(fake, codegen="m:Scheduling", views=lambda t: t)
    with pytest.raises(ValueError, match="unknown codegen"):
        inductor.enable_inductor(fake, codegen="cuda")
    assert "nochip" not in inductor._OWN
    assert torch.compile(lambda t: t * 2)(torch.ones(3, device="sim")).cpu().tolist() == [2.0] * 3


@pytest.mark.opencl_full
def test_strided_reductions_of_every_length_compile_as_on_the_cpu(ocl):  # noqa: F811
    # Inductor sizes a strided reduction's split from the device's properties (compute
    # units, threads per unit, warp size); they are the OpenCL device's own, and with any of
    # them no reduction fails to lower.
    ocl.run("""
    import torch.nn.functional as F
    props = torch.ocl.get_device_properties(0)
    d = cl.get_platforms()[0].get_devices()[0]
    assert props.max_threads_per_block == d.max_work_group_size, props.max_threads_per_block
    assert props.multi_processor_count == d.max_compute_units
    for shape in ((33, 17), (64, 8), (100, 5), (300, 40), (4096, 3)):
        x = torch.randn(*shape)
        out, ref = compiled(lambda v: (v.sum(0), v.amax(0), v.var(0)), x)
        for o, r in zip(out, ref):
            close(o, r, rtol=1e-5)
    x = torch.randn(33, 17)
    out, ref = compiled(lambda v: F.layer_norm(v.t().contiguous(), (33,)), x)
    close(out, ref, rtol=1e-5)
    """)


def test_dynamic_shapes_and_the_second_device(ocl, ocl2):  # noqa: F811
    ocl.run("""
    torch._dynamo.reset()
    f = torch.compile(lambda x, y: ((x * y.t()).relu() + 1).amax(1), dynamic=True)
    for n in (5, 9, 13):  # one graph, sizes as kernel arguments
        x, y = torch.randn(n, 7), torch.randn(7, n)
        same(f(x.to("ocl"), y.to("ocl")), ((x * y.t()).relu() + 1).amax(1))
    """)
    # ocl:1 is the runtime's device 0 there: buffers and kernels on the device of the graph
    ocl2.run("""
    import torch
    x = torch.randn(4, 6)
    out = torch.compile(lambda t: (t * 2 - 1).amax(0))(x.to("ocl:1"))
    assert out.device == torch.device("ocl:1"), out.device
    torch.testing.assert_close(out.cpu(), (x * 2 - 1).amax(0), rtol=0, atol=0)
    """)

