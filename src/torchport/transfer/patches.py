"""Enabling and disabling transfer: every patch is recorded, so :func:`disable` restores
the exact previous objects; :func:`enable` is idempotent."""

from __future__ import annotations

import contextlib
import copyreg
import functools
import types
from typing import TYPE_CHECKING, Any

import torch

from torchport import backend as _backend_mod
from torchport.transfer.amp import (
    _amp_custom,
    _Autocast,
    _CudaAmpAutocast,
    _CudaAmpGradScaler,
    _GradScaler,
    _type_arg,
)
from torchport.transfer.checkpoints import _cuda_restore, _cuda_tag
from torchport.transfer.cuda_module import _patch_cuda
from torchport.transfer.entry_points import (
    _extension_guard,
    _factory_names,
    _is_cuda,
    _is_pinned,
    _pg_backend_arg,
    _pin_memory,
    _tensor_cuda,
)
from torchport.transfer.mapping import (
    _Device,
    _device_all,
    _device_kw,
    _dynamo_knows_real_devices,
    _Generator,
    _reduce_device,
)
from torchport.transfer.state import _MISSING, _S, _name, _RealDevice, _unsupported

if TYPE_CHECKING:
    from torchport.backend import Backend

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
