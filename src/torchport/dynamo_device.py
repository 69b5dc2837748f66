"""Moved to :mod:`torchport.graph.dynamo_device`; this name stays importable, with a DeprecationWarning."""

from torchport._moved import alias

alias(__name__, "torchport.graph.dynamo_device")
