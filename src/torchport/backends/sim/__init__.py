"""The sim accelerator: torchport's reference backend, importable as ``torchport.sim``.

Importing it registers the ``sim`` device and ``torch.sim``. Settings:
``TORCHPORT_SIM_DEVICES`` (default 2), ``TORCHPORT_SIM_MEMORY`` (default 8GiB),
``TORCHPORT_SIM_STRICT=1`` (device-only memory).
"""

from __future__ import annotations

import torch

from torchport.backend import Backend
from torchport.backends.sim.kernels import make_kernels
from torchport.backends.sim.runtime import SimRuntime, parse_size

__all__ = ["BACKEND", "SimRuntime", "parse_size", "runtime"]


def _make_backend() -> Backend:
    from torchport import backend as _b

    if _b._ACTIVE is not None and _b._ACTIVE.name == "sim":
        return _b._ACTIVE
    rt = SimRuntime()
    holder: dict[str, Backend] = {}

    def device_view(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        n = st.nbytes()
        if n == 0:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
        typed = rt.device_tensor(holder["b"].phys(t.device.index), st.data_ptr(), n).view(t.dtype)
        return typed.as_strided(t.shape, t.stride(), typed.storage_offset() + t.storage_offset())

    b = Backend("sim", rt, [make_kernels(device_view)])
    holder["b"] = b
    return b.register()


BACKEND = _make_backend()
runtime = BACKEND.runtime
