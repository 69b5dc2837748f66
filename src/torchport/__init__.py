"""torchport: a new accelerator as a first-class PyTorch device, from Python.

A vendor supplies a :class:`~torchport.runtime.Runtime` and kernels
(:mod:`torchport.ops`); torchport supplies tensors, allocator, fallback, the
``torch.<device>`` module and the tools. ``import torchport.sim`` for the
built-in simulated accelerator. A kernel reaches its tensors' device memory through
:mod:`torchport.kernel_api` (``device_address``, ``device_index``, ``current_stream``,
``launch``), also exported here; ``docs/vendor-guide.md`` is the walkthrough.
"""

from torchport.backend import Backend, BackendError, active_backend
from torchport.kernel_api import (
    current_backend,
    current_stream,
    device_address,
    device_index,
    launch,
)
from torchport.runtime import DeviceProperties, Runtime

__version__ = "0.1.0"
__all__ = ["Backend", "BackendError", "DeviceProperties", "Runtime", "active_backend",
           "current_backend", "current_stream", "device_address", "device_index", "launch",
           "__version__"]
