"""Moved to :mod:`torchport.memory.allocator`; this name stays importable, with a DeprecationWarning."""

from torchport._moved import alias

alias(__name__, "torchport.memory.allocator")
