"""Static op coverage: which ATen overloads a script would send to the device, without running it.

Device tensors become fake tensors (``torch._subclasses.fake_tensor``): they have
a device, shape, dtype and autograd history but no storage, so nothing is
allocated on the device and no kernel runs. CPU tensors stay real, so data
loading, samplers and CPU preprocessing run as usual and only device work is
traced. Each overload that touches the device is classified by the path it
*would* take on the real backend (native kernel, decomposition, view, CPU
fallback). A device value the script needs on the host (``.item()``,
``print(t)``, ``.tolist()``, data-dependent shapes) cannot be known without
running: the trace stops there and the result says where.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from torchport.ops import fallback, paths, stats
from torchport.ops.plan import plan_for
from torchport.ops.registry import native_overloads


@dataclass
class StopInfo:
    """Where and why a static trace stopped."""

    op: str | None  # the overload being traced when it stopped ("_local_scalar_dense")
    location: str | None  # "script.py:12" (innermost frame outside torch)
    reason: str  # exception type and message

    def __str__(self) -> str:
        at = f" at {self.location}" if self.location else ""
        during = f" in {self.op}" if self.op else ""
        return f"stopped{at}{during}: {self.reason}"


def classify(op: torch._ops.OpOverload, args: tuple, kwargs: dict, device_type: str) -> str:
    """The path ``op`` would take on the active backend with these (meta/fake) arguments.

    Mirrors the op layer: a kernel (native, unless forced to fallback or declining
    the dtype), else a metadata-only view, else a decomposition (PyTorch's own
    composite kernel, or a ``torch._decomp`` one whose pieces all run on the
    device), else the CPU fallback.
    """
    plan = plan_for(op)
    name = plan.overload_name
    forced = fallback.is_forced(name)
    decl = native_overloads().get(name)
    if decl is None and _has_device_kernel(plan.name):
        decl_ok = True  # a kernel registered outside KernelSet (torchport's core ops)
    else:
        decl_ok = decl is not None and _dtypes_ok(decl.dtypes, args, kwargs)
    if decl_ok:  # torchport's own kernels apart from the backend's, as a run reports them
        return "fallback" if forced else "torchport" if name in stats.OWN else "native"
    if not forced and stats.computed_by_composite(op):
        return "composite"  # as a run reports it: PyTorch's composite kernel computes it
    if plan.is_view:
        return "view"
    if not forced and _has_composite_kernel(plan.name):
        return "decomposed"  # PyTorch's composite kernel runs it as other device ops
    if not forced:
        with unset_fake_temporarily():
            margs, mkw = tree_map(_meta_like, args), tree_map(_meta_like, kwargs)
            d = paths.decomposition_for(op, device_type, margs, mkw, fallback.is_forced)
        if d is not None:
            return "decomposed"
    return "fallback"


def _has_device_kernel(full: str) -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(full, "PrivateUse1")
    except RuntimeError:
        return False


def _has_composite_kernel(full: str) -> bool:
    for key in ("CompositeExplicitAutogradNonFunctional", "CompositeExplicitAutograd"):
        try:
            if torch._C._dispatch_has_kernel_for_dispatch_key(full, key):
                return True
        except RuntimeError:
            return False
    return False


def _dtypes_ok(allowed: frozenset[torch.dtype] | None, args: tuple, kwargs: dict) -> bool:
    if not allowed:
        return True
    return all(d in allowed for d in stats._dtypes(args, kwargs))


def _meta_like(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
    return v


def _is_device(v: Any, device_type: str) -> bool:
    if isinstance(v, torch.device):
        return v.type == device_type
    if isinstance(v, str):
        return v.split(":", 1)[0] == device_type
    return False


class _DeviceTracer(TorchDispatchMode):
    """Runs CPU-only ops for real and every op touching the device on fake tensors."""

    def __init__(self, rec: stats.Recorder, device_type: str) -> None:
        super().__init__()
        self.rec = rec
        self.device_type = device_type
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)
        self.current: str | None = None
        self._paths: dict[tuple[Any, tuple[torch.dtype, ...]], str] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        fake_in = any(isinstance(v, FakeTensor) for v in flat)
        if not fake_in and not any(_is_device(v, self.device_type) for v in flat):
            return func(*args, **kwargs)  # CPU work: real
        on_device = any(isinstance(v, torch.Tensor) and v.device.type == self.device_type
                        for v in flat) or any(_is_device(v, self.device_type) for v in flat)
        name = None
        if isinstance(func, torch._ops.OpOverload) and func.namespace == "aten":
            name = plan_for(func).overload_name
            self.current = name
        args, kwargs = tree_map(self._fake, (args, kwargs))
        with self.fake:
            out = func(*args, **kwargs)
        if name is not None:
            if not on_device:
                outs, _ = tree_flatten(out)
                on_device = any(isinstance(v, torch.Tensor) and v.device.type == self.device_type
                                for v in outs)
            if on_device:
                self._record(func, name, args, kwargs)
        self.current = None
        return out

    def _fake(self, v: Any) -> Any:
        # Convert real inputs ourselves: the fake mode would keep small ones as constants
        # and run the real kernel (allocating device memory) on them.
        if isinstance(v, torch.Tensor) and not isinstance(v, FakeTensor):
            return self.fake.from_tensor(v)
        return v

    def _record(self, func: Any, name: str, args: tuple, kwargs: dict) -> None:
        dtypes = stats._dtypes(args, kwargs)
        key = (func, tuple(dtypes))
        path = self._paths.get(key)
        if path is None:
            path = self._paths[key] = classify(func, args, kwargs, self.device_type)
        self.rec.add(name, path, dtypes, 0.0)


@contextmanager
def trace(rec: stats.Recorder, device_type: str) -> Iterator[_DeviceTracer]:
    """Trace device work into ``rec`` (paths classified, host time 0) inside the block."""
    tracer = _DeviceTracer(rec, device_type)
    with tracer:
        yield tracer


# Exceptions that mean "the trace needs real device data here", not a bug in the script.
def is_trace_limit(exc: BaseException) -> bool:
    """True when ``exc`` is fake tensors refusing something only real data can answer."""
    from torch._subclasses import fake_tensor as ft

    limits: tuple[type[BaseException], ...] = tuple(
        t for t in (getattr(ft, n, None) for n in (
            "DataDependentOutputException", "DynamicOutputShapeException",
            "UnsupportedOperatorException", "UnsupportedFakeTensorException",
            "MetadataMismatchError")) if isinstance(t, type))
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, limits):
            return True
        text = str(e)
        if "FakeTensor" in text or "fake tensor" in text or "data-dependent" in text \
                or "meta tensor" in text.lower() or "Cannot access data pointer" in text:
            return True
        e = e.__cause__ or e.__context__
    return False


def stop_info(exc: BaseException, op: str | None, script: str | None = None) -> StopInfo:
    """Describe where ``exc`` stopped the trace: the innermost frame in the user's code."""
    frames = traceback.extract_tb(exc.__traceback__)
    location = None
    torch_dir = torch.__file__.rsplit("/", 2)[0]
    own = __file__.rsplit("/", 3)[0]
    for f in reversed(frames):
        if script is not None and _same(f.filename, script):
            location = f"{f.filename}:{f.lineno}"
            break
        if location is None and not f.filename.startswith((torch_dir, own, sys.prefix)) \
                and not f.filename.startswith("<"):
            location = f"{f.filename}:{f.lineno}"
    reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    return StopInfo(op=op, location=location, reason=reason.rstrip(": "))


def _same(a: str, b: str) -> bool:
    import os

    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
