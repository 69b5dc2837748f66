"""The op layer: kernel declarations, path selection, fallback, statistics."""

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
