"""Moved to :mod:`torchport.device.forking`; this name stays importable, with a DeprecationWarning."""

from torchport._moved import alias

alias(__name__, "torchport.device.forking")
