"""Old import paths of modules that moved into the layer folders: each stays importable,
the same module object under both names (so that pickles, ``monkeypatch`` targets and
``isinstance`` checks keep working), with one DeprecationWarning naming the new path.

A moved *package* keeps its submodules too: ``torchport.debug.compare`` is the module
``torchport.tools.debug.compare``, and ``python -m`` an old submodule runs the new one.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import runpy
import sys
import types
import warnings
from collections.abc import Sequence
from typing import Any


def alias(old: str, new: str) -> None:
    """Make ``old`` (the module being imported) the module ``new``; run as a script
    (``python -m`` the old name), run ``new`` as ``__main__``."""
    if old == "__main__":
        runpy.run_module(new, run_name="__main__", alter_sys=True)
        return
    warnings.warn(f"{old} moved to {new}; import it from there", DeprecationWarning,
                  stacklevel=3)
    sys.modules[old] = importlib.import_module(new)


def alias_package(old: str, new: str) -> None:
    """:func:`alias` for a package (called from the old package's ``__init__``): its
    submodules, imported or run by their old names, are the new package's."""
    _FINDER.packages[old] = new
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    alias(old, new)


class _AliasLoader(importlib.abc.Loader):
    """Loads an old name as the already imported module of its new name; gives the new
    module's code to ``runpy`` (``python -m`` an old name)."""

    def __init__(self, new: str, new_spec: importlib.machinery.ModuleSpec) -> None:
        self.new = new
        self.new_spec = new_spec
        self._module_spec: Any = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = importlib.import_module(self.new)
        self._module_spec = module.__spec__  # the import system sets the old one on it
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        module.__spec__ = self._module_spec

    def get_code(self, fullname: str) -> Any:
        return self.new_spec.loader.get_code(self.new)  # type: ignore[union-attr]

    def is_package(self, fullname: str) -> bool:
        return self.new_spec.submodule_search_locations is not None


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Finds the submodules of moved packages under their new names."""

    def __init__(self) -> None:
        self.packages: dict[str, str] = {}

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        for old, new in self.packages.items():
            if fullname.startswith(old + "."):
                new_name = new + fullname[len(old):]
                new_spec = importlib.util.find_spec(new_name)
                if new_spec is None:
                    return None
                return importlib.util.spec_from_loader(
                    fullname, _AliasLoader(new_name, new_spec),
                    is_package=new_spec.submodule_search_locations is not None)
        return None


_FINDER = _AliasFinder()
