"""The sim accelerator: torchport's reference backend.

``import torchport.sim`` registers it (this package only defines it, so a test or
a tool can build a differently configured sim with :func:`make_backend`).
Settings: ``TORCHPORT_SIM_DEVICES`` (default 2), ``TORCHPORT_SIM_MEMORY`` (default
8GiB), ``TORCHPORT_SIM_STRICT=1`` (device-only memory).
"""

from __future__ import annotations

import torch

from torchport.backend import Backend
from torchport.backends.sim.attention import make_attention_kernels
from torchport.backends.sim.kernels import make_kernels, make_low_bit_kernels
from torchport.backends.sim.runtime import SimRuntime, parse_size
from torchport.backends.sim.syncbn_kernels import make_syncbn_kernels
from torchport.graph.inductor import enable_inductor
from torchport.kernel_api import device_address, device_index

__all__ = ["SimRuntime", "make_backend", "parse_size"]


def make_backend(runtime: SimRuntime | None = None) -> Backend:
    """The sim backend (not yet registered) over ``runtime`` (default: from the environment)."""
    rt = runtime if runtime is not None else SimRuntime()

    def device_view(t: torch.Tensor) -> torch.Tensor:
        # The simulated chip reading its own memory: zero-copy in both memory modes,
        # addressed as any vendor kernel addresses it (torchport.kernel_api).
        ptr = device_address(t)
        if ptr == 0:  # no elements: nothing to alias
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
        offset = t.storage_offset()
        # the storage's base address: the runtime caches its segment lookup per block
        typed, off = rt.typed_memory(device_index(t), ptr - offset * t.element_size(), t.dtype)
        return typed.as_strided(t.shape, t.stride(), off + offset)

    backend = Backend("sim", rt, [make_kernels(device_view), make_syncbn_kernels(),
                                  make_attention_kernels(), make_low_bit_kernels(device_view)])
    # torch.compile: inductor's C++ kernels run on the chip's views, as its host ops do
    enable_inductor(backend, codegen="host", views=device_view)
    return backend
