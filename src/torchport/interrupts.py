"""Moved to :mod:`torchport.core.interrupts`; this name stays importable, with a DeprecationWarning."""

from torchport._moved import alias

alias(__name__, "torchport.core.interrupts")
