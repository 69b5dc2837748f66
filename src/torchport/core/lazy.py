"""Work deferred until it is needed: a package's public names resolved on first use
(PEP 562), shared by the package ``__init__``s, so that importing one module of a
package loads only what it needs; and registrations with a costly PyTorch module
(``torch._dynamo``, ``torch._inductor``) made when that module is first imported."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable
from typing import Any


def exports(package: str, table: dict[str, str], public: list[str]
            ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``: a name of ``table`` (public
    name -> the module defining it) is imported on first use and kept in the package."""
    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(public))

    return __getattr__, __dir__


class _RunAfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``module`` with the other finders, runs it, then calls ``fn(module)``;
    removes itself from ``sys.meta_path`` first, leaving it as it was."""

    def __init__(self, module: str, fn: Callable[[types.ModuleType], None]) -> None:
        self.module, self.fns = module, [fn]
        self.loader: Any = None

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.module:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        self.loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        for fn in self.fns:
            fn(module)


def when_imported(module: str, fn: Callable[[types.ModuleType], None]) -> None:
    """Call ``fn(module)`` once ``module`` (a submodule name) has been imported: now if
    it already is, else right after its first import finishes."""
    loaded = sys.modules.get(module)
    if loaded is not None:
        fn(loaded)
        return
    for finder in sys.meta_path:  # one finder per module: the import reaches only the first
        if isinstance(finder, _RunAfterImport) and finder.module == module:
            finder.fns.append(fn)
            return
    sys.meta_path.insert(0, _RunAfterImport(module, fn))
