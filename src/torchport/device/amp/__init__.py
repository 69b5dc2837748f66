"""Mixed precision for torchport devices: autocast, GradScaler and Apex-style AMP.

As a backend registers (a feature module, see :mod:`torchport.features`), this registers
CUDA's autocast policy for the backend's autocast key (:mod:`torchport.device.amp.policy`)
and adds ``torch.<device>.amp`` with ``autocast``, ``GradScaler``, ``custom_fwd``
and ``custom_bwd``. ``torch.autocast(device_type="<device>")`` and
``torch.amp.GradScaler("<device>")`` work as well; the dtypes autocast accepts are
``torch.<device>.get_amp_supported_dtype()`` (what the runtime supports).

:func:`initialize` / :func:`scale_loss` give NVIDIA Apex's ``amp`` API (O1, O2).
"""

from __future__ import annotations

import functools
import sys
import types
from typing import TYPE_CHECKING

import torch

from torchport.device import device_module
from torchport.device.amp import policy
from torchport.device.amp.apex import initialize, scale_loss

if TYPE_CHECKING:
    from torchport.core.contracts import DeviceBackend

__all__ = ["initialize", "make_amp_module", "policy", "scale_loss"]


def make_amp_module(mod: types.ModuleType, b: DeviceBackend) -> types.ModuleType:
    """Build ``torch.<device>.amp`` (the analogue of ``torch.cuda.amp``) for backend ``b``."""
    name = b.name
    amp = types.ModuleType(f"{mod.__name__}.amp", f"torch.{name}.amp: mixed precision on {name}.")

    class autocast(torch.amp.autocast):
        """``torch.autocast(device_type="<device>", ...)`` with the device fixed."""

        def __init__(self, enabled: bool = True, dtype: torch.dtype = torch.float16,
                     cache_enabled: bool = True) -> None:
            super().__init__(name, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

    class GradScaler(torch.amp.GradScaler):
        """``torch.amp.GradScaler("<device>", ...)`` with the device fixed."""

        def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                     backoff_factor: float = 0.5, growth_interval: int = 2000,
                     enabled: bool = True) -> None:
            super().__init__(name, init_scale=init_scale, growth_factor=growth_factor,
                             backoff_factor=backoff_factor, growth_interval=growth_interval,
                             enabled=enabled)

    autocast.__qualname__ = autocast.__name__ = "autocast"
    GradScaler.__qualname__ = GradScaler.__name__ = "GradScaler"
    amp.autocast = autocast
    amp.GradScaler = GradScaler
    amp.custom_fwd = functools.partial(torch.amp.custom_fwd, device_type=name)
    amp.custom_bwd = functools.partial(torch.amp.custom_bwd, device_type=name)
    amp.registered_ops = policy.install(b)
    amp.policy_table = policy.policy_table
    return amp


def on_register(backend: DeviceBackend, module: types.ModuleType) -> None:
    """Add ``torch.<device>.amp`` as ``backend`` registers (:mod:`torchport.features`)."""
    amp = make_amp_module(module, backend)
    device_module.add(module, amp=amp)
    sys.modules[amp.__name__] = amp


