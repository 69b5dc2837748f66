"""Moved to :mod:`torchport.tools.run`; this old path is an alias of it."""

from torchport._moved import alias

alias(__name__, "torchport.tools.run")
