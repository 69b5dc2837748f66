"""The porting and debugging tools layer: the top of torchport's layers (pyproject.toml's
``[tool.importlinter]``, beside ``cli``). Tools here use the device as a user would, through
``torch`` and the public modules below them; nothing below imports them.

* :mod:`torchport.tools.fuzz`: the differential fuzzer (random programs on the CPU and on the
  device, compared step by step; ``python -m torchport.tools.fuzz``).
"""
