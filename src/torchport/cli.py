"""Moved to :mod:`torchport.tools.cli`; this name stays importable, with a DeprecationWarning."""

from torchport._moved import alias

alias(__name__, "torchport.tools.cli")
