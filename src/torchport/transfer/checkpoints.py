"""Checkpoints saved on CUDA load on the device: a serialization package maps storages
tagged ``cuda:N`` to ``<device>:N`` (``torch.load`` without ``map_location``)."""

from __future__ import annotations

from typing import Any

from torchport.transfer.mapping import _CUDA_RE, _map_str
from torchport.transfer.state import _RealDevice


# ---- serialization -----------------------------------------------------------------
def _cuda_tag(storage: Any) -> None:
    return None  # device storages keep their own tag (e.g. "sim:0")


def _cuda_restore(storage: Any, location: str) -> Any:
    if isinstance(location, str) and _CUDA_RE.match(location):
        return storage.to(device=_RealDevice(_map_str(location)))
    return None
