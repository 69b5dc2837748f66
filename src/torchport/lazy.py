"""Public names of a package resolved on first use (PEP 562), shared by the package
``__init__``s: importing one module of a package then loads only what it needs."""

from __future__ import annotations

import importlib
import sys
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
