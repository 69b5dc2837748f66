"""The other Python entry points that receive a device or a CUDA-only choice: ``Tensor``
methods (``cuda``, ``is_cuda``, ``pin_memory``), process groups' ``nccl`` backend,
C++ extensions with CUDA sources, and the list of factory functions to wrap."""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable
from typing import Any

import torch

from torchport.transfer.mapping import map_device
from torchport.transfer.state import _S, TransferError, _name, _RealDevice


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
