"""``import torchport.sim`` registers the sim device and ``torch.sim``."""

from torchport.core.collector import collector_paused

with collector_paused():  # (the modules, the backend and its kernels: all live until exit)
    from torchport import backend as _backend
    from torchport.backends.sim import SimRuntime, make_backend

    if _backend._ACTIVE is not None and _backend._ACTIVE.name == "sim":
        BACKEND = _backend._ACTIVE  # re-import or reload: keep the registered one
    else:
        BACKEND = make_backend().register()

__all__ = ["BACKEND", "SimRuntime", "runtime"]

runtime = BACKEND.runtime
