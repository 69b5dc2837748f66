"""Moved to :mod:`torchport.device.amp`; this old path is an alias of it (and of its submodules)."""

from torchport._moved import alias_package

alias_package(__name__, "torchport.device.amp")
