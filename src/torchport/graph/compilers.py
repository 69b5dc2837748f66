"""A vendor's graph compiler behind ``torch.compile(model, backend="<name>")``.

What Ascend's torchair and DIPU's DICP do for their devices, for any torchport device: the
vendor gives a function that compiles an FX graph of ATen ops into a callable, and
:func:`register_graph_compiler` makes it a named TorchDynamo backend. AOTAutograd
(``torch._dynamo.backends.common.aot_autograd``) traces the model's forward and backward
into two ATen graphs (one graph, "inference", where nothing needs gradients), optionally
decomposed to Core ATen; each goes to the compiler:

* whole, when no ``supports`` is given: every tensor of the graph must be on the device;
* in regions, when ``supports`` says which nodes the compiler takes: torch.fx's
  ``CapabilityBasedPartitioner`` groups the supported nodes on the device into regions,
  each compiled on its own; the other nodes run eagerly on the device between them.

The compiler is called as a Dynamo backend is, ``compile_fn(gm, example_inputs)``:
``example_inputs`` are fake tensors (shape, dtype, device; no data) and ``SymInt`` s where
shapes are dynamic; it returns a callable taking the graph's inputs positionally and
returning what ``gm`` returns (``gm.forward`` runs the graph as it is). Which graph it is
(forward, backward, inference; the region's index) is :func:`graph_info` of ``gm``.

TorchDynamo costs seconds to import: registering does not import it. A compiler registered
before ``torch._dynamo`` is imported joins Dynamo's registry as that module loads.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.fx
import torch.utils._pytree as pytree

from torchport.core import lazy

__all__ = ["GraphCompiler", "GraphInfo", "NodeSupport", "graph_info", "register_graph_compiler"]

GraphCompiler = Callable[[torch.fx.GraphModule, list[Any]], Callable[..., Any]]
"""``compile_fn(gm, example_inputs) -> callable``: a TorchDynamo backend's signature."""

NodeSupport = Callable[[torch.fx.Node], bool]
"""Whether the compiler takes a ``call_function`` node (``node.target`` is the ATen
overload, ``node.meta["val"]`` its fake result, ``node.args`` its inputs)."""

GraphKind = Literal["forward", "backward", "inference"]

_INFO = "torchport_graph"  # GraphModule.meta key of the GraphInfo
_REGISTRY = "torch._dynamo.backends.registry"
_REGION_PREFIX = "region_"


@dataclass(frozen=True)
class GraphInfo:
    """What a graph handed to a vendor's compiler is: ``graph_info(gm)``."""

    compiler: str  # the registered name
    kind: GraphKind  # "forward", "backward", or "inference" (no gradients needed)
    region: int | None  # the region's index in its graph (``supports``); None: the whole graph

    def describe(self) -> str:
        where = "" if self.region is None else f" (region {self.region})"
        return f"its {self.kind} graph{where}"


def graph_info(gm: torch.fx.GraphModule) -> GraphInfo:
    """What ``gm``, a graph given to a registered compiler, is."""
    info = gm.meta.get(_INFO)
    if info is None:
        raise ValueError("this graph was not given by a torchport graph compiler: "
                         "graph_info() answers for the graphs a registered compiler receives")
    return info


@dataclass(frozen=True)
class _Spec:
    name: str
    compile_fn: GraphCompiler
    supports: NodeSupport | None
    decompositions: Mapping[Any, Callable[..., Any]] | str | None


_PENDING: dict[str, Callable[..., Any]] = {}  # name -> backend, until Dynamo's registry loads
_REGISTERED: dict[str, Callable[..., Any]] = {}


def register_graph_compiler(
    name: str,
    compile_fn: GraphCompiler,
    *,
    supports: NodeSupport | Iterable[torch._ops.OpOverload | torch._ops.OpOverloadPacket]
    | None = None,
    decompositions: Mapping[Any, Callable[..., Any]] | Literal["core_aten"] | None = None,
) -> Callable[[torch.fx.GraphModule, list[Any]], Callable[..., Any]]:
    """Make ``compile_fn`` the TorchDynamo backend ``name``: ``torch.compile(model,
    backend=name)`` gives it the model's forward and backward ATen graphs.

    ``supports``: a predicate on nodes, or the ATen overloads/packets the compiler takes;
    only regions of supported nodes are compiled, the rest runs eagerly on the device.
    None: the compiler takes every graph whole. ``decompositions``: a decomposition table
    AOTAutograd applies while tracing, or ``"core_aten"`` for PyTorch's Core ATen opset
    (``torch._decomp.core_aten_decompositions()``); None: the ops as autograd leaves them.

    Returns the backend (``torch.compile(model, backend=<it>)`` works too). The name must
    be new to Dynamo (a vendor prefix: not ``inductor``, ``eager``...).
    """
    if not isinstance(name, str) or not name or any(c.isspace() for c in name):
        raise ValueError(f"a graph compiler's name is one word such as 'mychip_graph', "
                         f"not {name!r}")
    if not callable(compile_fn):
        raise TypeError(f"graph compiler {name!r}: compile_fn must be a callable "
                        f"(gm, example_inputs) -> callable, got {type(compile_fn).__name__}")
    spec = _Spec(name, compile_fn, _support_predicate(name, supports),
                 _decomposition_table(name, decompositions))
    registry = sys.modules.get(_REGISTRY)
    if registry is not None:
        registry._lazy_import()  # Dynamo's own backends, so that their names are taken
    taken = name in _REGISTERED or (registry is not None and (
        name in registry._COMPILER_FNS or name in registry._BACKENDS))
    if taken:
        raise ValueError(f"a TorchDynamo backend named {name!r} is already registered; "
                         f"give the graph compiler another name")
    backend = _backend(spec)
    _REGISTERED[name] = backend
    if registry is not None:
        registry.register_backend(compiler_fn=backend, name=name)
    else:
        _PENDING[name] = backend
        if len(_PENDING) == 1:  # the first pending one: register them all on import
            lazy.when_imported(_REGISTRY, _register_pending)
    return backend


def _support_predicate(name: str, supports: Any) -> NodeSupport | None:
    if supports is None or callable(supports):
        return supports
    if isinstance(supports, (str, bytes)) or not isinstance(supports, Iterable):
        raise TypeError(f"graph compiler {name!r}: supports must be a predicate on "
                        f"torch.fx.Node or a collection of ATen ops, got {supports!r}")
    ops = frozenset(supports)
    for op in ops:
        if not isinstance(op, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            raise TypeError(f"graph compiler {name!r}: supports lists {op!r}, not an ATen op "
                            f"(torch.ops.aten.mul.Tensor or torch.ops.aten.mul)")

    def listed(node: torch.fx.Node) -> bool:
        return node.target in ops or node.target.overloadpacket in ops  # type: ignore[union-attr]

    return listed


def _decomposition_table(name: str, decompositions: Any) -> Any:
    if decompositions is None or decompositions == "core_aten":
        return decompositions
    if not isinstance(decompositions, Mapping):
        raise TypeError(f"graph compiler {name!r}: decompositions must be a mapping "
                        f"{{OpOverload: function}} or 'core_aten', got {decompositions!r}")
    return dict(decompositions)


def _backend(spec: _Spec) -> Callable[[torch.fx.GraphModule, list[Any]], Callable[..., Any]]:
    """The Dynamo backend: AOTAutograd with the vendor's compiler on each graph."""

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        from torch._dynamo.backends.common import aot_autograd

        device = _device_type(spec)
        decompositions = spec.decompositions
        if decompositions == "core_aten":
            decompositions = dict(torch._decomp.core_aten_decompositions())

        def compiler(kind: GraphKind) -> Callable[..., Any]:
            return lambda g, inputs: _compile(spec, kind, device, g, inputs)

        aot = aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward"),
                           inference_compiler=compiler("inference"),
                           decompositions=decompositions)
        return aot(gm, example_inputs)

    backend.__name__ = backend.__qualname__ = spec.name
    backend.__doc__ = f"The graph compiler {spec.name!r} (torchport.graph.register_graph_compiler)."
    return backend


def _device_type(spec: _Spec) -> str:
    device = torch._C._get_privateuse1_backend_name()
    if device == "privateuseone":
        raise RuntimeError(f"graph compiler {spec.name!r}: no torchport device is registered; "
                           f"import torchport.sim (or the vendor's backend) before compiling")
    return device


def _compile(spec: _Spec, kind: GraphKind, device: str, gm: torch.fx.GraphModule,
             example_inputs: Sequence[Any]) -> Callable[..., Any]:
    from torch._functorch.aot_autograd import make_boxed_func

    if spec.supports is None:
        _check_whole_graph(spec, kind, device, gm)
        info = GraphInfo(spec.name, kind, None)
        gm.meta[_INFO] = info
        compiled = _checked(spec, info, spec.compile_fn(gm, list(example_inputs)))
    else:
        compiled = _compile_regions(spec, kind, device, gm)
    return make_boxed_func(compiled)


def _off_device(value: Any, device: str) -> list[torch.Tensor]:
    """The tensors of ``value`` on another device; CPU scalars (0-dim) are not counted:
    device ops take them as they take Python numbers."""
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)
            and t.device.type != device and not (t.device.type == "cpu" and t.dim() == 0)]


def _where(gm: torch.fx.GraphModule, device: str) -> tuple[bool, dict[str, str]]:
    """Whether some tensor of ``gm`` is on ``device``; the other devices -> a node there."""
    on_device, elsewhere = False, {}
    for node in gm.graph.nodes:
        for t in pytree.tree_leaves(node.meta.get("val")):
            if not isinstance(t, torch.Tensor):
                continue
            if t.device.type == device:
                on_device = True
            elif _off_device(t, device):
                elsewhere.setdefault(str(t.device), node.name)
    return on_device, elsewhere


def _check_whole_graph(spec: _Spec, kind: GraphKind, device: str,
                       gm: torch.fx.GraphModule) -> None:
    _, elsewhere = _where(gm, device)
    if elsewhere:
        dev, node = next(iter(elsewhere.items()))
        raise RuntimeError(
            f"graph compiler {spec.name!r} compiles {device} graphs, but {kind} graph has a "
            f"tensor on {dev} (node {node}); move the model and its inputs with "
            f".to({device!r}), or register the compiler with supports= so that ops off "
            f"the device run eagerly")


def _compile_regions(spec: _Spec, kind: GraphKind, device: str,
                     gm: torch.fx.GraphModule) -> Callable[..., Any]:
    """Regions of supported nodes on the device compiled, the rest left to run eagerly."""
    from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
    from torch.fx.passes.operator_support import create_op_support

    on_device, elsewhere = _where(gm, device)
    if elsewhere and not on_device:
        dev, node = next(iter(elsewhere.items()))
        raise RuntimeError(
            f"graph compiler {spec.name!r} compiles {device} graphs, but {kind} graph has no "
            f"{device} tensor (node {node} is on {dev}); move the model and its inputs "
            f"with .to({device!r})")
    supports = spec.supports
    assert supports is not None

    def supported(_submodules: Mapping[str, torch.nn.Module], node: torch.fx.Node) -> bool:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            return False
        if "val" not in node.meta or _off_device(node.meta["val"], device):
            return False
        args = [a.meta.get("val") for a in node.all_input_nodes]
        if _off_device(args, device):
            return False
        return bool(supports(node))

    partitioner = CapabilityBasedPartitioner(gm, create_op_support(supported),
                                             allows_single_node_partition=True)
    partitions = partitioner.propose_partitions()
    if not partitions:
        return gm
    fused = partitioner.fuse_partitions(partitions, prefix=_REGION_PREFIX)
    regions = [n for n in fused.graph.nodes
               if n.op == "call_module" and n.target.startswith(_REGION_PREFIX)]
    for index, node in enumerate(regions):
        region = fused.get_submodule(node.target)
        info = GraphInfo(spec.name, kind, index)
        region.meta[_INFO] = info
        inputs = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in node.args]
        compiled = _checked(spec, info, spec.compile_fn(region, inputs))
        setattr(fused, node.target, _Compiled(compiled, spec.name, index))
    return fused


def _checked(spec: _Spec, info: GraphInfo, compiled: Any) -> Callable[..., Any]:
    if not callable(compiled):
        raise TypeError(
            f"graph compiler {spec.name!r} returned {_short(compiled)} for "
            f"{info.describe()}, not a callable: return a function of the graph's inputs "
            f"that returns its outputs (gm.forward runs the graph as it is)")
    return compiled


def _short(value: Any) -> str:
    text = repr(value)
    return f"{text[:40]}... ({type(value).__name__})" if len(text) > 40 \
        else f"{text} ({type(value).__name__})"


class _Compiled(torch.nn.Module):
    """A region's compiled callable in place of its subgraph."""

    def __init__(self, fn: Callable[..., Any], compiler: str, region: int) -> None:
        super().__init__()
        self.fn = fn
        self.compiler = compiler
        self.region = region

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)

    def extra_repr(self) -> str:
        return f"compiler={self.compiler!r}, region={self.region}"


def _register_pending(registry: types.ModuleType) -> None:
    while _PENDING:
        name, backend = _PENDING.popitem()
        registry.register_backend(compiler_fn=backend, name=name)
