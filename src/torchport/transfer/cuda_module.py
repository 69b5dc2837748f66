"""``torch.cuda`` and its submodules forwarded, at call time, to ``torch.<device>``: what has
no equivalent raises :class:`~torchport.transfer.state.TransferError` or warns once."""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable
from typing import Any

import torch

from torchport.transfer.mapping import _map_args
from torchport.transfer.state import (
    _S,
    TransferError,
    _name,
    _unsupported,
    _unsupported_class,
    _warn_once,
)

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
