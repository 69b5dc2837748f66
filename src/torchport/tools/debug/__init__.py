"""Porting tools: autocompare against CPU, op dumps and their comparison, coverage.

Names are imported lazily so that ``import torchport`` pays nothing for tools that
are off (the op layer checks one flag per call).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "autocompare": "torchport.tools.debug.crosscheck",
    "AutocompareReport": "torchport.tools.debug.crosscheck",
    "Mismatch": "torchport.tools.debug.crosscheck",
    "AutocompareMismatchError": "torchport.tools.debug.crosscheck",
    "dump": "torchport.tools.debug.opdump",
    "compare_dumps": "torchport.tools.debug.compare",
    "compare_modules": "torchport.tools.debug.modules",
    "coverage": "torchport.tools.debug.opcoverage",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'torchport.tools.debug' has no attribute {name!r}")
    return getattr(importlib.import_module(mod), name)
