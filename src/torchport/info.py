"""Moved to :mod:`torchport.tools.info`; this name stays importable, with a DeprecationWarning."""

from torchport._moved import alias

alias(__name__, "torchport.tools.info")
