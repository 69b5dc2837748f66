"""torchport: a new accelerator as a first-class PyTorch device, from Python.

A vendor supplies a :class:`~torchport.runtime.Runtime` and kernels
(:mod:`torchport.ops`); torchport supplies tensors, allocator, fallback, the
``torch.<device>`` module and the tools. ``import torchport.sim`` for the
built-in simulated accelerator. A kernel reaches its tensors' device memory through
:mod:`torchport.kernel_api` (``device_address``, ``device_index``, ``current_stream``,
``launch``), also exported here; ``docs/vendor-guide.md`` is the walkthrough.

The public names are resolved on first use (PEP 562), so that importing one module
(``torchport.core.settings``, ``torchport.ops.plan``) loads only what that module needs,
not registration and the op layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchport.core.lazy import exports

if TYPE_CHECKING:
    from torchport.backend import Backend, BackendError, active_backend
    from torchport.kernel_api import (
        current_backend,
        current_stream,
        device_address,
        device_index,
        launch,
    )
    from torchport.runtime import DeviceProperties, NativeCopies, Runtime

__version__ = "0.1.0"
__all__ = ["Backend", "BackendError", "DeviceProperties", "NativeCopies", "Runtime",
           "active_backend",
           "current_backend", "current_stream", "device_address", "device_index", "launch",
           "__version__"]

# public name -> the module that defines it
_LAZY = {
    "Backend": "torchport.backend", "BackendError": "torchport.backend",
    "active_backend": "torchport.backend",
    "current_backend": "torchport.kernel_api", "current_stream": "torchport.kernel_api",
    "device_address": "torchport.kernel_api", "device_index": "torchport.kernel_api",
    "launch": "torchport.kernel_api",
    "DeviceProperties": "torchport.runtime", "NativeCopies": "torchport.runtime",
    "Runtime": "torchport.runtime",
}


__getattr__, __dir__ = exports(__name__, _LAZY, __all__)
