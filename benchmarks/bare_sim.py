"""Device ``bare``: the sim's runtime with no kernels of its own, so that every op takes
torchport's decompositions or its CPU fallback, as on a vendor's device before its kernels
exist. Host-addressable, synchronous memory, where the fallback's warm calls are served
from C++ (``TORCHPORT_SIM_STRICT=1`` makes it device-only). Importing it registers the
device: ``python benchmarks/models.py -b bare_sim``."""

from __future__ import annotations

from torchport.backend import Backend
from torchport.backends.sim import SimRuntime

BACKEND = Backend("bare", SimRuntime(), []).register()
