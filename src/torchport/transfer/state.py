"""What transfer holds while enabled (the backend, the patches made, one-time warnings),
its error, and the stand-ins for CUDA APIs that have no equivalent on the device."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torchport.backend import Backend

_RealDevice: type = torch._C.device
_RealGenerator: type = torch._C.Generator
_MISSING = object()


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


def _name() -> str:
    if _S.backend is None:
        raise TransferError("torchport.transfer is not enabled")
    return _S.backend.name


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
