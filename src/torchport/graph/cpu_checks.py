"""Inductor's ``device.type == "cpu"`` decisions, for a device compiled with its C++ codegen.

Inductor (2.13) decides some things by asking whether a device is the CPU. For a
device whose graphs the C++ codegen compiles (:mod:`torchport.graph.inductor`), the
answers that choose *the code generator's rules* must be the CPU's, or inductor
generates code the C++ backend cannot compile or that computes the wrong thing:

=======================================  ==================================================
inductor's question                       why the device must get the CPU's answer
=======================================  ==================================================
``scheduler.BaseSchedulerNode.is_cpu``    fusion's loop reindexing and index inversion are
                                          written for SIMD (Triton) kernels; on C++ kernels
                                          they fail to compile graphs (LayerNorm's backward)
``utils.get_current_backend``             names the code generator: ``"cpp"``, not the
                                          ``"triton"`` inductor assumes for other devices
                                          (fp16 upcasts, masked loads' dtypes, asserts)
``ir.is_cpu``                             the realize thresholds tuned for the C++ codegen
``lowering.div_prim``                     true division by a constant, not multiplication by
                                          its reciprocal (which rounds differently)
``lowering.use_two_step_variance``        the C++ codegen's choice between Welford and the
                                          two-pass variance (``var``, LayerNorm, BatchNorm)
FakeTensor's convolution rule             the memory format of a convolution's result: the
(``fake_impls``, ``aten.convolution``)    device's convolution is the CPU's kernel
                                          (channels_last in, channels_last out, as cuDNN);
                                          PyTorch's rule for a PrivateUse1 device
                                          (``Overrideable``) says contiguous, and the
                                          compiled program's stride check fails
``GraphLowering.decide_layout_opt``       not correctness but the same fact: the device's
                                          convolution is the CPU's oneDNN kernel, for
                                          which inductor lays convolutions out channels-last
                                          (other devices get cuDNN's heuristics, which keep
                                          small CNNs in NCHW: a compiled step 1.2x slower)
=======================================  ==================================================

Each is extended, not replaced: the function keeps its name, and answers as before for
every device but the ones compiled here, so CPU compiles are unchanged
(tests/test_graph_inductor.py checks both), and a graph compiled for the device
computes what the same graph compiled for the CPU computes, bit for bit, except where
the decisions left to inductor's (and PyTorch's decompositions') non-CPU answer, which
is CUDA's, round differently (convolution bias, group norm) or give CUDA's shapes (eval
batch norm's statistics): docs/graph-mode.md lists them, reports/compiled-opinfo.md
measures them.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

#: device types inductor compiles with its C++ codegen besides the CPU
HOST_CODEGEN_DEVICES: set[str] = set()
_INSTALLED = False


def _device_type(x: Any) -> str | None:
    if x is None:
        return None
    if isinstance(x, str):
        return x
    t = getattr(x, "type", None)
    return t if isinstance(t, str) else None


def _extend(owner: Any, attr: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]
            ) -> None:
    original = getattr(owner, attr)
    extended = functools.wraps(original)(make(original))
    extended.__torchport_extends__ = original  # type: ignore[attr-defined]
    setattr(owner, attr, extended)


def install(name: str) -> None:
    """Answer inductor's CPU questions for device ``name`` as for the CPU."""
    global _INSTALLED
    HOST_CODEGEN_DEVICES.add(name)
    if _INSTALLED:
        return
    _INSTALLED = True
    from torch._inductor import config, ir, lowering, scheduler, utils
    from torch._inductor.virtualized import V, ops

    devices = HOST_CODEGEN_DEVICES

    def node_is_cpu(original: Callable[..., bool]) -> Callable[..., bool]:
        def is_cpu(self: Any) -> bool:
            if original(self):
                return True
            device = self.get_device()
            return device is not None and device.type in devices
        return is_cpu

    _extend(scheduler.BaseSchedulerNode, "is_cpu", node_is_cpu)

    def ir_is_cpu(original: Callable[..., bool]) -> Callable[..., bool]:
        def is_cpu(x: Any) -> bool:
            return original(x) or ir.get_device_type(x) in devices
        return is_cpu

    _extend(ir, "is_cpu", ir_is_cpu)

    def current_backend(original: Callable[..., str]) -> Callable[..., str]:
        def get_current_backend(device_type: str | None = None) -> str:
            t = device_type
            if not t:
                t = _device_type(V.graph.get_current_device_or_throw())
            if t in devices:
                return original("cpu")
            return original(device_type)
        return get_current_backend

    def div_prim(original: Callable[..., Any]) -> Callable[..., Any]:
        def div(a: Any, b: Any) -> Any:
            if ir.get_device_type(a) in devices and lowering.get_constant_value(b) is not None \
                    and not all(lowering.is_boolean_type(x) or lowering.is_integer_type(x)
                                for x in (a, b)):
                return lowering.make_pointwise(lambda x, y: ops.truediv(x, y))(a, b)
            return original(a, b)
        return div

    _extend(lowering, "div_prim", div_prim)

    def two_step(original: Callable[..., bool]) -> Callable[..., bool]:
        def use_two_step_variance(x: Any, axis: Any, keepdim: Any, input_dtype: Any) -> bool:
            if ir.get_device_type(x) not in devices:
                return original(x, axis, keepdim, input_dtype)
            # the CPU's rule
            kwargs = lowering._make_reduction_inner(
                x, axis=lowering._validate_reduction_axis(x, axis), keepdims=keepdim,
                dtype=None, override_return_dtype=None)
            numel = lowering.sympy_product(kwargs["reduction_ranges"])
            if not isinstance(numel, lowering.sympy.Integer):
                return False
            return not (int(numel) > config.cpp.use_two_step_variance_threshold
                        or lowering.sympy_product(kwargs["ranges"]) == 1)
        return use_two_step_variance

    _extend(lowering, "use_two_step_variance", two_step)

    def layout_opt(original: Callable[..., bool]) -> Callable[..., bool]:
        def decide_layout_opt(gm: Any, *, is_inference: bool) -> bool:
            import torch

            if config.layout_optimization and torch.backends.mkldnn.enabled \
                    and torch.backends.mkldnn.is_available():
                convs = [n for n in gm.graph.nodes
                         if n.target is torch.ops.aten.convolution.default]
                if convs and all(_device_type(getattr(n.args[i].meta.get("val"), "device", None))
                                 in devices for n in convs for i in (0, 1)):
                    return True  # the CPU's answer for its oneDNN convolutions
            return original(gm, is_inference=is_inference)
        return decide_layout_opt

    from torch._inductor.graph import GraphLowering as lowering_class
    _extend(lowering_class, "decide_layout_opt", layout_opt)
    lowering_class.decide_layout_opt = staticmethod(lowering_class.decide_layout_opt)

    # every module that imported the function by name holds its own binding
    patched = None
    for mod_name in ("torch._inductor.utils", "torch._inductor.codegen.common",
                     "torch._inductor.scheduler", "torch._inductor.kernel.mm_common"):
        mod = sys.modules.get(mod_name)
        if mod is None:
            __import__(mod_name)
            mod = sys.modules[mod_name]
        if patched is None:
            _extend(mod, "get_current_backend", current_backend)
            patched = mod.get_current_backend
        elif getattr(mod, "get_current_backend", None) is utils.__dict__.get(
                "get_current_backend").__torchport_extends__:
            mod.get_current_backend = patched


def install_fake_rules(name: str) -> None:
    """FakeTensor's convolution rules answer for device ``name`` as for the CPU, from the
    start: dynamo and AOTAutograd trace with them before inductor is involved."""
    HOST_CODEGEN_DEVICES.add(name)
    _extend_fake_convolution(HOST_CODEGEN_DEVICES)


def _extend_fake_convolution(devices: set[str]) -> None:
    """FakeTensor's convolution rules answer for the devices as for the CPU: the inputs are
    presented as CPU tensors to the rule, its results are the device's again."""
    import torch
    from torch._subclasses import fake_impls
    from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager
    from torch.utils import _pytree

    cpu = torch.device("cpu")

    def fake_convolution(original: Callable[..., Any]) -> Callable[..., Any]:
        def conv(fake_mode: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
            moved = [(t, t.fake_device) for t in (*args, *kwargs.values())
                     if isinstance(t, FakeTensor) and t.fake_device.type in devices]
            if not moved:
                return original(fake_mode, func, *args, **kwargs)
            for t, _ in moved:
                t.fake_device = cpu
            try:
                out = original(fake_mode, func, *args, **kwargs)
            finally:
                for t, device in moved:
                    t.fake_device = device
            device = moved[0][1]

            def on_device(o: Any) -> Any:
                if not isinstance(o, FakeTensor) or o.fake_device != cpu:
                    return o
                with in_kernel_invocation_manager(fake_mode):
                    meta = torch.empty_strided(o.shape, o.stride(), dtype=o.dtype,
                                               device="meta")
                return FakeTensor(fake_mode, meta, device)
            return _pytree.tree_map(on_device, out)
        return conv

    table = fake_impls.op_implementations_dict
    aten = torch.ops.aten
    for op in (aten.convolution.default, aten._convolution.default,
               aten._convolution.deprecated, aten.convolution_backward.default):
        original = table.get(op)
        if original is not None and not hasattr(original, "__torchport_extends__"):
            extended_rule = functools.wraps(original)(fake_convolution(original))
            extended_rule.__torchport_extends__ = original  # type: ignore[attr-defined]
            table[op] = extended_rule


def extended() -> list[str]:
    """The inductor functions answered for the devices (for ``torchport info`` and tests)."""
    return ["scheduler.BaseSchedulerNode.is_cpu", "ir.is_cpu", "utils.get_current_backend",
            "lowering.div_prim", "lowering.use_two_step_variance",
            "graph.GraphLowering.decide_layout_opt",
            "fake_impls.op_implementations_dict[aten.convolution*]"]
