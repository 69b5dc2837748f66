"""The feature layers installed on a backend as it registers, in this order.

Each module named here defines ``on_register(backend, module)``: it installs the
feature for ``backend`` and adds its names to the device ``module`` with
:func:`torchport.device.device_module.add`. :meth:`torchport.backend.Backend.register` calls
:func:`install` right after making the device module, before PyTorch's PrivateUse1
set-up. Importing a feature module changes no device module and registers nothing.
The modules are named, not imported: ``transfer_env`` and ``tools.debug.env`` are tools
above registration (the one reach the layer contract does not see).
Append-only: one line per layer; a later layer may use an earlier one's names
(``parallel_comm`` uses the streams').
"""

from __future__ import annotations

import importlib
import types
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchport.core.contracts import DeviceBackend

FEATURE_MODULES: list[str] = [
    "torchport.memory.storage",
    "torchport.device.streams",
    "torchport.distributed",
    "torchport.device.amp",
    "torchport.transfer_env",
    "torchport.device.sharing",
    "torchport.distributed.parallel_comm",
    "torchport.integrations.huggingface",
    "torchport.integrations.lightning",
    "torchport.tools.debug.env",
    "torchport.graph.inductor",
]


def install(backend: DeviceBackend, module: types.ModuleType) -> None:
    """Install every feature layer for ``backend`` and its device ``module``, in order."""
    for name in FEATURE_MODULES:
        importlib.import_module(name).on_register(backend, module)
