"""The op layer: kernel declarations, path selection, fallback, statistics."""

from torchport.ops.registry import Decline, KernelDecl, KernelSet, native_overloads

__all__ = ["Decline", "KernelDecl", "KernelSet", "native_overloads"]
