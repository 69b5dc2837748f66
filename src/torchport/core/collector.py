"""Pausing Python's cyclic garbage collector while torchport builds what lives until exit.

Registering a backend allocates some 10^5 long-lived objects (a kernel and a plan for each of
about a thousand ops, and the modules behind them); each full collection they trigger walks
torch's whole heap, which doubled the time of ``import torchport.sim``, paid by every
interpreter that imports it. Nothing of that is garbage, so pausing loses nothing.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the cyclic collector for the block; it is left as it was (a caller that
    disabled it finds it disabled)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()
