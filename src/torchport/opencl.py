"""``import torchport.opencl`` registers the OpenCL device ``ocl`` and ``torch.ocl``
(:mod:`torchport.backends.opencl`)."""

from torchport.backends.opencl import BACKEND, OpenCLUnavailable, runtime

__all__ = ["BACKEND", "OpenCLUnavailable", "runtime"]
