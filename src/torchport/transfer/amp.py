"""Autocast and GradScaler with ``"cuda"`` mapped to the device (``torch.autocast``,
``torch.amp``, ``torch.cuda.amp``); autocast is off, with one warning, where the device
has no autocast support."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from torchport.transfer.mapping import _map_type
from torchport.transfer.state import _MISSING, _S, _name, _warn_once


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
