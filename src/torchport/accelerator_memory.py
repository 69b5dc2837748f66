"""Moved to :mod:`torchport.device.accelerator_memory`; this name stays importable, with a DeprecationWarning."""

from torchport._moved import alias

alias(__name__, "torchport.device.accelerator_memory")
