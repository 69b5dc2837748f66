"""View ops without Python: PyTorch's own C++ view kernels, registered for the device.

A view op (``view``, ``as_strided``, ``select``, ``permute``...) only makes a tensor
header over the same storage, and ATen's CPU kernels do that for any device
(DESIGN-NOTES). As Python kernels they cost a Python entry each: 3-4 us warm, more in a
training step, whose large kernels evict the interpreter from the caches; the large
transformer's step makes about 90. ``native_views.cpp`` registers the same ATen
functions for PrivateUse1 from C++, and the composite views (``select``, ``t``...)
then run PyTorch's composite kernels, all without Python.

The library is compiled once per torch and Python version (``$CXX``, default ``c++``,
with the headers in the torch wheel) into ``TORCHPORT_CACHE_DIR`` (default
``~/.cache/torchport``); ``make`` builds it at set-up, so that no test process has to.
Without a C++ compiler, or with ``TORCHPORT_NATIVE_VIEWS=0``, the Python view kernels
serve, with the same results. While op statistics record, ops are forced to the CPU or a
tool intercepts ops (``fallback.SLOW``) the Python kernels serve too, so that views are
counted and seen like every other op.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shlex
import subprocess
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torchport.backend import Backend

# The ops the C++ library registers (native_views.cpp): views with no composite kernel.
OPS = ("as_strided", "view", "_reshape_alias", "unfold", "view_as_real", "view_as_complex")

_SOURCE = Path(__file__).with_name("native_views.cpp")
_cpp: ctypes.CDLL | None = None
_tried = False
UNAVAILABLE = ""  # why the library could not be built or loaded, when it could not


class NativeViewsWarning(RuntimeWarning):
    """The C++ view kernels are unavailable; view ops take the Python path."""


def wanted() -> bool:
    return os.environ.get("TORCHPORT_NATIVE_VIEWS", "1") != "0"


def _cache_dir() -> Path:
    base = os.environ.get("TORCHPORT_CACHE_DIR")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "torchport"


def _name() -> str:
    """The library's name: a new build for every source, torch or Python version."""
    h = hashlib.sha256(_SOURCE.read_bytes())
    h.update(f"{torch.__version__} {sys.version} {torch._C._GLIBCXX_USE_CXX11_ABI}".encode())
    return f"torchport_native_views_{h.hexdigest()[:16]}"


def build() -> Path:
    """Compile the library (if not built yet); its path. Raises where it cannot."""
    name = _name()
    where = _cache_dir() / name
    path = where / f"{name}.so"
    if path.exists():
        return path
    failed = where / "FAILED"
    if failed.exists():  # one attempt per version: a broken toolchain costs no more time
        raise RuntimeError(failed.read_text())
    where.mkdir(parents=True, exist_ok=True)
    print(f"torchport: compiling the C++ view kernels into {where} (once)", file=sys.stderr)
    from torch.utils import cpp_extension

    partial = where / f"{name}.{os.getpid()}.tmp"
    cmd = [*shlex.split(os.environ.get("CXX", "c++")), "-O2", "-std=c++20", "-shared", "-fPIC",
           f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
           *(f"-isystem{p}" for p in cpp_extension.include_paths()), str(_SOURCE),
           *(f"-L{p}" for p in cpp_extension.library_paths()), "-lc10", "-ltorch_cpu",
           "-o", str(partial)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:  # no compiler
        done = subprocess.CompletedProcess(cmd, 1, "", str(e))
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        failed.write_text(f"{cmd[0]} failed: {lines[-1] if lines else done.returncode} "
                          f"(remove {where} to try again)")
        raise RuntimeError(failed.read_text())
    os.replace(partial, path)  # atomic: a process building at the same time is harmless
    return path


def load() -> ctypes.CDLL | None:
    """The library, built if needed; ``None`` (reason in :data:`UNAVAILABLE`) where it
    cannot be. Tried once per process."""
    global _cpp, _tried, UNAVAILABLE
    if _tried:
        return _cpp
    _tried = True
    try:
        _cpp = ctypes.CDLL(str(build()))
    except Exception as e:  # no compiler, a failed build: the Python kernels serve
        UNAVAILABLE = f"{type(e).__name__}: {e}"
        warnings.warn(f"torchport: the C++ view kernels are unavailable ({UNAVAILABLE}); view "
                      f"ops take the Python path (slower; TORCHPORT_NATIVE_VIEWS=0 silences "
                      f"this)", NativeViewsWarning, stacklevel=2)
    return _cpp


def switchable(op: torch._ops.OpOverload) -> bool:
    """Is a Python view kernel of ``op`` replaced while the C++ kernels are on: its op is
    one of theirs, or a composite view that reaches them."""
    name = op.name()
    if op._schema.overload_name == "" and name.split("::")[1] in OPS:
        return True
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return has(name, "CompositeExplicitAutograd") and not has(name, "CPU")


class ViewKernels:
    """A backend's switchable Python view kernels, and which of the two serves.

    Never both: the dispatcher would warn of an overridden kernel. The switch re-registers
    kernels, so it happens when a recorder or tool starts or stops, not per op."""

    def __init__(self) -> None:
        self.python: dict[str, Any] = {}  # overload name -> Python kernel
        self._registered: torch.library.Library | None = None  # the Python ones, while serving
        self.native = False
        self.vendor_owned = False  # the backend has its own kernel for one of OPS

    def give_way(self) -> None:
        """A kernel set brings its own kernel for one of :data:`OPS`: C++ no longer serves."""
        self.vendor_owned = True
        self.use(False)

    def add(self, name: str, kernel: Any) -> None:
        self.python[name] = kernel
        if self._registered is not None:
            self._registered.impl(name, kernel, "PrivateUse1")

    def use(self, native: bool) -> None:
        """Serve views from C++ (where it could be loaded) or from the Python kernels."""
        cpp = load() if native and wanted() and not self.vendor_owned else None
        if cpp is not None:
            if self._registered is not None:
                self._registered._destroy()
                self._registered = None
            cpp.torchport_native_views_enable()
            self.native = True
            return
        if _cpp is not None:
            _cpp.torchport_native_views_disable()
        self.native = False
        if self._registered is None:
            self._registered = torch.library.Library("aten", "IMPL")
            for name, kernel in self.python.items():
                self._registered.impl(name, kernel, "PrivateUse1")


def install(backend: Backend) -> None:
    """Serve the backend's views natively unless ops are slowed down, and follow that."""
    from torchport.ops import fallback

    views = backend.view_kernels
    views.use(not fallback.SLOW)
    fallback.on_slow_change(lambda slow: views.use(not slow))

