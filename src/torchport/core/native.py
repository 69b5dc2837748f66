"""torchport's optional C++: the device layer PyTorch asks in C++, and the view kernels.

PyTorch asks a device type for a device guard, accelerator hooks, generators, an
allocator and profiler stubs in C++; its support for Python backends fills them with
stand-ins that answer "device 0, one device, default stream" or raise. torchport compiles
its own, vendor-neutral (they call the Python runtime only where the hardware must act),
into one small library, with PyTorch's C++ view kernels, from the sources in ``csrc/``
(its README says what each file gives PyTorch and which module switches it on).

The library is compiled once per source, torch and Python version (``$CXX``, default
``c++``, with the headers in the torch wheel) into ``TORCHPORT_CACHE_DIR`` (default
``~/.cache/torchport``); ``make`` builds it at set-up, so that no test process has to. The
generators' bridge to Python objects needs Python's headers and ``libtorch_python``; it is
left out where the headers are missing (then the device has no ``torch.Generator``).
Without a C++ compiler (one :class:`NativeCodeWarning` says why), or with
``TORCHPORT_NATIVE=0``, PyTorch's stand-ins and torchport's Python twins serve (the
limitations page lists what each loses); ``torchport info`` names the layer in use.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import hashlib
import os
import shlex
import subprocess
import sys
import sysconfig
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from torchport.core import compat, settings

CSRC = Path(__file__).parent.parent / "csrc"
# every ``.cpp`` of ``csrc/`` is a part of the one library (its README says what each gives)
SOURCES = tuple(sorted(CSRC.glob("*.cpp")))
HEADERS = tuple(sorted(CSRC.glob("*.h")))  # what the sources share (in the build's hash)
_cpp: ctypes.CDLL | None = None
_py: ctypes.PyDLL | None = None  # the same library, for the functions taking Python objects
_tried = False
UNAVAILABLE = ""  # why the library could not be built or loaded, when it could not
ENABLED: list[str] = []  # the parts of the C++ device layer this process registered


def enabled(part: str) -> None:
    """Note that ``part`` of the C++ device layer serves (``torchport info`` lists them)."""
    if part not in ENABLED:
        ENABLED.append(part)


def describe() -> str:
    """Which device layer serves this process: the C++ parts, or why the Python one."""
    if not wanted():
        return "Python (TORCHPORT_NATIVE=0)"
    if _cpp is None:
        return f"Python (C++ library unavailable: {UNAVAILABLE or 'not loaded'})"
    return "C++: " + (", ".join(ENABLED) or "view kernels")


class NativeCodeWarning(RuntimeWarning):
    """The C++ library is unavailable; views and the device guard take the Python path."""


def wanted() -> bool:
    return settings.get("TORCHPORT_NATIVE")


def _cache_dir() -> Path:
    base = settings.get("TORCHPORT_CACHE_DIR")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "torchport"


def _python_flags() -> list[str]:
    """Compiler flags for the parts that take Python objects (the generators' bridge):
    Python's headers where they are installed, and libtorch_python (torch.Generator)."""
    include = sysconfig.get_paths().get("include")
    if not include or not (Path(include) / "Python.h").exists():
        return []  # native_generator.cpp leaves its Python part out
    return [f"-isystem{include}"]


def _name() -> str:
    """The library's name: a new build for every source, torch or Python version."""
    h = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        h.update(source.read_bytes())
    h.update(f"{torch.__version__} {sys.version} {torch._C._GLIBCXX_USE_CXX11_ABI}".encode())
    h.update(" ".join(_python_flags()).encode())
    return f"torchport_native_{h.hexdigest()[:16]}"


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
    print(f"torchport: compiling the C++ library into {where} (once)", file=sys.stderr)
    with compat.quiet_cuda_home():
        from torch.utils import cpp_extension

    partial = where / f"{name}.{os.getpid()}.tmp"
    cmd = [*shlex.split(os.environ.get("CXX", "c++")), "-O2", "-std=c++20", "-shared", "-fPIC",
           f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
           *(f"-isystem{p}" for p in cpp_extension.include_paths()), *_python_flags(),
           *map(str, SOURCES), *(f"-L{p}" for p in cpp_extension.library_paths()), "-lc10",
           "-ltorch_cpu", "-ltorch_python", "-o", str(partial)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:  # no compiler
        done = subprocess.CompletedProcess(cmd, 1, "", str(e))
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        errors = [line for line in lines if "error" in line] or lines  # the first error
        failed.write_text(f"{cmd[0]} failed: {errors[0] if errors else done.returncode} "
                          f"(remove {where} to try again)")
        raise RuntimeError(failed.read_text())
    os.replace(partial, path)  # atomic: a process building at the same time is harmless
    return path


def load() -> ctypes.CDLL | None:
    """The library, built if needed; ``None`` where it is not wanted or cannot be built
    (then the reason is in :data:`UNAVAILABLE`). Tried once per process."""
    global _cpp, _tried, UNAVAILABLE
    if not wanted():
        return None
    if _tried:
        return _cpp
    _tried = True
    try:
        _cpp = ctypes.CDLL(str(build()))
    except Exception as e:  # no compiler, a failed build: the Python twins serve
        UNAVAILABLE = f"{type(e).__name__}: {e}"
        warnings.warn(f"torchport: the C++ library is unavailable ({UNAVAILABLE}); view ops "
                      f"take the Python path and PyTorch's Python stand-ins serve the device "
                      f"layer: a device name without an index in torch.tensor, "
                      f"torch.as_tensor, torch.asarray, Tensor.to and Tensor.new_tensor means "
                      f"device 0; no torch.Stream/torch.Event, torch.Generator(device=...), "
                      f"pinned memory (pin_memory() gives unpinned copies), torch.accelerator "
                      f"memory statistics or profiler device time; backward runs in the "
                      f"calling thread (TORCHPORT_NATIVE=0 silences this)", NativeCodeWarning,
                      stacklevel=2)
    return _cpp


def loaded() -> ctypes.CDLL | None:
    """The library if this process has loaded it (never builds)."""
    return _cpp


# The guard's callback into the stream layer: (op, a, b, c, int out, float out) -> status.
GUARD_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_longlong,
                                  ctypes.c_longlong, ctypes.c_longlong,
                                  ctypes.POINTER(ctypes.c_longlong),
                                  ctypes.POINTER(ctypes.c_double))


class GuardDevice:
    """The C++ guard's per-thread state, read and written from Python: one current device
    and one current stream per device for torchport, ``torch.accelerator``, ``torch.Stream``
    and PyTorch's own index resolution and autograd engine."""

    def __init__(self, cpp: ctypes.CDLL) -> None:
        self.get: Callable[[], int] = _fn(cpp.torchport_guard_get_device, ctypes.c_int)
        self.set: Callable[[int], None] = _fn(cpp.torchport_guard_set_device, None,
                                              ctypes.c_int)
        self.get_stream: Callable[[int], int] = _fn(cpp.torchport_guard_get_stream,
                                                    ctypes.c_longlong, ctypes.c_int)
        self.set_stream: Callable[[int, int], None] = _fn(
            cpp.torchport_guard_set_stream, None, ctypes.c_int, ctypes.c_longlong)
        self.fail: Callable[[bytes], None] = _fn(cpp.torchport_guard_fail, None,
                                                 ctypes.c_char_p)
        self._set_callback = _fn(cpp.torchport_guard_set_callback, None, GUARD_CALLBACK)
        self._set_unsupported = _fn(cpp.torchport_guard_set_unsupported, None,
                                    ctypes.c_char_p)
        self._callback: Any = None  # the ctypes callback object, kept alive while set
        self._cpp = cpp
        self._detach_registered = False

    def set_callback(self, fn: Callable[..., int] | None) -> None:
        """Route the guard's stream and event work to ``fn`` (``None``: to nowhere) until
        the interpreter has finished: finalisers at exit still reach the device's streams."""
        self._callback = GUARD_CALLBACK() if fn is None else GUARD_CALLBACK(fn)  # () is NULL
        self._set_callback(self._callback)
        if fn is not None:
            # C++ holds the thunk's address: it must outlive the modules' teardown
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(self._callback))
            if not self._detach_registered:
                self._detach_registered = True
                at_interpreter_end(self._cpp.torchport_guard_detach)

    def set_unsupported(self, dtypes: Iterable[torch.dtype]) -> None:
        """The dtypes ``torch.accelerator.get_device_capability`` reports unsupported."""
        # a dtype's C++ name is the one in its legacy tensor type: torch.DoubleTensor
        names = [_QUANTIZED_NAMES.get(d) or
                 torch.empty(0, dtype=d).type().rsplit(".", 1)[-1][:-len("Tensor")]
                 for d in dtypes]
        self._set_unsupported(",".join(names).encode())


_QUANTIZED_NAMES = {torch.qint8: "QInt8", torch.quint8: "QUInt8", torch.qint32: "QInt32",
                    torch.quint4x2: "QUInt4x2", torch.quint2x4: "QUInt2x4"}


def at_interpreter_end(fn: Any) -> None:
    """Run the library's C function ``fn`` (no arguments) once the interpreter has finished,
    after its last finaliser (``Py_AtExit``), so that C++ destructors at process exit never
    call into a dead interpreter while finalisers still reach the device; at ``atexit``
    time where the interpreter has no room for it."""
    register = ctypes.pythonapi.Py_AtExit
    register.argtypes = [ctypes.c_void_p]
    register.restype = ctypes.c_int
    if register(ctypes.cast(fn, ctypes.c_void_p)) != 0:
        atexit.register(fn)


def _fn(f: Any, restype: Any, *argtypes: Any) -> Any:
    f.restype = restype
    f.argtypes = list(argtypes)
    return f


def use_guard(device_count: int) -> GuardDevice | None:
    """Replace PyTorch's Python device guard of PrivateUse1 by the C++ one for
    ``device_count`` visible devices, where the library loads; its current-device
    accessors, or ``None`` (then PyTorch's C++ resolves an index-less device name to 0)."""
    cpp = load()
    if cpp is None:
        return None
    cpp.torchport_guard_enable.argtypes = [ctypes.c_int]
    if not cpp.torchport_guard_enable(device_count):
        return None
    enabled("device guard (current device, streams, events)")
    return GuardDevice(cpp)


def use_hooks(device_count: int) -> bool:
    """Register the C++ accelerator hooks of PrivateUse1 (pinned host memory) for
    ``device_count`` visible devices, where the library loads. Must run before PyTorch's
    Python-backend set-up, which registers its own hooks where none are; ``False`` where
    they could not be registered (then that set-up's hooks serve)."""
    cpp = load()
    if cpp is None:
        return False
    cpp.torchport_hooks_enable.argtypes = [ctypes.c_int]
    if not cpp.torchport_hooks_enable(device_count):
        return False
    enabled("accelerator hooks (pinned memory)")
    return True


def pinned_bytes() -> int:
    """Bytes of pinned host memory alive now (0 without the C++ library)."""
    cpp = loaded()
    if cpp is None:
        return 0
    cpp.torchport_pinned_bytes.restype = ctypes.c_longlong
    return int(cpp.torchport_pinned_bytes())


def python_function(name: str, argtypes: list[Any], restype: Any) -> Any:
    """The library's function ``name`` that takes or returns Python objects, called holding
    the GIL (a ``ctypes.CDLL`` call releases it) and raising the Python error it sets;
    ``None`` where the library is unavailable or was built without Python's headers."""
    global _py
    cpp = load()
    if cpp is None or not hasattr(cpp, name):
        return None
    if _py is None:
        _py = ctypes.PyDLL(cpp._name)  # the same loaded library
    fn = getattr(_py, name)
    fn.argtypes = argtypes
    fn.restype = restype
    return fn


def counters(name: str, n: int) -> tuple[int, ...]:
    """The ``n`` counts the library's function ``name`` writes (``void name(int64_t*)``);
    zeros where the library or the function is missing."""
    cpp = loaded()
    if cpp is None or not hasattr(cpp, name):
        return (0,) * n
    out = (ctypes.c_int64 * n)()
    getattr(cpp, name)(out)
    return tuple(out)


@functools.cache
def _growable() -> Any:
    return python_function("torchport_growable_host_storage",
                           [ctypes.c_uint64, ctypes.c_uint64], ctypes.py_object)


def growable_host_storage(ptr: int, nbytes: int) -> torch.UntypedStorage | None:
    """A CPU storage over ``nbytes`` of host memory at ``ptr`` (which the caller keeps
    alive) that a CPU kernel may grow: growing moves it to new host memory, and nothing
    past ``nbytes`` is written. ``None`` without the library."""
    fn = _growable()
    return None if fn is None else fn(ptr, nbytes)


@functools.cache
def _wrapper() -> Any:
    return python_function("torchport_wrapped_number", [ctypes.py_object], ctypes.py_object)


_COMPLEX_OF = {torch.float16: torch.complex32, torch.float32: torch.complex64,
               torch.float64: torch.complex128}


def wrapped_number(value: bool | int | float | complex) -> torch.Tensor:
    """A Python number as the 0-dim CPU tensor the dispatcher made of it before a boxed call
    to Python turned it back into a number (``copysign(x, 2.0)``): a wrapped number, which
    type promotion treats as a scalar. Without the library, a plain 0-dim tensor of the
    dtype a scalar promotes as (the default dtype for a float): the same result dtype
    unless every tensor operand is 0-dim."""
    fn = _wrapper()
    if fn is not None:
        return fn(value)
    if isinstance(value, bool):
        return torch.tensor(value)
    if isinstance(value, int):
        return torch.tensor(value, dtype=torch.int64)
    if isinstance(value, float):
        return torch.tensor(value, dtype=torch.get_default_dtype())
    return torch.tensor(value, dtype=_COMPLEX_OF[torch.get_default_dtype()])


def _python_api() -> ctypes.PyDLL | None:
    """The generators' functions (:func:`python_function`); ``None`` without them."""
    if python_function("torchport_generators_adopt", [ctypes.py_object], ctypes.c_int) is None:
        return None
    python_function("torchport_generator_default", [ctypes.c_int], ctypes.py_object)
    python_function("torchport_generator_inner", [ctypes.py_object], ctypes.py_object)
    return _py


def use_generators(cpu_generators: list[torch.Generator]) -> tuple[torch.Generator, ...] | None:
    """Make ``cpu_generators`` (one per visible device) the states of the devices' default
    generators in C++, which ``torch.Generator(device=...)`` needs; the default generators
    (``torch.Generator`` objects of the device), or ``None`` where the library cannot
    provide them (then the device has no ``torch.Generator`` of its own)."""
    py = _python_api()
    if py is None:
        return None
    n = py.torchport_generators_adopt(list(cpu_generators))
    return tuple(py.torchport_generator_default(i) for i in range(n))


def why_no_generators() -> str:
    """Why the device has no ``torch.Generator`` of its own (for error messages)."""
    if not wanted():
        return "torchport's C++ library is switched off: TORCHPORT_NATIVE=0"
    if _cpp is None:
        return f"torchport's C++ library is unavailable: {UNAVAILABLE}"
    return "torchport's C++ library was built without Python's headers"


def generator_state(generator: torch.Generator) -> torch.Generator:
    """The CPU generator holding the state of ``generator``, a ``torch.Generator`` of the
    device: what the device's CPU kernels draw from in its place."""
    py = _python_api()
    if py is None:  # no device generator can exist then
        raise TypeError(f"expected a generator made by torchport's C++ library, got one of "
                        f"device {generator.device}")
    return py.torchport_generator_inner(generator)
