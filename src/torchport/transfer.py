"""Run unmodified CUDA code on the torchport device (``torch_npu.contrib.transfer_to_npu``-style).

``import torchport.transfer`` (after, or before, the backend registers),
``TORCHPORT_TRANSFER=1`` or ``torchport run script.py`` turn it on. CUDA code
names the GPU in many ways, most of them parsed in C++ where a Python backend
cannot hook, so transfer rewrites every *Python entry point* that receives a
device before the value reaches C++:

* ``torch.device`` is replaced by a class whose metaclass maps ``"cuda"`` to the
  device while ``isinstance(x, torch.device)`` still checks against the real C
  type (device objects keep pickling through :mod:`copyreg`); ``torch.Generator`` likewise,
  so ``Generator(device="cuda")`` is a device generator;
* factory functions (every ``torch.*`` op whose schema has a ``device``
  argument), ``Tensor.to/new_*/cuda/is_cuda/pin_memory``, ``Module.to``,
  ``torch.set_default_device``, autocast/GradScaler and ``init_process_group``;
* ``torch.cuda.*`` forwards, at call time, to ``torch.<device>`` (so names that
  layers add later, e.g. streams, are found), with clear errors or one-time
  warnings for what has no equivalent (graphs, jiterator, nvtx, extensions); so do
  its submodules (``torch.cuda.random``, ``.memory``, ``.streams``, ...), whose
  names are the same objects as ``torch.cuda``'s;
* a serialization package maps storages tagged ``cuda:N`` to ``<device>:N``.

Every patch is recorded, so :func:`disable` restores the exact previous objects;
:func:`enable` is idempotent. CPU code is untouched: only the values ``"cuda"``,
``"cuda:N"`` and CUDA ``torch.device`` objects are rewritten.

Not mappable: ``tensor.device.type`` is computed in C++ and reports the real
device type (``"sim"``), never ``"cuda"``.
"""

from __future__ import annotations

import contextlib
import copyreg
import functools
import re
import sys
import types
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from torchport import backend as _backend_mod

if TYPE_CHECKING:
    from torchport.backend import Backend

__all__ = ["TransferError", "disable", "enable", "is_enabled", "map_device"]

_RealDevice: type = torch._C.device
_RealGenerator: type = torch._C.Generator
_MISSING = object()
_CUDA_RE = re.compile(r"^cuda(?::(\d+))?$")


class TransferError(RuntimeError):
    """A CUDA API has no equivalent on the transferred-to device."""


class _State:
    def __init__(self) -> None:
        self.backend: Backend | None = None
        self.patches: list[tuple[Any, str, Any]] = []
        self.package: tuple[int, Any, Any] | None = None
        self.warned: set[str] = set()
        self.amp_ok: bool | None = None
        self.pin_ok = True
        self.requested = False  # imported before any backend: enable as one registers


_S = _State()


# ---- mapping rules -----------------------------------------------------------------
def _name() -> str:
    if _S.backend is None:
        raise TransferError("torchport.transfer is not enabled")
    return _S.backend.name


def _map_str(s: str) -> str:
    m = _CUDA_RE.match(s.strip())
    if m is None:
        return s
    return _name() if m.group(1) is None else f"{_name()}:{m.group(1)}"


def map_device(d: Any) -> Any:
    """``"cuda"``/``"cuda:N"``/CUDA ``torch.device`` -> the device; anything else unchanged.

    Integers already mean "the current accelerator" in PyTorch, so they are kept.
    """
    if isinstance(d, str):
        return _map_str(d)
    if isinstance(d, _RealDevice) and d.type == "cuda":
        return _RealDevice(_name(), d.index) if d.index is not None else _RealDevice(_name())
    return d


def _map_type(device_type: Any) -> Any:
    """A device *type* argument (autocast, GradScaler): ``"cuda"`` -> the device name."""
    return _name() if device_type == "cuda" else device_type


def _map_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    args = tuple(map_device(a) if isinstance(a, (str, _RealDevice)) else a for a in args)
    if "device" in kwargs:
        kwargs["device"] = map_device(kwargs["device"])
    return args, kwargs


def _device_kw(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a factory: map its ``device=`` keyword (positional args are data, kept)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        d = kwargs.get("device")
        if d is not None:
            kwargs["device"] = map_device(d)
        return fn(*args, **kwargs)

    wrapper.__torchport_original__ = fn  # type: ignore[attr-defined]
    return wrapper


def _device_all(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a function that may take the device positionally (``Tensor.to``, ...)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = _map_args(args, kwargs)
        return fn(*args, **kwargs)

    wrapper.__torchport_original__ = fn  # type: ignore[attr-defined]
    return wrapper


def _warn_once(api: str, message: str) -> None:
    if api not in _S.warned:
        _S.warned.add(api)
        warnings.warn(f"torchport.transfer: {api}: {message}", RuntimeWarning, stacklevel=3)


def _unsupported(api: str, why: str, original: Any = None) -> Callable[..., Any]:
    """A function that raises :class:`TransferError`; it keeps ``original``'s name and
    ``__wrapped__`` (torch reads them: dynamo takes ``torch.cuda.use_mem_pool.__wrapped__``)."""
    def raiser(*args: Any, **kwargs: Any) -> Any:
        raise TransferError(f"{api} has no equivalent on the {_name()!r} device: {why} "
                            f"(torchport.transfer)")

    if callable(original):
        functools.update_wrapper(raiser, original)
    raiser.__name__ = api.rsplit(".", 1)[-1]
    return raiser


def _unsupported_class(api: str, why: str, original: type) -> type:
    """A stand-in for a class with no equivalent that is still a class: annotations
    (``torch.cuda.CUDAGraph | None``), subclassing and ``isinstance`` work (no object is
    ever an instance); making one raises :class:`TransferError`."""
    raiser = _unsupported(api, why)

    def __new__(cls: type, *args: Any, **kwargs: Any) -> Any:
        return raiser()

    return type(original.__name__, (), {"__new__": __new__, "__module__": original.__module__,
                                        "__qualname__": original.__qualname__,
                                        "__doc__": f"{api}: {why} (torchport.transfer)"})


# ---- torch.device, torch.Generator -------------------------------------------------
class _StandInMeta(type):
    """A stand-in for one of torch's C types (``cls._real``): it answers ``isinstance`` and
    ``issubclass`` like the C type and equals it (FX's code generator compares a graph's
    device constants' type with ``torch.device``)."""

    _real: type

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, cls._real)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, cls._real)

    def __eq__(cls, other: object) -> bool:
        return other is cls or other is cls._real

    __hash__ = type.__hash__


def _named_as(stand_in: type, real: type, name: str) -> type:
    stand_in._real = real  # type: ignore[attr-defined]
    stand_in.__module__ = "torch"
    stand_in.__qualname__ = stand_in.__name__ = name
    stand_in.__doc__ = real.__doc__
    return stand_in


class _Device(metaclass=_StandInMeta):
    """``torch.device`` under transfer: builds real devices, ``"cuda"`` mapped."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:  # type: ignore[misc]
        args, kwargs = _map_args(args, kwargs)
        if isinstance(kwargs.get("type"), str):
            kwargs["type"] = _map_str(kwargs["type"])
        if len(args) == 2 and args[0] == "cuda":
            args = (_name(), args[1])
        return _RealDevice(*args, **kwargs)


class _Generator(metaclass=_StandInMeta):
    """``torch.Generator`` under transfer: ``Generator(device="cuda")`` is a device generator."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:  # type: ignore[misc]
        args, kwargs = _map_args(args, kwargs)
        return _RealGenerator(*args, **kwargs)


_named_as(_Device, _RealDevice, "device")
_named_as(_Generator, _RealGenerator, "Generator")


def _dynamo_knows_real_devices(utils: types.ModuleType) -> None:
    """Dynamo lists ``torch.device`` among its constant types when it is imported: imported
    under transfer, it would list the stand-in, and every ``tensor.device`` in a compiled
    function would break the graph. The real type joins the list."""
    utils.common_constant_types.add(_RealDevice)


def _reduce_device(d: Any) -> tuple[Any, tuple[Any, ...]]:
    # pickle finds ``torch.device`` by name; it must resolve to the callable we return.
    return (torch.device, (d.type,) if d.index is None else (d.type, d.index))


# ---- torch.cuda forwarding ---------------------------------------------------------
_CUDA_ALIASES = {"memory_cached": "memory_reserved", "max_memory_cached": "max_memory_reserved"}
_CUDA_CONSTANTS: dict[str, Callable[[], Any]] = {
    "is_current_stream_capturing": lambda: False,
    "get_arch_list": list,
    "get_gencode_flags": str,
    "get_sync_debug_mode": lambda: 0,
    "is_tf32_supported": lambda: False,
    "can_device_access_peer": lambda *a, **k: True,
    "set_sync_debug_mode": lambda *a, **k: None,
}
_CUDA_UNSUPPORTED = {
    "CUDAGraph": "CUDA graphs cannot be captured", "graph": "CUDA graphs cannot be captured",
    "make_graphed_callables": "CUDA graphs cannot be captured",
    "graph_pool_handle": "CUDA graphs cannot be captured",
    "CUDAPluggableAllocator": "the device uses torchport's allocator",
    "change_current_allocator": "the device uses torchport's allocator",
    "MemPool": "memory pools are CUDA-specific", "use_mem_pool": "memory pools are CUDA-specific",
    "ExternalStream": "external CUDA streams do not exist on the device",
    "get_stream_from_external": "external CUDA streams do not exist on the device",
    "cudart": "there is no CUDA runtime", "current_blas_handle": "there is no cuBLAS",
    "current_solver_handle": "there is no cuSOLVER", "GreenContext": "CUDA-specific",
    "caching_allocator_alloc": "CUDA-specific", "caching_allocator_delete": "CUDA-specific",
}
_NVTX = ("range_push", "range_pop", "range_start", "range_end", "mark", "range")
# torch.cuda's submodules: names torch.cuda re-exports get torch.cuda's stand-in (the same
# object); these rules cover the rest. amp, jiterator and nvtx have their own patches.
_CUDA_SUBMODULES_DONE = ("amp", "jiterator", "nvtx")
_CUDA_SUB_CONSTANTS: dict[str, Callable[..., Any]] = {
    "nccl.is_available": lambda *a, **k: False,
    "tunable.is_enabled": lambda: False, "tunable.tuning_is_enabled": lambda: False,
    "tunable.record_untuned_is_enabled": lambda: False,
}
_PROFILER_NOOP = "there is no CUDA profiler on this device; start/stop are no-ops"
_TUNABLE_NOOP = "TunableOp does not exist on this device; its settings are ignored"
_CUDA_SUB_NOOPS = {  # profiling and tuning hints, which do not change results: one warning
    "profiler.start": _PROFILER_NOOP, "profiler.stop": _PROFILER_NOOP,
    **{f"tunable.{n}": _TUNABLE_NOOP for n in (
        "enable", "tuning_enable", "record_untuned_enable", "set_filename",
        "set_max_tuning_duration", "set_max_tuning_iterations", "set_rotating_buffer_size",
        "set_numerical_check_tolerances")},
}
_CUDA_SUB_KEEP = ("profiler.profile",)  # calls the module's start/stop, patched above
_CUDA_SUB_UNSUPPORTED = {
    "gds": "GPUDirect Storage is CUDA-specific",
    "nccl": "NCCL is CUDA's; use torch.distributed, whose 'nccl' backend maps to the device's",
    "tunable": "TunableOp tunes CUDA GEMMs",
    "graphs": "CUDA graphs cannot be captured",
}


class _ForwardMeta(type):
    """A ``torch.cuda`` class stand-in that builds (and isinstance-checks) the device's."""

    _fwd_name: str

    def _target(cls) -> type:
        mod = _S.backend.device_module if _S.backend is not None else None
        t = getattr(mod, cls._fwd_name, None)
        if t is None:
            raise TransferError(
                f"torch.cuda.{cls._fwd_name} has no equivalent on the {_name()!r} device "
                f"(torch.{_name()}.{cls._fwd_name} is missing; is its torchport layer installed?)")
        return t

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = _map_args(args, kwargs)
        return cls._target()(*args, **kwargs)

    def __instancecheck__(cls, obj: Any) -> bool:
        try:
            return isinstance(obj, cls._target())
        except TransferError:
            return False

    def __subclasscheck__(cls, sub: type) -> bool:
        try:
            return issubclass(sub, cls._target())
        except TransferError:
            return False


def _forward_function(name: str, original: Any) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        mod = _S.backend.device_module if _S.backend is not None else None
        fn = getattr(mod, _CUDA_ALIASES.get(name, name), None)
        if fn is None:
            raise TransferError(
                f"torch.cuda.{name} has no equivalent on the {_name()!r} device "
                f"(torch.{_name()}.{name} is missing)")
        args, kwargs = _map_args(args, kwargs)
        return fn(*args, **kwargs)

    functools.update_wrapper(forward, original)
    return forward


def _forward_class(name: str, original: type) -> type:
    return _ForwardMeta(name, (), {"_fwd_name": name, "__module__": "torch.cuda",
                                   "__doc__": original.__doc__})


def _patch_cuda(patch: Callable[[Any, str, Any], None]) -> None:
    cuda = torch.cuda
    replaced: dict[int, Any] = {}  # id(original) -> stand-in, for the submodules' copies

    def patch_cuda(mod: Any, name: str, value: Any) -> None:
        old = getattr(mod, name, None)
        if old is not None:
            replaced[id(old)] = value
        patch(mod, name, value)

    for name in dir(cuda):
        if name.startswith("__") or name in _CUDA_CONSTANTS or name in _CUDA_UNSUPPORTED:
            continue
        obj = getattr(cuda, name)
        if isinstance(obj, types.ModuleType) or not callable(obj):
            continue
        if name.startswith("_") and name not in ("_lazy_init", "_is_in_bad_fork"):
            continue
        if not getattr(obj, "__module__", "").startswith("torch.cuda"):
            continue  # typing helpers, functools, ...
        if isinstance(obj, type):
            if issubclass(obj, BaseException) or name.endswith(("Tensor", "Storage")):
                continue  # ``except torch.cuda.OutOfMemoryError`` needs the real class
            patch_cuda(cuda, name, _forward_class(name, obj))
        else:
            patch_cuda(cuda, name, _forward_function(name, obj))
    for name, fn in _CUDA_CONSTANTS.items():
        patch_cuda(cuda, name, fn)
    for name, why in _CUDA_UNSUPPORTED.items():
        if hasattr(cuda, name):
            obj = getattr(cuda, name)
            patch_cuda(cuda, name, _unsupported_class(f"torch.cuda.{name}", why, obj)
                       if isinstance(obj, type) else _unsupported(f"torch.cuda.{name}", why, obj))
    _patch_cuda_submodules(patch, replaced)
    if _S.backend is not None:
        patch(cuda, "default_generators", _S.backend.default_generators)

    import torch.cuda.jiterator as jit
    import torch.cuda.nvtx as nvtx

    for name in ("_create_jit_fn", "_create_multi_output_jit_fn"):
        patch(jit, name, _unsupported(f"torch.cuda.jiterator.{name}",
                                      "jiterator compiles CUDA C++ at runtime"))
    for name in _NVTX:
        if hasattr(nvtx, name):
            patch(nvtx, name, _nvtx_noop(name))


def _cuda_submodules() -> list[tuple[str, types.ModuleType]]:
    """torch.cuda's public submodules (imported: a script may import them after enable)."""
    import importlib
    import pkgutil

    out = []
    for info in pkgutil.iter_modules(torch.cuda.__path__):
        if info.name.startswith("_") or info.name in _CUDA_SUBMODULES_DONE:
            continue
        try:
            out.append((info.name, importlib.import_module(f"torch.cuda.{info.name}")))
        except Exception:  # a submodule this build cannot import is not patched
            continue
    return out


def _patch_cuda_submodules(patch: Callable[[Any, str, Any], None],
                           replaced: dict[int, Any]) -> None:
    """``torch.cuda.random.get_rng_state``, ``torch.cuda.streams.Stream``, ...: the same rules
    as ``torch.cuda.*``, so ``from torch.cuda.memory import mem_get_info`` forwards too."""
    for sub, mod in _cuda_submodules():
        for name in dir(mod):
            if name.startswith("_"):
                continue
            obj = getattr(mod, name)
            if isinstance(obj, types.ModuleType) or not callable(obj) \
                    or not getattr(obj, "__module__", "").startswith("torch.cuda"):
                continue
            api, key = f"torch.cuda.{sub}.{name}", f"{sub}.{name}"
            if id(obj) in replaced:
                patch(mod, name, replaced[id(obj)])
            elif key in _CUDA_SUB_KEEP or isinstance(obj, type) and (
                    issubclass(obj, BaseException) or name.endswith(("Tensor", "Storage"))):
                continue
            elif key in _CUDA_SUB_CONSTANTS:
                patch(mod, name, _CUDA_SUB_CONSTANTS[key])
            elif key in _CUDA_SUB_NOOPS:
                patch(mod, name, _noop(f"torch.cuda.{sub}", name, _CUDA_SUB_NOOPS[key]))
            elif sub in _CUDA_SUB_UNSUPPORTED:
                why = _CUDA_SUB_UNSUPPORTED[sub]
                patch(mod, name, _unsupported_class(api, why, obj) if isinstance(obj, type)
                      else _unsupported(api, why, obj))
            else:
                patch(mod, name, _forward_class(name, obj) if isinstance(obj, type)
                      else _forward_function(name, obj))


def _noop(api: str, name: str, message: str) -> Callable[..., Any]:
    def noop(*args: Any, **kwargs: Any) -> None:
        _warn_once(api, message)

    noop.__name__ = name
    return noop


def _nvtx_noop(name: str) -> Callable[..., Any]:
    def noop(*args: Any, **kwargs: Any) -> Any:
        _warn_once("torch.cuda.nvtx", "NVTX ranges and marks are no-ops on this device")
        return contextlib.nullcontext() if name == "range" else 0

    noop.__name__ = name
    return noop


# ---- amp -----------------------------------------------------------------------------
def _amp_works() -> bool:
    """Whether autocast runs on the device (the amp layer may not be installed)."""
    if _S.amp_ok is None:
        try:
            a = torch.ones(2, 2, device=_name())
            with _RealAutocast(_name()):
                torch.mm(a, a)
            _S.amp_ok = True
        except Exception:
            _S.amp_ok = False
    return _S.amp_ok


_RealAutocast: type = torch.amp.autocast_mode.autocast
_RealScaler: type = torch.amp.grad_scaler.GradScaler


class _Autocast(_RealAutocast):  # type: ignore[misc, valid-type]
    """``torch.autocast`` with ``"cuda"`` mapped; disabled (one warning) without amp support."""

    def __init__(self, device_type: str, dtype: torch.dtype | None = None, enabled: bool = True,
                 cache_enabled: bool | None = None) -> None:
        device_type = _map_type(device_type)
        if device_type == _name() and enabled and not _amp_works():
            _warn_once("torch.autocast", f"autocast is not supported by the {_name()!r} device; "
                       "running in full precision")
            enabled = False
        super().__init__(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)


class _CudaAmpAutocast(_Autocast):
    """``torch.cuda.amp.autocast(enabled, dtype, cache_enabled)`` on the device."""

    def __init__(self, enabled: bool = True, dtype: torch.dtype = torch.float16,
                 cache_enabled: bool = True) -> None:
        super().__init__("cuda", dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)


class _GradScaler(_RealScaler):  # type: ignore[misc, valid-type]
    """``torch.amp.GradScaler`` whose default/``"cuda"`` device is the device."""

    def __init__(self, device: str = "cuda", *args: Any, **kwargs: Any) -> None:
        super().__init__(_map_type(device), *args, **kwargs)


class _CudaAmpGradScaler(_RealScaler):  # type: ignore[misc, valid-type]
    """``torch.cuda.amp.GradScaler(init_scale, ...)`` on the device."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(_name(), *args, **kwargs)


def _amp_custom(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if "device_type" in kwargs:
            kwargs["device_type"] = _map_type(kwargs["device_type"])
        return fn(*args, **kwargs)

    return wrapper


def _type_arg(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.is_autocast_enabled("cuda")`` & co.; no argument meant CUDA."""

    @functools.wraps(fn)
    def wrapper(device_type: Any = _MISSING, *args: Any) -> Any:
        return fn(_name() if device_type is _MISSING else _map_type(device_type), *args)

    return wrapper


# ---- tensors & modules -------------------------------------------------------------
def _tensor_cuda(self: torch.Tensor, device: Any = None, non_blocking: bool = False,
                 memory_format: torch.memory_format = torch.preserve_format) -> torch.Tensor:
    b = _S.backend
    assert b is not None
    if device is None:
        target = _RealDevice(b.name, b.current_device())
    elif isinstance(device, int):
        target = _RealDevice(b.name, device)
    else:
        target = map_device(device)
    return torch._C.TensorBase.to(self, target, non_blocking=non_blocking,
                                  memory_format=memory_format)


def _is_cuda(self: torch.Tensor) -> bool:
    # Scripts see device tensors as CUDA tensors; torch's own code keeps the truth, since
    # it uses ``is_cuda`` to pick CUDA-only kernels (cuDNN RNN weights, ...).
    if torch._C.TensorBase.is_cuda.__get__(self):
        return True
    caller = sys._getframe(1).f_globals.get("__name__", "")
    if caller == "torch" or caller.startswith("torch."):
        return False
    return self.device.type == _S.backend.name if _S.backend is not None else False


def _pin_memory(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def pin_memory(self: Any, device: Any = None) -> Any:
        # Pinned host memory is a speed hint; a backend without a pinned allocator copies
        # from pageable memory, so an unpinned tensor is a correct answer.
        if _S.pin_ok:
            try:
                return orig(self) if device is None else orig(self, map_device(device))
            except RuntimeError:
                _S.pin_ok = False
        return self

    return pin_memory


def _is_pinned(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def is_pinned(self: Any, device: Any = None) -> bool:
        try:
            return bool(orig(self) if device is None else orig(self, map_device(device)))
        except RuntimeError:
            return False

    return is_pinned


# ---- distributed -------------------------------------------------------------------
def _map_pg_backend(backend: Any) -> Any:
    """``"nccl"`` (and ``"cuda:nccl,cpu:gloo"``) -> the device's collective backend."""
    if not isinstance(backend, str) or "nccl" not in backend.lower():
        return backend
    import torch.distributed as dist

    ccl = f"{_name()}ccl"
    if ccl not in dist.Backend.backend_list:
        raise TransferError(
            f"init_process_group(backend={backend!r}): NCCL has no equivalent on the "
            f"{_name()!r} device (no {ccl!r} collective backend is registered)")
    out = re.sub(r"\bnccl\b", ccl, backend, flags=re.IGNORECASE)
    return re.sub(r"\bcuda:", f"{_name()}:", out)


def _pg_backend_arg(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if "backend" in kwargs:
            kwargs["backend"] = _map_pg_backend(kwargs["backend"])
        elif args and fn.__name__ == "init_process_group":
            args = (_map_pg_backend(args[0]), *args[1:])
        return fn(*args, **kwargs)

    return wrapper


# ---- serialization -----------------------------------------------------------------
def _cuda_tag(storage: Any) -> None:
    return None  # device storages keep their own tag (e.g. "sim:0")


def _cuda_restore(storage: Any, location: str) -> Any:
    if isinstance(location, str) and _CUDA_RE.match(location):
        return storage.to(device=_RealDevice(_map_str(location)))
    return None


# ---- C++ extensions ------------------------------------------------------------------
def _extension_guard(fn: Callable[..., Any], api: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        sources = kwargs.get("sources", args[1] if len(args) > 1 else [])
        sources = [sources] if isinstance(sources, str) else list(sources or [])
        if kwargs.get("with_cuda") or kwargs.get("cuda_sources") \
                or any(str(s).endswith((".cu", ".cuh")) for s in sources):
            raise TransferError(f"{api}: custom CUDA extensions cannot run on the {_name()!r} "
                                f"device; port the kernels to a torchport backend")
        return fn(*args, **kwargs)

    return wrapper


# ---- enable / disable ----------------------------------------------------------------
def _factory_names() -> list[str]:
    """``torch.*`` functions whose ATen schema has a ``device`` argument."""
    names: set[str] = {"asarray"}
    for schema in torch._C._jit_get_all_schemas():
        if schema.name.startswith("aten::") and any(a.name == "device" for a in schema.arguments):
            names.add(schema.name[6:])
    return sorted(n for n in names if not n.startswith("_") and n != "Generator"
                  and callable(getattr(torch, n, None)))


def _patch(obj: Any, name: str, value: Any) -> None:
    old = vars(obj).get(name, _MISSING) if isinstance(obj, type | types.ModuleType) else _MISSING
    if isinstance(obj, type):
        type.__setattr__(obj, name, value)
    else:
        setattr(obj, name, value)
    _S.patches.append((obj, name, old))


def is_enabled() -> bool:
    """Whether CUDA APIs are currently transferred to the device."""
    return _S.backend is not None


def enable(backend: Backend | None = None) -> None:
    """Transfer CUDA APIs to ``backend`` (default: the registered one); idempotent."""
    if _S.backend is not None:
        return
    b = backend if backend is not None else _backend_mod.active_backend()
    _S.backend = b
    try:
        _install(b)
    except Exception:
        disable()
        raise


def _install(b: Backend) -> None:
    p = _patch
    T = torch.Tensor
    # ``with torch.device(...)`` matches factories by identity against a cached set:
    # fill the cache with the real functions before they are wrapped.
    import torch.utils._device as device_ctx

    device_ctx._device_constructors()
    p(torch, "device", _Device)
    p(torch, "Generator", _Generator)
    from torchport.core import lazy

    lazy.when_imported("torch._dynamo.utils", _dynamo_knows_real_devices)
    copyreg.pickle(_RealDevice, _reduce_device)
    for name in _factory_names():
        p(torch, name, _device_kw(getattr(torch, name)))
    for name in ("to", "new_empty", "new_empty_strided", "new_full", "new_ones", "new_zeros",
                 "new_tensor"):
        p(T, name, _device_all(getattr(T, name)))
    p(T, "cuda", _tensor_cuda)
    p(T, "is_cuda", property(_is_cuda))
    p(T, "pin_memory", _pin_memory(torch._C.TensorBase.pin_memory))
    p(T, "is_pinned", _is_pinned(torch._C.TensorBase.is_pinned))
    p(torch.nn.Module, "to", _device_all(torch.nn.Module.to))
    p(torch, "set_default_device", _device_all(torch.set_default_device))

    p(torch, "autocast", _Autocast)
    p(torch.amp, "autocast", _Autocast)
    p(torch.amp, "GradScaler", _GradScaler)
    for name in ("custom_fwd", "custom_bwd"):
        p(torch.amp, name, _amp_custom(getattr(torch.amp, name)))
    for name in ("is_autocast_enabled", "get_autocast_dtype"):
        p(torch, name, _type_arg(getattr(torch, name)))
    if hasattr(torch, "get_autocast_gpu_dtype"):
        p(torch, "get_autocast_gpu_dtype", lambda: torch.get_autocast_dtype(_name()))
    import torch.cuda.amp as cuda_amp

    p(cuda_amp, "autocast", _CudaAmpAutocast)
    p(cuda_amp, "GradScaler", _CudaAmpGradScaler)
    p(cuda_amp, "custom_fwd", functools.partial(torch.amp.custom_fwd, device_type=b.name))
    p(cuda_amp, "custom_bwd", functools.partial(torch.amp.custom_bwd, device_type=b.name))
    _patch_cuda(p)

    if torch.distributed.is_available():
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for mod in (dist, c10d):
            for name in ("init_process_group", "new_group"):
                p(mod, name, _pg_backend_arg(getattr(mod, name)))
        p(dist, "is_nccl_available",
          lambda: f"{_name()}ccl" in dist.Backend.backend_list)

    import torch.utils.cpp_extension as cpp

    for name in ("load", "load_inline", "CUDAExtension"):
        fn = getattr(cpp, name)
        p(cpp, name, _unsupported(f"torch.utils.cpp_extension.{name}",
                                  "custom CUDA extensions cannot run on it")
          if name == "CUDAExtension" else _extension_guard(fn, f"torch.utils.cpp_extension.{name}"))

    _S.package = (15, _cuda_tag, _cuda_restore)
    torch.serialization.register_package(*_S.package)


def disable() -> None:
    """Undo every patch, restoring the objects that were there before :func:`enable`."""
    while _S.patches:
        obj, name, old = _S.patches.pop()
        if old is _MISSING:
            if isinstance(obj, type):
                type.__delattr__(obj, name)
            else:
                delattr(obj, name)
        elif isinstance(obj, type):
            type.__setattr__(obj, name, old)
        else:
            setattr(obj, name, old)
    copyreg.dispatch_table.pop(_RealDevice, None)
    if _S.package is not None:
        with contextlib.suppress(ValueError):
            torch.serialization._package_registry.remove(_S.package)
        _S.package = None
    _S.backend = None
    _S.amp_ok = None
    _S.pin_ok = True
    _S.requested = False


def requested() -> bool:
    """Whether transfer waits for a backend to register (imported before any did, not
    disabled since): :mod:`torchport.transfer_env` enables it then."""
    return _S.requested and _S.backend is None


if _backend_mod._ACTIVE is not None:
    enable()
else:
    _S.requested = True
