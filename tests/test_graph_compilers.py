"""A vendor's graph compiler behind ``torch.compile(model, backend="<name>")``
(``torchport.graph.register_graph_compiler``): the forward and backward ATen graphs reach
it, whole or in regions of the ops it supports (the rest runs eagerly on the device), and
the compiled model equals eager on the device and the CPU bit for bit.

``FusingCompiler`` is the example vendor compiler: each region of pointwise ops becomes
one kernel computing the whole chain on the chip's view of its memory.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn
from torch._dynamo.exc import BackendCompilerFailed
from torch._subclasses.fake_tensor import FakeTensor

import torchport
from tests.conftest import chip_view
from tests.helpers import check_python, mode_independent
from torchport import ops
from torchport.graph import GraphInfo, graph_info, register_graph_compiler

pytestmark = pytest.mark.modes

A = torch.ops.aten


@dataclass
class Received:
    info: GraphInfo
    ops: list[Any]  # the call_function targets, in order
    inputs: list[Any]  # example inputs: fake tensors, SymInts


class Recorder:
    """A whole-graph compiler that runs the graph as it is, recording what it received."""

    def __init__(self) -> None:
        self.graphs: list[Received] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
        self.graphs.append(Received(graph_info(gm), _targets(gm), list(example_inputs)))
        return gm.forward

    def ops(self, kind: str) -> set[Any]:
        return {op for g in self.graphs if g.info.kind == kind for op in g.ops}


class FusingCompiler(Recorder):
    """Each region of pointwise ops on the device becomes one kernel: the outputs are
    allocated on the device (their shapes from the graph run on meta tensors), and one
    launch on the stream computes the whole chain on the chip's view of its memory."""

    def __init__(self) -> None:
        super().__init__()
        self.launches = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
        super().__call__(gm, example_inputs)

        def fused(*args: Any) -> Any:
            meta = gm(*[torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
                        if isinstance(a, torch.Tensor) else a for a in args])
            flat, spec = torch.utils._pytree.tree_flatten(meta)
            device = next(a.device for a in args
                          if isinstance(a, torch.Tensor) and a.device.type == "sim")
            outs = [torch.empty_strided(m.shape, m.stride(), dtype=m.dtype, device=device)
                    for m in flat]

            def kernel() -> None:
                self.launches += 1
                res = gm(*[chip_view(a) if isinstance(a, torch.Tensor) and a.device == device
                           else a for a in args])
                for out, r in zip(outs, torch.utils._pytree.tree_leaves(res), strict=True):
                    chip_view(out).copy_(r)

            torchport.launch(outs[0], kernel, name="fused")
            return torch.utils._pytree.tree_unflatten(outs, spec)

        return fused


def _targets(gm: torch.fx.GraphModule) -> list[Any]:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _pointwise(node: torch.fx.Node) -> bool:
    return torch.Tag.pointwise in node.target.tags


WHOLE, FUSED, CORE = Recorder(), FusingCompiler(), Recorder()
register_graph_compiler("tp_test_whole", WHOLE)
register_graph_compiler("tp_test_fused", FUSED, supports=_pointwise)
register_graph_compiler("tp_test_core", CORE, decompositions="core_aten")
register_graph_compiler("tp_test_noncallable", lambda gm, inputs: 42)


@pytest.fixture(autouse=True)
def _fresh() -> Any:
    for c in (WHOLE, FUSED, CORE):
        c.graphs.clear()
    FUSED.launches = 0
    yield
    torch._dynamo.reset()


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


class Chain(nn.Module):
    """Matrix products (not compiled by FUSED) between chains of pointwise ops."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.sigmoid(self.fc1(x).relu() * 2 + 1)
        return torch.tanh(self.fc2(h)) * 0.5


def _copy(model: nn.Module, device: str) -> nn.Module:
    out = type(model)().to(device)
    out.load_state_dict(model.state_dict())
    return out


def _run(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """The output, then every parameter's gradient, on the CPU."""
    y = model(x)
    y.pow(2).sum().backward()
    return [y.detach().cpu()] + [p.grad.cpu() for p in model.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for u, v in zip(a, b, strict=True):
        assert u.dtype == v.dtype and torch.equal(u, v)


def _compiled_vs_eager(make: Callable[[], nn.Module], backend: str, x: torch.Tensor,
                       device: str = "sim") -> None:
    """Compiled on the device == eager on the device == the CPU, bit for bit."""
    cpu = make()
    eager, compiled = make().to(device), make().to(device)
    for m in (eager, compiled):
        m.load_state_dict(cpu.state_dict())
    want = _run(cpu, x)
    _same(_run(eager, x.to(device)), want)
    _same(_run(torch.compile(compiled, backend=backend), x.to(device)), want)


def test_forward_and_backward_graphs_reach_the_compiler() -> None:
    _compiled_vs_eager(_mlp, "tp_test_whole", torch.randn(3, 8))
    assert [g.info for g in WHOLE.graphs] == [GraphInfo("tp_test_whole", "forward", None),
                                              GraphInfo("tp_test_whole", "backward", None)]
    assert {A.addmm.default, A.relu.default} <= WHOLE.ops("forward")
    assert {A.mm.default, A.threshold_backward.default, A.sum.dim_IntList} \
        <= WHOLE.ops("backward")
    fwd = WHOLE.graphs[0].inputs
    assert all(isinstance(t, FakeTensor) and t.device == torch.device("sim", 0) for t in fwd)
    # weights and biases, then the input
    assert [tuple(t.shape) for t in fwd] == [(16, 8), (16,), (3, 8), (4, 16), (4,)]
    WHOLE.graphs.clear()
    m = _mlp().to("sim")
    with torch.no_grad():
        y = torch.compile(m, backend="tp_test_whole")(torch.ones(2, 8, device="sim"))
        assert torch.equal(y.cpu(), m(torch.ones(2, 8, device="sim")).cpu())
    assert [g.info.kind for g in WHOLE.graphs] == ["inference"]


def test_core_aten_decompositions() -> None:
    def make() -> nn.Module:
        return nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Linear(16, 4))

    m = make().to("sim")
    x = torch.randn(3, 8, device="sim")
    y = torch.compile(m, backend="tp_test_core")(x)
    y.sum().backward()
    seen = CORE.ops("forward") | CORE.ops("backward")
    assert A.addmm.default in seen and A.permute.default in seen
    assert A.t.default not in seen and A.silu.default not in seen  # not Core ATen
    assert all(torch.Tag.core in op.tags for op in seen), \
        sorted(str(op) for op in seen if torch.Tag.core not in op.tags)
    torch.testing.assert_close(y, m(x))  # decomposed: not always the same rounding


def test_supported_regions_compiled_the_rest_runs_eagerly() -> None:
    x = torch.randn(5, 8)
    _compiled_vs_eager(Chain, "tp_test_fused", x)
    pointwise = {A.relu.default, A.mul.Tensor, A.add.Tensor, A.sigmoid.default,
                 A.tanh.default}
    assert FUSED.ops("forward") <= pointwise
    assert {A.relu.default, A.sigmoid.default, A.tanh.default} <= FUSED.ops("forward")
    assert {A.threshold_backward.default, A.sigmoid_backward.default,
            A.tanh_backward.default} <= FUSED.ops("backward")
    assert all(torch.Tag.pointwise in op.tags for g in FUSED.graphs for op in g.ops)
    assert all(g.info.region is not None for g in FUSED.graphs)
    regions = len(FUSED.graphs)
    assert FUSED.launches == regions  # each region ran once, as one kernel
    # a second call: the regions' kernels run, the matrix products run eagerly (native)
    m = torch.compile(Chain().to("sim"), backend="tp_test_fused")
    FUSED.launches = 0
    with ops.record() as rec:
        m(x.to("sim"))
    torch.sim.synchronize()  # the kernels ran on the stream
    assert FUSED.launches >= 2
    assert rec.path_of("addmm") == "native"
    assert not {"relu", "sigmoid", "tanh", "mul.Tensor", "add.Tensor"} & set(rec.ops)


def test_training_steps_with_adamw_equal_eager() -> None:
    cpu = Chain()
    models = {"cpu": cpu, "eager": _copy(cpu, "sim"), "compiled": _copy(cpu, "sim")}
    steps = {**models, "compiled": torch.compile(models["compiled"], backend="tp_test_fused")}
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-2) for name, m in models.items()}
    for _ in range(3):
        x, target = torch.randn(6, 8), torch.randn(6, 4)
        losses = {}
        for name, step in steps.items():
            dev = "cpu" if name == "cpu" else "sim"
            loss = torch.nn.functional.mse_loss(step(x.to(dev)), target.to(dev))
            opts[name].zero_grad()
            loss.backward()
            opts[name].step()
            losses[name] = loss.detach().cpu()
        assert torch.equal(losses["compiled"], losses["eager"])
        assert torch.equal(losses["compiled"], losses["cpu"])
    for name in ("eager", "compiled"):
        for p, q in zip(models[name].parameters(), cpu.parameters(), strict=True):
            assert torch.equal(p.detach().cpu(), q.detach())
    assert [g.info.kind for g in FUSED.graphs if g.info.region == 0] == ["forward", "backward"]


def test_on_the_second_device() -> None:
    _compiled_vs_eager(Chain, "tp_test_fused", torch.randn(4, 8), device="sim:1")
    devices = {t.device for g in FUSED.graphs for t in g.inputs if isinstance(t, torch.Tensor)}
    assert devices == {torch.device("sim", 1)}
    assert torch.sim.current_device() == 0


def test_graph_breaks_give_one_graph_each() -> None:
    w = torch.randn(8, 8)

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        a = torch.sin(x) * 2
        torch._dynamo.graph_break()
        return torch.relu(a @ w)

    x = torch.randn(3, 8)
    got = torch.compile(fn, backend="tp_test_whole")(x.to("sim"), w.to("sim"))
    assert torch.equal(got.cpu(), fn(x, w))
    assert [g.info.kind for g in WHOLE.graphs] == ["inference", "inference"]
    assert A.sin.default in WHOLE.graphs[0].ops and A.mm.default in WHOLE.graphs[1].ops


def test_dynamic_shapes_compile_once() -> None:
    m = Chain()
    compiled = torch.compile(_copy(m, "sim"), backend="tp_test_fused")
    for batch in (3, 5, 9):
        x = torch.randn(batch, 8)
        xs = x.to("sim")
        torch._dynamo.mark_dynamic(xs, 0)
        with torch.no_grad():
            assert torch.equal(compiled(xs).cpu(), m(x))
    assert [g.info.kind for g in FUSED.graphs if g.info.region == 0] == ["inference"]
    shapes = [t.shape[0] for g in FUSED.graphs for t in g.inputs
              if isinstance(t, torch.Tensor)]
    assert shapes and all(isinstance(s, torch.SymInt) for s in shapes)


def test_a_compiler_returning_no_callable_is_named() -> None:
    m = _mlp().to("sim")
    with pytest.raises(BackendCompilerFailed,
                       match=r"graph compiler 'tp_test_noncallable' returned 42 \(int\) for its "
                             "forward graph, not a callable"):
        torch.compile(m, backend="tp_test_noncallable")(torch.ones(2, 8, device="sim"))


def test_graphs_off_the_device_are_refused() -> None:
    with pytest.raises(BackendCompilerFailed, match="compiles sim graphs, but forward graph "
                       "has a tensor on cpu .*move the model and its inputs with .to"):
        torch.compile(_mlp(), backend="tp_test_whole")(torch.ones(2, 8))
    with pytest.raises(BackendCompilerFailed, match="compiles sim graphs, but forward graph "
                       "has no sim tensor"):
        torch.compile(_mlp(), backend="tp_test_fused")(torch.ones(2, 8))
    assert not WHOLE.graphs and not FUSED.graphs


def test_mixed_devices_with_supports_leave_cpu_ops_eager() -> None:
    def fn(x: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.relu(x) * 3, torch.relu(c) + 1  # the second on the CPU

    x, c = torch.randn(4), torch.randn(4)
    a, b = torch.compile(fn, backend="tp_test_fused")(x.to("sim"), c)
    assert a.device.type == "sim" and b.device.type == "cpu"
    assert torch.equal(a.cpu(), fn(x, c)[0]) and torch.equal(b, fn(x, c)[1])
    devices = {t.device.type for g in FUSED.graphs for t in g.inputs}
    assert devices == {"sim"}


def test_registration_errors() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_graph_compiler("tp_test_whole", WHOLE)
    with pytest.raises(ValueError, match="already registered"):
        register_graph_compiler("inductor", WHOLE)
    with pytest.raises(ValueError, match="one word"):
        register_graph_compiler("my compiler", WHOLE)
    with pytest.raises(TypeError, match="compile_fn must be a callable"):
        register_graph_compiler("tp_test_x", None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="supports lists 'mul', not an ATen op"):
        register_graph_compiler("tp_test_x", WHOLE, supports=["mul"])
    with pytest.raises(TypeError, match="decompositions must be a mapping"):
        register_graph_compiler("tp_test_x", WHOLE, decompositions="all")
    with pytest.raises(ValueError, match="was not given by a torchport graph compiler"):
        graph_info(torch.fx.symbolic_trace(_mlp()))


def test_supports_as_a_list_of_ops() -> None:
    rec = FusingCompiler()
    register_graph_compiler("tp_test_listed", rec, supports=[A.relu, A.mul.Tensor])
    x = torch.randn(5, 8)
    m = Chain()
    with torch.no_grad():
        got = torch.compile(_copy(m, "sim"), backend="tp_test_listed")
        assert torch.equal(got(x.to("sim")).cpu(), m(x))
    assert {op for g in rec.graphs for op in g.ops} == {A.relu.default, A.mul.Tensor}


@mode_independent
def test_registering_imports_no_dynamo() -> None:
    out = check_python(textwrap.dedent("""
        import sys, torch, torchport.sim
        from torchport.graph import register_graph_compiler
        seen = []
        def compile_fn(gm, inputs):
            seen.append(len(inputs))
            return gm.forward
        register_graph_compiler("late_vendor", compile_fn)
        assert "torch._dynamo" not in sys.modules
        f = torch.compile(lambda a: (a * 2).sum(), backend="late_vendor")
        assert f(torch.ones(4, device="sim")).item() == 8 and seen == [1]
        assert "late_vendor" in torch._dynamo.list_backends()
        print("ok")
    """))
    assert "ok" in out
