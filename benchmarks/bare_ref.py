"""Device ``bareref``: the reference backend's runtime (device-only numpy memory, a Python
worker thread per stream) with no kernels of its own, so that every op takes torchport's
decompositions or its CPU fallback through the runtime's copies, as a vendor's device before
its kernels exist. Against ``-b reference`` (the same runtime with its numpy kernels) it
separates torchport's share of a step from the kernels'. Importing it registers the device:
``python benchmarks/models.py -b bare_ref``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torchport.backends
from torchport.backend import Backend

# The runtime's module alone: importing the package would register the ``ref`` device.
_PATH = Path(torchport.backends.__file__).parent / "reference" / "runtime.py"
_spec = importlib.util.spec_from_file_location("bare_ref_runtime", _PATH)
assert _spec is not None and _spec.loader is not None
runtime_module = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = runtime_module  # (dataclasses look their module up)
_spec.loader.exec_module(runtime_module)

BACKEND = Backend("bareref", runtime_module.RefRuntime(), []).register()
