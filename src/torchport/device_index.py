"""A device name without an index (``"sim"``, ``torch.device("sim")``) means the current
device, as ``"cuda"`` does after ``torch.cuda.set_device(1)``.

Factories (``torch.empty``, ``torch.randn``...) hand the name to the backend's kernels,
which resolve it. A few APIs resolve it in C++ instead, through the device guard, whose
Python version answers 0 (PyTorch 2.13, ``torch/csrc/acc/Module.cpp``): ``Tensor.to``
(so ``Module.to``), ``Tensor.new_tensor``, ``torch.tensor``, ``torch.as_tensor``,
``torch.asarray``. Those are wrapped here to name the current index first. While it is
0 the wrappers pass their arguments through untouched.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._device as _device_ctx
from torch.overrides import _get_current_function_mode_stack as _mode_stack

_Device = torch._C.device
_TENSOR_METHODS = ("to", "new_tensor")
_FUNCTIONS = ("tensor", "as_tensor", "asarray")


def _resolver(name: str, current: Callable[[], int]) -> Callable[[Any], Any]:
    def resolve(d: Any) -> Any:
        """``d`` with the current index when it names the device without one."""
        if d == name if isinstance(d, str) else type(d) is _Device and d.type == name \
                and d.index is None:
            return _Device(name, current())
        return d
    return resolve


def _wrap(fn: Callable[..., Any], name: str, current: Callable[[], int],
          default_device: bool) -> Callable[..., Any]:
    """``fn`` with its device arguments (positional or ``device=``) resolved; with
    ``default_device``, also the device a ``with torch.device(...)`` block or
    ``torch.set_default_device`` gives it (PyTorch adds it below this wrapper)."""
    resolve = _resolver(name, current)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if current():
            args = tuple(resolve(a) if isinstance(a, str | _Device) else a for a in args)
            d = kwargs.get("device")
            if d is not None:
                kwargs["device"] = resolve(d)
            elif default_device and torch._C._len_torch_function_stack():
                given = _default_device()
                if given is not None and resolve(given) is not given:
                    kwargs["device"] = resolve(given)
        return fn(*args, **kwargs)

    wrapper.__torchport_original__ = fn  # type: ignore[attr-defined]
    return wrapper


def _default_device() -> Any:
    """The device an active ``torch.device`` block or ``torch.set_default_device`` gives
    factories (a ``DeviceContext`` on the function-mode stack), or ``None``."""
    for mode in reversed(_mode_stack()):
        if isinstance(mode, _device_ctx.DeviceContext):
            return mode.device
    return None


def install(name: str, current: Callable[[], int]) -> None:
    """Wrap the APIs above for device ``name`` whose current index ``current()`` gives."""
    # ``with torch.device(...)`` matches factories by identity against a cached set: fill
    # it with the real functions before they are wrapped.
    _device_ctx._device_constructors()
    T = torch.Tensor
    for attr in _TENSOR_METHODS:
        type.__setattr__(T, attr, _wrap(getattr(T, attr), name, current, False))
    for attr in _FUNCTIONS:
        setattr(torch, attr, _wrap(getattr(torch, attr), name, current, True))
