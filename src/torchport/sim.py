"""``import torchport.sim`` registers the sim device and ``torch.sim``."""

from torchport import backend as _backend
from torchport.backends.sim import SimRuntime, make_backend

__all__ = ["BACKEND", "SimRuntime", "runtime"]

if _backend._ACTIVE is not None and _backend._ACTIVE.name == "sim":
    BACKEND = _backend._ACTIVE  # re-import or reload: keep the registered one
else:
    with _backend.collector_paused():
        BACKEND = make_backend().register()
runtime = BACKEND.runtime
