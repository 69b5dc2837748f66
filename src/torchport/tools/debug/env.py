"""The porting tools that environment variables switch on, started when a backend registers.

A feature module (:mod:`torchport.features`): as a backend registers, :func:`on_register`
gives :func:`start_from_env` to the op layer (:func:`torchport.ops.hooks.on_load_env`),
which calls it once, when the fallback is made. ``TORCHPORT_AUTOCOMPARE``,
``TORCHPORT_DUMP_OPS``, ``TORCHPORT_DUMP_DIR`` and ``TORCHPORT_DUMP_CPU``; the tools'
modules are imported only when one is set.
"""

from __future__ import annotations

from typing import Any

from torchport.core import settings
from torchport.ops import hooks


def start_from_env() -> None:
    if settings.get("TORCHPORT_AUTOCOMPARE"):
        from torchport.tools.debug import crosscheck
        crosscheck.start_from_env()
    if (settings.get("TORCHPORT_DUMP_OPS") or settings.get("TORCHPORT_DUMP_DIR")
            or settings.get("TORCHPORT_DUMP_CPU")):
        from torchport.tools.debug import opdump
        opdump.start_from_env()


def on_register(backend: Any, module: Any) -> None:
    """The feature's install as a backend registers (:mod:`torchport.features`)."""
    hooks.on_load_env(start_from_env)
