"""The porting and debugging tools layer: the top of torchport's layers (pyproject.toml's
``[tool.importlinter]``). Tools here use the device as a user would, through ``torch`` and
the public modules below them; nothing below imports them.

* :mod:`torchport.tools.cli`: the ``torchport`` command (info, run, coverage, migrate,
  compare-dumps), each command importing its tool when it runs.
* :mod:`torchport.tools.info`: ``torchport info`` (versions, the C++ layer, the settings in
  effect); ``python -m torchport.tools.info --markdown`` writes docs/configuration.md.

* :mod:`torchport.tools.fuzz`: the differential fuzzer (random programs on the CPU and on the
  device, compared step by step; ``python -m torchport.tools.fuzz``).
"""
