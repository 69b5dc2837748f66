"""torchport: a new accelerator as a first-class PyTorch device, from Python.

A vendor supplies a :class:`~torchport.runtime.Runtime` and kernels
(:mod:`torchport.ops`); torchport supplies tensors, allocator, fallback, the
``torch.<device>`` module and the tools. ``import torchport.sim`` for the
built-in simulated accelerator.
"""

from torchport.backend import Backend, BackendError, active_backend
from torchport.runtime import DeviceProperties, Runtime

__version__ = "0.1.0"
__all__ = ["Backend", "BackendError", "DeviceProperties", "Runtime", "active_backend",
           "__version__"]
