"""The op layer: kernel declarations, path selection, fallback, statistics.

The public names are resolved on first use (PEP 562), so that importing one module
of the layer (``torchport.ops.plan``) does not load the others.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torchport.ops.fallback import (
        FallbackWarning,
        force_fallback_patterns,
        set_fallback_enabled,
        set_fallback_warn,
        set_force_fallback,
    )
    from torchport.ops.registry import Decline, KernelDecl, KernelSet, native_overloads
    from torchport.ops.stats import Recorder, record

__all__ = [
    "Decline", "FallbackWarning", "KernelDecl", "KernelSet", "Recorder", "force_fallback_patterns",
    "native_overloads", "record", "set_fallback_enabled", "set_fallback_warn",
    "set_force_fallback",
]

# public name -> the module that defines it
_LAZY = {
    "FallbackWarning": "torchport.ops.fallback",
    "force_fallback_patterns": "torchport.ops.fallback",
    "set_fallback_enabled": "torchport.ops.fallback",
    "set_fallback_warn": "torchport.ops.fallback",
    "set_force_fallback": "torchport.ops.fallback",
    "Decline": "torchport.ops.registry", "KernelDecl": "torchport.ops.registry",
    "KernelSet": "torchport.ops.registry", "native_overloads": "torchport.ops.registry",
    "Recorder": "torchport.ops.stats", "record": "torchport.ops.stats",
}


def __getattr__(name: str) -> Any:
    """Import the module defining public ``name`` on first use, and keep the value."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
