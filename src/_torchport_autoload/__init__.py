"""PyTorch's device-backend autoload hook for torchport (entry point group ``torch.backends``).

``import torch`` calls :func:`load` in every process. It does nothing unless
``TORCHPORT_AUTOLOAD`` names a backend; then it registers that backend (and
``TORCHPORT_TRANSFER=1`` enables transfer as the backend registers). ``torchport
run`` exports both, so processes the script starts (``torch.multiprocessing.spawn``,
``multiprocessing`` with spawn, ``subprocess`` running Python) run on the device too.

A top-level package, not part of :mod:`torchport`, so that ``import torch`` without
the variable imports nothing of torchport and stays exactly as before.
"""

import os

VARIABLE = "TORCHPORT_AUTOLOAD"


def load() -> None:
    """Register the backend ``TORCHPORT_AUTOLOAD`` names; without it, do nothing."""
    name = os.environ.get(VARIABLE, "").strip()
    if name.lower() in ("", "0", "false", "no", "off"):
        return
    from torchport.tools.run import load_backend

    load_backend(name)
    children = os.environ.get("TORCHPORT_COVERAGE_CHILDREN")
    if children:  # a child of a script under ``torchport coverage``: report its ops too
        from torchport.tools.debug.opcoverage import record_child_process

        record_child_process(children)
