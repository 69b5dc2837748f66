"""The reference backend: device ``ref``, a discrete asynchronous accelerator modelled in
Python, shaped like a real vendor's backend and written from docs/vendor-guide.md.

Its memory is device-only (every byte the host sees moves through the runtime's copies),
each stream is a queue run by its own worker thread, and it has only a handful of kernels
of its own, computed by numpy (elementwise arithmetic, matmuls, a sum, fill and copy):
everything else takes torchport's decompositions and CPU fallback. Its runtime can fail
on purpose (``runtime.faults``, :class:`Faults`), so tests can check how torchport reports
a device's failures. Importing this package registers the device::

    python -m torchport.tools.conformance --backend torchport.backends.reference --subset
"""

from __future__ import annotations

from torchport.backend import Backend
from torchport.backends.reference.kernels import make_kernels
from torchport.backends.reference.runtime import Faults, RefDeviceError, RefRuntime
from torchport.kernel_api import current_backend

__all__ = ["BACKEND", "Faults", "RefDeviceError", "RefRuntime", "make_backend", "runtime"]


def make_backend(rt: RefRuntime | None = None) -> Backend:
    """The ``ref`` backend (not yet registered) over ``rt`` (default: two devices)."""
    rt = RefRuntime() if rt is None else rt
    return Backend("ref", rt, [make_kernels(rt)])


_active = current_backend()
BACKEND = _active if _active is not None and _active.name == "ref" else make_backend().register()
runtime: RefRuntime = BACKEND.runtime  # type: ignore[assignment]
