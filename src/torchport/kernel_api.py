"""What a vendor kernel asks of torchport about a device tensor: where it lives, on which
physical device, and which stream its work goes to.

A kernel receives plain ``torch.Tensor`` objects on the backend's device. To hand them to
the vendor's own library it needs three numbers the tensor does not carry in the
runtime's terms, and this module gives them (``docs/vendor-guide.md``, "Writing a
kernel"):

* :func:`device_address`: the address of the tensor's first element as the runtime knows
  it (what :meth:`Runtime.malloc` returned, plus the storage offset) -- the ``dst``/``src``
  of :meth:`Runtime.copy_h2d` and friends, or a pointer argument of a device kernel.
* :func:`device_index`: the runtime's *physical* device index (``TORCHPORT_VISIBLE_DEVICES``
  applied: ``sim:0`` may be physical device 1), the ``index`` every runtime method takes.
* :func:`current_stream`: the stream handle new work on the tensor's device goes to
  (what :meth:`Runtime.create_stream` returned; ``None`` = the device's default stream),
  as ``torch.<device>.current_stream()`` / ``with torch.<device>.stream(s):`` chose it.

:func:`launch` puts a kernel's device-side work on that stream through
:meth:`Runtime.launch`. :func:`current_backend` is the registered backend, or ``None``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torchport import backend as _backend

__all__ = ["current_backend", "current_stream", "device_address", "device_index", "launch"]


def current_backend() -> _backend.Backend | None:
    """The backend registered in this process, or ``None`` (``active_backend()`` raises)."""
    return _backend._ACTIVE


def _registered(t: torch.Tensor) -> _backend.Backend:
    b = _backend._ACTIVE
    if b is None:
        raise _backend.BackendError("no torchport backend is registered; import torchport.sim "
                                    "(or your vendor backend) first")
    if t.device.type != b.name:
        raise ValueError(f"expected a tensor on the {b.name!r} device, got one on {t.device}; "
                         f"move it with .to({b.name!r}) first")
    return b


def device_address(t: torch.Tensor) -> int:
    """The runtime address of ``t``'s first element (storage offset included); 0 for a
    tensor without elements, which owns no memory."""
    _registered(t)
    return t.data_ptr() if t.numel() else 0


def device_index(t: torch.Tensor) -> int:
    """The runtime's physical index of ``t``'s device (``TORCHPORT_VISIBLE_DEVICES`` applied)."""
    return _registered(t).visible[t.device.index]


def current_stream(t: torch.Tensor) -> Any:
    """The runtime stream handle that work on ``t``'s device goes to now (``None``: the
    device's default stream)."""
    return _registered(t).current_stream_handle(t.device.index)


def launch(t: torch.Tensor, fn: Callable[[], Any], name: str = "") -> None:
    """Run ``fn`` (device-side work touching ``t``'s device) in order on its current stream:
    ``Runtime.launch(device_index(t), current_stream(t), fn, name)``."""
    b = _registered(t)
    index = t.device.index
    b.runtime.launch(b.visible[index], b.current_stream_handle(index), fn, name)
