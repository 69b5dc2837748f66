"""The mapping rules (``"cuda"``, ``"cuda:N"`` and CUDA ``torch.device`` objects to the
device), the wrappers that apply them to a function's arguments, and the stand-ins for
``torch.device`` and ``torch.Generator``."""

from __future__ import annotations

import functools
import re
import types
from collections.abc import Callable
from typing import Any

import torch

from torchport.transfer.state import _name, _RealDevice, _RealGenerator

_CUDA_RE = re.compile(r"^cuda(?::(\d+))?$")


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
