"""Old import paths of modules that moved into the layer folders: each stays importable,
the same module object under both names (so that pickles, ``monkeypatch`` targets and
``isinstance`` checks keep working), with one DeprecationWarning naming the new path."""

from __future__ import annotations

import importlib
import runpy
import sys
import warnings


def alias(old: str, new: str) -> None:
    """Make ``old`` (the module being imported) the module ``new``; run as a script
    (``python -m`` the old name), run ``new`` as ``__main__``."""
    if old == "__main__":
        runpy.run_module(new, run_name="__main__", alter_sys=True)
        return
    warnings.warn(f"{old} moved to {new}; import it from there", DeprecationWarning,
                  stacklevel=3)
    sys.modules[old] = importlib.import_module(new)
