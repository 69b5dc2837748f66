"""Moved to :mod:`torchport.device.tensor_types`; this name stays importable, with a DeprecationWarning."""

from torchport._moved import alias

alias(__name__, "torchport.device.tensor_types")
