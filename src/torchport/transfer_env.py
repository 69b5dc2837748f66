"""``TORCHPORT_TRANSFER=1``: enable :mod:`torchport.transfer` when a backend registers.

A feature module (:mod:`torchport.features`): :func:`on_register` enables transfer
for the registering backend when the variable is set, or when ``torchport.transfer``
was imported before any backend registered (importing it asks for transfer).
"""

from __future__ import annotations

import sys
from typing import Any

from torchport.core import settings


def on_register(backend: Any, module: Any) -> None:
    """Enable transfer for ``backend`` if the variable or an earlier import asks for it."""
    imported = sys.modules.get("torchport.transfer")
    if settings.get("TORCHPORT_TRANSFER") or (imported is not None and imported.requested()):
        from torchport import transfer

        transfer.enable(backend)
