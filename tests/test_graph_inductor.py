"""``torch.compile`` (inductor, the default backend) on the sim: compiled sim against
compiled CPU, bit for bit where the generated code is the same (it is: the sim compiles
the CPU's C++), and against eager sim; in all three memory modes.

Compiling costs seconds per graph, so the default-mode run of this module happens in the
tools stage of ``make test`` (marker ``graph``), beside the default suite."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import torchport.sim  # noqa: F401
from torchport.graph import cpu_checks, inductor

pytestmark = [pytest.mark.modes, pytest.mark.graph]

# What inductor generates (its lowering choices, layouts, dynamic shapes) is the same in every
# memory mode: only the launch differs. Those checks run in default memory (make test's tools
# stage, make test-graph); the strict and async stages run the ones that launch kernels.
default_memory_only = pytest.mark.skipif(
    any(os.environ.get(v, "") not in ("", "0") for v in ("TORCHPORT_SIM_STRICT", "TORCHPORT_SIM_ASYNC")),
    reason="the generated code does not depend on the memory mode: checked in default memory")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _same(dev: torch.Tensor, cpu: torch.Tensor) -> None:
    assert dev.device.type == "sim"
    assert dev.dtype == cpu.dtype and dev.shape == cpu.shape and dev.stride() == cpu.stride()
    torch.testing.assert_close(dev.cpu(), cpu, rtol=0, atol=0, equal_nan=True)


def _both(fn, *args: torch.Tensor, device: str = "sim"):
    """``fn`` compiled twice (separate caches of dynamo's frames), run on CPU and device."""
    out_cpu = torch.compile(fn)(*args)
    torch._dynamo.reset()
    out_dev = torch.compile(fn)(*[a.to(device) for a in args])
    return out_dev, out_cpu


@default_memory_only
def test_pointwise_reductions_and_the_cpu_only_choices_match_compiled_cpu() -> None:
    # argmax of a transposed input (logical indices), division by a constant (true division
    # on the CPU, multiplication by the reciprocal elsewhere), two-pass vs Welford variance,
    # float16 computed as the CPU's C++ does
    def fn(a: torch.Tensor):
        return (a.t().argmax(1), a.t().argmin(0), a.sum(1) / 3.0, a.var(0), torch.var_mean(a, 1),
                (a.half() * 1.5).exp().sum(0), torch.where(a > 0, a, a * 0.1).cumsum(0))

    a = torch.randn(7, 5)
    outs_dev, outs_cpu = _both(fn, a)
    for d, c in zip(torch.utils._pytree.tree_leaves(outs_dev),
                    torch.utils._pytree.tree_leaves(outs_cpu), strict=True):
        _same(d, c)


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.GELU(),
                               torch.nn.Dropout(0.0), torch.nn.Linear(16, 4))


def _train(model: torch.nn.Module, device: str, steps: int = 3, compiled: bool = True):
    model = model.to(device)
    # foreach on both devices: PyTorch picks the for-loop AdamW on the CPU and the foreach
    # one on accelerators, which round differently; the same algorithm compares bit for bit
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    run = torch.compile(step) if compiled else step
    losses = [run(x.to(device), y.to(device)).detach() for _ in range(steps)]
    return losses, [p.detach() for p in model.parameters()]


def test_a_compiled_training_step_matches_compiled_cpu_bit_for_bit() -> None:
    torch.manual_seed(0)
    model = _mlp()
    losses_cpu, params_cpu = _train(copy.deepcopy(model), "cpu")
    torch._dynamo.reset()
    losses_dev, params_dev = _train(copy.deepcopy(model), "sim")
    for d, c in zip(losses_dev + params_dev, losses_cpu + params_cpu, strict=True):
        _same(d, c)
    # and eager sim, within float rounding (inductor fuses, eager does not)
    torch._dynamo.reset()
    losses_eager, _ = _train(copy.deepcopy(model), "sim", compiled=False)
    torch.testing.assert_close(torch.stack(losses_dev).cpu(), torch.stack(losses_eager).cpu())


def test_a_compiled_program_calls_no_python_of_torchport_per_step() -> None:
    """Its buffers come from a C function and its kernels are called as on the CPU (where
    the runtime is synchronous with host addresses; else the launcher's launch); the
    C++ library serving."""
    from torchport.core import native

    if native.loaded() is None:
        pytest.skip("the C++ library is not built here")
    import cProfile
    import pstats

    torch.manual_seed(0)
    model = _mlp().to("sim")
    step = torch.compile(lambda x: model(x).square().sum())
    x = torch.randn(8, model[0].in_features, device="sim")
    for _ in range(3):
        step(x).backward()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(5):
        loss = step(x)
        loss.backward()
    profile.disable()
    called = {f"{path}:{fn}" for path, _, fn in pstats.Stats(profile).stats  # type: ignore[attr-defined]
              if os.sep + "torchport" + os.sep in path}
    from torchport.ops import native_factories

    if inductor.launcher("sim").direct:
        assert called == set()
    elif native_factories.SERVING[0].native:  # (not where the allocator is Python's)
        # the kernels go through the launcher (views, the stream's queue); buffers do not
        assert not [c for c in called if c.endswith("inductor.py:empty_strided")], called
    torch.testing.assert_close(loss.cpu(), model.cpu()(x.cpu()).square().sum())


def test_a_cnn_forward_and_backward_match_compiled_cpu() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1),
                                torch.nn.BatchNorm2d(8),
                                torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Flatten(),
                                torch.nn.Linear(8 * 4 * 4, 10))
    x = torch.randn(4, 3, 8, 8)

    def run(m: torch.nn.Module, x: torch.Tensor):
        loss = torch.nn.functional.cross_entropy(m(x), torch.arange(4, device=x.device))
        loss.backward()
        return loss.detach(), [p.grad for p in m.parameters()], m[1].running_var

    m_cpu, m_dev = copy.deepcopy(model), copy.deepcopy(model).to("sim")
    out_cpu = torch.compile(run)(m_cpu, x)
    torch._dynamo.reset()
    out_dev = torch.compile(run)(m_dev, x.to("sim"))
    # bit for bit: both lay the convolutions out channels-last for oneDNN (cpu_checks)
    for d, c in zip(torch.utils._pytree.tree_leaves(out_dev),
                    torch.utils._pytree.tree_leaves(out_cpu), strict=True):
        _same(d, c)


@default_memory_only
def test_convolutions_are_laid_out_for_onednn_as_on_the_cpu() -> None:
    from torch._inductor.graph import GraphLowering
    from torch.fx.experimental.proxy_tensor import make_fx

    torch.compile(lambda t: t + 1)(torch.ones(1, device="sim"))  # inductor set up for the sim

    def conv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.conv2d(x, w, b, padding=1).relu()

    decided = {}
    for dev in ("cpu", "sim", "meta"):  # (meta: a device inductor gives cuDNN's heuristics)
        args = [torch.randn(s, device=dev) for s in ((4, 3, 32, 32), (16, 3, 3, 3), (16,))]
        gm = make_fx(conv, tracing_mode="fake")(*args)
        decided[dev] = GraphLowering.decide_layout_opt(gm, is_inference=False)
        if dev != "sim":
            original = GraphLowering.decide_layout_opt.__torchport_extends__
            assert decided[dev] == original(gm, is_inference=False)
    assert decided == {"cpu": True, "sim": True, "meta": False}


@default_memory_only
def test_inductor_sizes_a_strided_reduction_from_the_device_properties() -> None:
    # A vendor's own code generator takes inductor's GPU reduction heuristics, which size
    # a split from the properties torch.<device> reports; the defaults a runtime leaves
    # unset are the ones inductor assumes for a device that reports nothing.
    from torch._inductor.choices import InductorChoices

    props = torch.sim.get_device_properties(0)
    assert (props.warp_size, props.max_threads_per_block,
            props.max_threads_per_multi_processor) == (32, 1024, 2048)
    for numel, outputs in ((33, 17), (64, 8), (300, 40), (4096, 3)):
        for inner in (True, False):
            split = InductorChoices.reduction_split_factor(
                torch.device("sim", 0), numel, outputs, inner_reduction=inner)
            assert split >= 1, (numel, outputs, inner, split)


def test_a_graph_on_the_second_device_stays_there() -> None:
    a = torch.randn(64, 64, device="sim:1")
    f = torch.compile(lambda t: (t.relu() @ t).softmax(-1) + 1)
    f(a)  # compiled
    before = torch.sim.memory_allocated(0), torch.sim.memory_allocated(1)
    out = f(a)
    assert out.device == torch.device("sim", 1)
    # every buffer of the graph, and its result, on sim:1
    assert torch.sim.memory_allocated(0) == before[0]
    assert torch.sim.memory_allocated(1) == before[1] + out.untyped_storage().nbytes()
    torch.testing.assert_close(out.cpu(), (a.cpu().relu() @ a.cpu()).softmax(-1) + 1)


@default_memory_only
def test_dynamic_shapes_and_graph_breaks() -> None:
    def fn(a: torch.Tensor) -> torch.Tensor:
        b = a.sin() * 2
        if b.sum().item() > -1e9:  # .item(): a graph break
            b = b + a.cos()
        return b.mean(0)

    f = torch.compile(fn, dynamic=True)
    for n in (5, 9, 17):
        a = torch.randn(n, 3)
        _same(f(a.to("sim")), torch.compile(fn, dynamic=True)(a))


def test_fullgraph_on_a_model_whose_ops_all_have_kernels() -> None:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        out_cpu = torch.compile(copy.deepcopy(layer), fullgraph=True)(x)
        torch._dynamo.reset()
        out_dev = torch.compile(copy.deepcopy(layer).to("sim"), fullgraph=True)(x.to("sim"))
    _same(out_dev, out_cpu)


def test_kernels_run_after_the_work_queued_before_them() -> None:
    # on the asynchronous sim, a compiled kernel reading a matmul's result must wait for it
    a = torch.randn(256, 256, device="sim")
    f = torch.compile(lambda t: (t * 2 + 1).sum(1))
    outs = []
    for i in range(3):
        b = a @ a + i  # queued on the stream in async mode
        outs.append((f(b), b))
    torch._dynamo.reset()
    f_cpu = torch.compile(lambda t: (t * 2 + 1).sum(1))
    for out, b in outs:
        _same(out, f_cpu(b.cpu()))


@default_memory_only
def test_cpu_compiles_are_unchanged() -> None:
    from torch._inductor import utils

    torch.compile(lambda t: t * 3)(torch.ones(2, device="sim"))  # (cached or not)
    # the device's answers are the CPU's; every other device keeps its own
    assert utils.get_current_backend("sim") == utils.get_current_backend("cpu") == "cpp"
    assert utils.get_current_backend("cuda") == "triton"
    assert set(cpu_checks.extended()) >= {"ir.is_cpu", "lowering.div_prim"}
    a = torch.randn(6, 4)
    torch.testing.assert_close(torch.compile(lambda t: (t / 3.0).var(0))(a), (a / 3.0).var(0))


def test_the_cache_key_names_the_launch_mode() -> None:
    from torch._inductor.codegen import common

    key = inductor.cache_key("sim")
    assert key.mode == inductor.launcher("sim").mode
    # in the key inductor computes, also after inductor set its own backends up (which
    # registers a PrivateUse1 device's classes again, without its pass)
    common.init_backend_registration()
    assert common.custom_backend_passes["sim"] is key
    torch.compile(lambda t: t + 1)(torch.ones(2, device="sim"))
    assert common.custom_backend_passes["sim"] is key
    other = type(key)("sim", "views" if key.mode != "views" else "direct")
    assert key.uuid() != other.uuid()
    strict = os.environ.get("TORCHPORT_SIM_STRICT", "") not in ("", "0")
    asynchronous = os.environ.get("TORCHPORT_SIM_ASYNC", "") not in ("", "0")
    assert key.mode == ("queued" if asynchronous else "views" if strict else "direct")


def test_the_cache_key_covers_a_vendor_code_generator_split_over_modules(
        tmp_path, monkeypatch) -> None:
    # the scheduling's module, its kernel's and the kernel's op overrides' (with their bases
    # outside torch and the standard library): editing any of them is a new key
    modules = {"tp_vendor_scheduling": "from tp_vendor_kernel import Kernel\n\n\n"
                                       "class Scheduling:\n    kernel_type = Kernel\n",
               "tp_vendor_kernel": "from tp_vendor_ops import Ops\n\n\n"
                                   "class Kernel:\n    overrides = Ops\n",
               "tp_vendor_base": "class Base(dict):\n    pass\n",
               "tp_vendor_ops": "from tp_vendor_base import Base\n\n\nclass Ops(Base):\n    pass\n"}
    for name, text in modules.items():
        (tmp_path / f"{name}.py").write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in modules:
        monkeypatch.delitem(sys.modules, name, raising=False)
    from tp_vendor_scheduling import Scheduling

    assert inductor._codegen_sources(Scheduling) == [
        str(tmp_path / f"{m}.py") for m in ("tp_vendor_scheduling", "tp_vendor_kernel",
                                             "tp_vendor_ops", "tp_vendor_base")]
    monkeypatch.setitem(inductor._OWN, "nochip", "tp_vendor_scheduling:Scheduling")
    key = inductor._CacheKeyBase("nochip", "direct")
    before = key.uuid()
    with open(tmp_path / "tp_vendor_ops.py", "a") as f:
        f.write("# a change of the op overrides\n")
    assert key.uuid() != before


@pytest.mark.skipif(os.environ.get("TORCHPORT_SIM_STRICT", "") not in ("", "0")
                    or os.environ.get("TORCHPORT_SIM_ASYNC", "") not in ("", "0"),
                    reason="starts its own processes in both modes")
def test_a_graph_cached_in_one_memory_mode_is_not_reused_in_another(tmp_path) -> None:
    # device-only memory after host-addressable memory, one inductor cache: the cached
    # program calls kernels on raw device addresses and would crash on fake ones (the
    # memory mode is part of the cache key, which serves the other direction too)
    script = textwrap.dedent("""
        import torch, torchport.sim
        a = torch.arange(12.0, device="sim").reshape(3, 4)
        out = torch.compile(lambda t: (t * 2).sin().sum(0))(a)
        torch.testing.assert_close(out.cpu(), (a.cpu() * 2).sin().sum(0))
        print("ok")
    """)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path), OMP_NUM_THREADS="1")
    for strict in ("0", "1"):
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           env=dict(env, TORCHPORT_SIM_STRICT=strict), timeout=300)
        assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TORCHPORT_FULL_MODELS", "") in ("", "0"),
                    reason="minutes of compiling: make test-graph (TORCHPORT_FULL_MODELS=1)")
def test_a_hugging_face_model_trains_compiled_as_on_the_cpu() -> None:
    pytest.importorskip("transformers")
    from tests.hf_models import ARCHS, build

    arch = next(a for a in ARCHS if a.name == "llama")
    model = build(arch)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))

    def train(m: torch.nn.Module, device: str) -> tuple[list[torch.Tensor], torch.Tensor]:
        m = m.to(device)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True)

        def step(x: torch.Tensor) -> torch.Tensor:
            opt.zero_grad()
            loss = m(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            return loss.detach()

        run = torch.compile(step)
        return [run(ids.to(device)) for _ in range(2)], m.lm_head.weight.detach()

    losses_cpu, w_cpu = train(copy.deepcopy(model), "cpu")
    torch._dynamo.reset()
    losses_dev, w_dev = train(copy.deepcopy(model), "sim")
    assert w_dev.device.type == "sim"
    torch.testing.assert_close(torch.stack(losses_dev).cpu(), torch.stack(losses_cpu))
    torch.testing.assert_close(w_dev.cpu(), w_cpu)
