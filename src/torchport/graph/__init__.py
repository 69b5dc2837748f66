"""Graph mode on the device: ``torch.compile`` (inductor, or a vendor's graph compiler),
exported programs.

* :func:`enable_inductor` (:mod:`torchport.graph.inductor`): ``torch.compile(model)``
  with its default compiler: inductor's C++ kernels running on device memory, or the
  vendor's own inductor ``Scheduling`` writing the kernels in its language.
* :func:`register_graph_compiler` (:mod:`torchport.graph.compilers`): a vendor's compiler
  receives the forward and backward ATen graphs of ``torch.compile(model,
  backend="<name>")``, whole or only the regions of the ops it supports (the rest runs
  eagerly on the device).
* :mod:`torchport.graph.export`: ``torch.export`` programs work on the device unchanged;
  ``load(f, device=...)`` loads one onto another device than the one it was saved from.

Nothing here is imported with torchport: TorchDynamo costs seconds to import, and a
compiler registers with it only once it is imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from torchport.core.lazy import exports

if TYPE_CHECKING:
    from torchport.graph.compilers import GraphInfo, graph_info, register_graph_compiler
    from torchport.graph.inductor import enable_inductor

__all__ = ["GraphInfo", "enable_inductor", "export", "graph_info", "register_graph_compiler"]

# public name -> the module that defines it
_LAZY = {"GraphInfo": "torchport.graph.compilers", "graph_info": "torchport.graph.compilers",
         "register_graph_compiler": "torchport.graph.compilers",
         "enable_inductor": "torchport.graph.inductor"}
_SUBMODULES = {"export"}  # reached as attributes: torchport.graph.export.load(...)

_names, __dir__ = exports(__name__, _LAZY, __all__)


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    return _names(name)
