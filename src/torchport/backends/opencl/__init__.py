"""The OpenCL backend: device ``ocl`` over pyopencl, a real device with memory the host
cannot read (the worked example of a discrete-memory device in docs/vendor-guide.md).

Importing this package registers it (``import torchport.opencl`` does the same), so that
``--backend opencl`` / ``torchport run -b opencl`` take it. Every OpenCL device of one
platform is a device (``TORCHPORT_OPENCL_PLATFORM``, ``TORCHPORT_OPENCL_DEVICES``): PoCL
on a CPU, a GPU's OpenCL driver where there is one.

Finding the driver needs no set-up: pyopencl's wheels bundle the ocl-icd loader, and
``import pyopencl`` sets ``PYOPENCL_HOME`` so that the loader reads the drivers (ICDs) shipped
in ``pyopencl/.libs`` -- where the ``pocl-binary-distribution`` wheel (the ``opencl`` extra:
``pip install 'torchport[opencl]'``) installs ``pocl.icd`` and PoCL -- besides those listed
in ``/etc/OpenCL/vendors`` (a GPU driver's; ocl-icd's ``OCL_ICD_VENDORS`` names another
folder instead). PoCL keeps compiled kernels in ``POCL_CACHE_DIR``, set here (when unset)
under torchport's cache folder; pyopencl keeps built programs in its own cache.
"""

from __future__ import annotations

import os

from torchport import backend as _backend
from torchport.core import settings
from torchport.core.contracts import BackendError

__all__ = ["BACKEND", "OpenCLUnavailable", "make_backend", "runtime"]


class OpenCLUnavailable(BackendError, ImportError):
    """No OpenCL device to register (pyopencl or a driver missing, or none selected)."""


def _prepare_environment() -> None:
    base = settings.get("TORCHPORT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "torchport")
    os.environ.setdefault("POCL_CACHE_DIR", os.path.join(base, "pocl"))


_prepare_environment()
try:
    import pyopencl  # noqa: F401
except ImportError as e:
    raise OpenCLUnavailable(
        "torchport.opencl needs pyopencl and an OpenCL driver: pip install 'torchport[opencl]' "
        "(pyopencl and PoCL, a CPU driver) or install your GPU's OpenCL driver") from e

from torchport.backends.opencl import graph  # noqa: E402
from torchport.backends.opencl.kernels import make_kernels  # noqa: E402
from torchport.backends.opencl.runtime import OpenCLRuntime  # noqa: E402


def make_backend(rt: OpenCLRuntime | None = None) -> _backend.Backend:
    """The ``ocl`` backend (not yet registered) over ``rt`` (default: the selected devices)."""
    rt = OpenCLRuntime() if rt is None else rt
    if rt.device_count() == 0:
        raise OpenCLUnavailable(
            "ocl: no OpenCL device found (TORCHPORT_OPENCL_PLATFORM="
            f"{settings.raw('TORCHPORT_OPENCL_PLATFORM', 'unset')}, TORCHPORT_OPENCL_DEVICES="
            f"{settings.raw('TORCHPORT_OPENCL_DEVICES', 'unset')}); install a driver, e.g. "
            "pip install pocl-binary-distribution, or fix the selection")
    made = _backend.Backend("ocl", rt, [make_kernels(rt)])
    graph.enable(made)  # torch.compile: inductor with the backend's OpenCL code generator
    return made


if _backend._ACTIVE is not None and _backend._ACTIVE.name == "ocl":
    BACKEND = _backend._ACTIVE  # re-import or reload: keep the registered one
else:
    BACKEND = make_backend().register()
runtime = BACKEND.runtime
