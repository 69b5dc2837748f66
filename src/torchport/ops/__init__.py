"""The op layer: kernel declarations, path selection, fallback, statistics.

The public names are resolved on first use (PEP 562), so that importing one module
of the layer (``torchport.ops.plan``) does not load the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchport.core.lazy import exports

if TYPE_CHECKING:
    from torchport.ops.fallback import (
        FallbackWarning,
        force_fallback_patterns,
        set_fallback_enabled,
        set_fallback_warn,
        set_force_fallback,
    )
    from torchport.ops.quantized import (
        LOW_BIT_KERNELS,
        QuantizedUnavailableError,
        QuantizerMismatchError,
    )
    from torchport.ops.registry import Decline, KernelDecl, KernelSet, native_overloads
    from torchport.ops.stats import Recorder, record

__all__ = [
    "LOW_BIT_KERNELS", "Decline", "FallbackWarning", "KernelDecl", "KernelSet",
    "QuantizedUnavailableError", "QuantizerMismatchError", "Recorder", "force_fallback_patterns", "native_overloads", "record", "set_fallback_enabled", "set_fallback_warn",
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
    "LOW_BIT_KERNELS": "torchport.ops.quantized",
    "QuantizedUnavailableError": "torchport.ops.quantized",
    "QuantizerMismatchError": "torchport.ops.quantized",
    "Recorder": "torchport.ops.stats", "record": "torchport.ops.stats",
}


__getattr__, __dir__ = exports(__name__, _LAZY, __all__)
