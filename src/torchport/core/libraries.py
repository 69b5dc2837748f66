"""PyTorch dispatcher registrations (``torch.library.Library``) kept for the life of the process."""

from __future__ import annotations

import weakref

import torch


def keep_past_exit(lib: torch.library.Library) -> torch.library.Library:
    """``lib`` with its registrations kept through interpreter exit.

    A ``Library`` unregisters its kernels from a ``weakref.finalize`` that also runs as
    an exit handler, before objects still alive are finalised: a ``__del__`` that uses
    the device at exit would find no kernel, where the CPU's run. The process's end
    frees the registrations anyway. (``finalize`` objects are reachable only through
    their registry.)"""
    for f in list(weakref.finalize._registry):  # type: ignore[attr-defined]
        info = f.peek()
        if info is not None and info[0] is lib:
            f.atexit = False
    return lib
