"""Integrations with libraries that choose a device from a fixed list of vendors.

Each module makes one family of libraries treat the torchport device as they treat a GPU,
by the libraries' own mechanisms where those exist and by small, recorded, reversible
patches where they do not (:mod:`torchport.integrations.huggingface`,
:mod:`torchport.integrations.lightning`).
"""

from __future__ import annotations

from typing import Any

import torch


def claim(state: Any, device_type: str | None, library: str) -> bool:
    """Mark ``state`` (an integration's, with a ``name``) installed for ``device_type``
    (default: the registered PrivateUse1 device). False where it already is, for that
    device; an integration installed for another device raises."""
    name = device_type or torch._C._get_privateuse1_backend_name()
    if state.name is not None:
        if state.name != name:
            raise RuntimeError(f"torchport: {library} integration already installed for "
                               f"{state.name!r}")
        return False
    state.name = name
    return True
