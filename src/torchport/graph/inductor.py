"""``torch.compile``'s default compiler (inductor) on a device: inductor's C++/OpenMP
codegen over device memory (``codegen="host"``), or the vendor's own inductor
``Scheduling`` (``codegen=<class>``: the OpenCL backend's ``OpenCLScheduling``), with
everything else -- registration, allocation, cache key -- from torchport.

A device whose memory the host can address (the sim; unified-memory chips) can run the
C++ kernels inductor writes for the CPU, given pointers into its memory. This module
registers that with inductor for the device (``register_backend_for_device``: a
``CppScheduling`` and a wrapper of its own) and makes the generated program a
well-behaved device program:

* every buffer is allocated on its own device index by torchport's allocator, from C
  without a Python frame where the C++ library serves (the stock wrapper writes
  ``empty_strided(..., device="sim")`` without an index);
* every C++ kernel is launched on the current stream with ``Runtime.launch`` and given
  the chip's views of its tensors (:class:`KernelLauncher`), so an asynchronous runtime
  runs it in stream order after the ops queued before it, and a runtime whose
  addresses the host cannot dereference still gives the kernel memory it can read;
  where neither is needed (a synchronous runtime with host addresses) the kernels are
  called directly, as on the CPU;
* the compile cache key names the launch mode and torchport's codegen
  (:class:`CacheKey`, a post-grad pass inductor puts in its key).

Inductor makes many decisions by ``device.type == "cpu"``; :mod:`torchport.graph.cpu_checks`
handles the ones that decide correctness for a C++-compiled device and documents the
rest.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import os
import sys
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from torchport.core import lazy

if TYPE_CHECKING:
    from torchport.core.contracts import DeviceBackend

Tensor = torch.Tensor
#: device name -> its registered backend, when that asked for compilation
_COMPILABLE: dict[str, Any] = {}
#: device name -> its launcher (what generated programs call at run time), made on first use
_LAUNCHERS: dict[str, KernelLauncher] = {}
#: backend -> the views its compiled kernels get (declared by enable_inductor; ``None``: the
#: vendor's own scheduling generates the kernels)
_DECLARED: weakref.WeakKeyDictionary[Any, Callable[[Tensor], Tensor] | None] = \
    weakref.WeakKeyDictionary()
#: device name -> the vendor's own inductor ``Scheduling`` (enable_inductor(codegen=...)): the
#: class, or ``"module:Class"`` imported on first use
_OWN: dict[str, type | str] = {}
CODEGEN_VERSION = "1"


class KernelLauncher:
    """What a compiled program of one device calls: allocation and kernel launches.

    ``views``: the backend's view function (a device tensor -> a CPU tensor over the
    same memory, as its host-op kernels use); ``direct``: kernels may be called with the
    device tensors themselves (synchronous runtime, device addresses are host
    addresses)."""

    def __init__(self, backend: DeviceBackend,
                 views: Callable[[Tensor], Tensor] | None) -> None:
        from torchport.ops import hostviews

        self.backend = backend
        self.name = backend.name
        rt = backend.runtime
        self.asynchronous = bool(rt.asynchronous)
        self.own = _OWN.get(self.name)
        self.direct = not self.asynchronous and backend.host_address_is_device_address
        self._views = None if views is None else hostviews.for_to_cpu(views, backend.devices)
        self._empty = torch.empty_strided
        self._devices = backend.devices  # made once: a torch.device costs more than the buffer
        if self.direct or self.own is not None:
            self.launch = _call  # type: ignore[method-assign]
        from torchport.ops.native_factories import compiled_allocator

        #: what the programs allocate with: :meth:`empty_strided`, in C where it can
        self.allocate = compiled_allocator(self.empty_strided)

    @property
    def mode(self) -> str:
        """How kernels are launched: ``direct``, ``views`` or ``queued`` (host codegen), or
        ``own:<module.Scheduling>`` (the vendor's kernels launch themselves)."""
        if self.own is not None:
            return f"own:{_qualified(self.own)}"
        return "direct" if self.direct else "queued" if self.asynchronous else "views"

    def empty_strided(self, size: tuple, stride: tuple, dtype: torch.dtype, index: int) -> Tensor:
        """A buffer of the program on device ``index`` (torchport's allocator, current stream)."""
        return self._empty(size, stride, dtype=dtype, device=self._devices[index])

    def launch(self, index: int, name: str, kernel: Callable[..., Any], *args: Any) -> None:
        """Run ``kernel`` on the chip's views of ``args`` in order on the current stream of
        device ``index``."""
        assert self._views is not None
        entries, add = self._views.entries, self._views.add
        mapped = []
        for a in args:
            if isinstance(a, Tensor):
                if a.device.type == "cpu":  # a CPU scalar the graph reads (an optimizer's step)
                    # read when the kernel runs: a queued kernel gets the value of now
                    mapped.append(a.clone() if self.asynchronous else a)
                    continue
                key = (a.data_ptr(), a.dtype, a.shape, a.stride())
                e = entries.get(key)
                if e is None:
                    e = add(a, key, False)
                    if e is None:
                        raise RuntimeError(
                            f"{self.name}: compiled kernel {name} got a tensor on {a.device}; "
                            f"the graph was compiled for {self.name}:{index}")
                a = e[0]
            mapped.append(a)
        b = self.backend
        b.runtime.launch(b.visible[index], b.current_stream_handle(index),
                         lambda: kernel(*mapped), name)


def _call(index: int, name: str, kernel: Callable[..., Any], *args: Any) -> None:
    kernel(*args)


def launcher(name: str) -> KernelLauncher:
    """The launcher of device ``name`` (generated programs look it up at import)."""
    made = _LAUNCHERS.get(name)
    if made is not None:
        return made
    backend = _COMPILABLE.get(name)
    if backend is not None:
        made = _LAUNCHERS[name] = KernelLauncher(backend, _DECLARED[backend])
        return made
    raise RuntimeError(f"torch.compile: no compiled-program support is enabled for device "
                       f"{name!r}; register its backend first (import torchport.{name})")


def enable_inductor(backend: DeviceBackend, codegen: str | type = "host",
                    views: Callable[[Tensor], Tensor] | None = None) -> None:
    """Let ``torch.compile`` (inductor) compile graphs whose tensors are on ``backend``'s
    device; call it before or after ``backend.register()``.

    ``codegen="host"``: inductor's C++ kernels run on the device's memory through
    ``views`` (a device tensor -> a CPU tensor over the same memory: the function the
    backend's host-op kernels use; ``backend.host_view`` by default, which needs a
    host-addressable runtime).

    ``codegen=<a Scheduling class>`` or ``"module:Class"`` (imported when inductor first
    makes one: a backend can declare it without importing inductor): the vendor's own
    inductor code generator (a ``torch._inductor.codegen.simd.SIMDScheduling`` subclass,
    as the OpenCL backend's ``OpenCLScheduling``) writes the kernels; its kernels' ``call_kernel`` writes a call
    the generated program makes as it is (the kernel object enqueues itself on the
    current stream). torchport still supplies the rest: registration before PyTorch's
    PrivateUse1 route, buffers on their own device index through its allocator, the
    device's part of the cache key (which covers the sources of the code generator: the
    modules of the scheduling, of its kernel class and of the kernel's op overrides), and
    dynamo's device interface and skip list. ``views`` is not used then.

    Inductor takes the device when it sets its backends up (it asks ``torch.<device>``
    for the classes), or at once if it already has."""
    if isinstance(codegen, type) or ":" in codegen:
        if views is not None:
            raise ValueError(f"enable_inductor({backend.name!r}): views= is for codegen='host'; "
                             f"a vendor's own Scheduling reads device memory itself")
        _OWN[backend.name] = codegen
        _DECLARED[backend] = None
    elif codegen != "host":
        raise ValueError(f"enable_inductor: unknown codegen {codegen!r}; 'host' runs inductor's "
                         f"C++ kernels on device memory, or pass the vendor's own inductor "
                         f"Scheduling class (a SIMDScheduling subclass)")
    else:
        if views is None:
            if not backend.runtime.host_addressable:
                raise ValueError(f"enable_inductor({backend.name!r}): the runtime's memory is "
                                 f"not host-addressable; pass views= (how kernels see device "
                                 f"memory) or a Scheduling class of your own as codegen=")
            views = backend.host_view
        _OWN.pop(backend.name, None)
        _DECLARED[backend] = views
    module = getattr(backend, "device_module", None)
    if module is not None:  # registered already
        on_register(backend, module)


def on_register(backend: DeviceBackend, module: Any) -> None:
    """Make the device compilable if its backend asked for it (:func:`enable_inductor`):
    registered with inductor as soon as ``torch._inductor.codegen.common`` is imported,
    before inductor sets its own backends up or computes a cache key."""
    if backend not in _DECLARED:
        return
    from torchport.graph import cpu_checks

    name = backend.name
    _COMPILABLE[name] = backend
    _LAUNCHERS.pop(name, None)
    if name not in _OWN:  # inductor's CPU answers are for the C++ codegen only
        cpu_checks.install_fake_rules(name)
    lazy.when_imported(_INDUCTOR_COMMON, lambda common: _register(name, common))


_INDUCTOR_COMMON = "torch._inductor.codegen.common"


def _register(name: str, common: Any) -> None:
    """Register the device's scheduling, wrappers, op overrides and cache key with inductor.

    This runs while ``codegen.common`` finishes importing, when inductor's code
    generators cannot be imported yet (they import it): the classes given stand for them
    and load them on first use."""
    common.register_backend_for_device(
        name, _scheduling_class(_OWN.get(name)), _lazy_wrapper(name, _wrapper_class),
        _lazy_wrapper(name, _unsupported_wrapper), _lazy_wrapper(name, _unsupported_wrapper),
        device_custom_pass=cache_key(name))
    common.register_device_op_overrides(name, _op_overrides(name, common))


def _scheduling_class(own: type | str | None = None) -> type:
    """The scheduling inductor makes for the device: the vendor's own (a class, or one
    imported when first made) or inductor's C++ one."""
    if isinstance(own, type):
        return own

    class DeviceScheduling:
        """The vendor's scheduling named by a string, or inductor's C++ one
        (``CppScheduling``), imported when first made."""

        def __new__(cls, scheduler: Any) -> Any:  # type: ignore[misc]
            if own is not None:
                return _resolve(own)(scheduler)
            from torch._inductor.codegen.cpp import CppScheduling

            return CppScheduling(scheduler)

    return DeviceScheduling


def _resolve(own: type | str) -> type:
    """The class ``own`` names (``"module:Class"``)."""
    if isinstance(own, type):
        return own
    module, _, attr = own.partition(":")
    return getattr(importlib.import_module(module), attr)


def _qualified(own: type | str) -> str:
    return own if isinstance(own, str) else f"{own.__module__}:{own.__qualname__}"


class _Lazy(type):
    """A class standing for another one, made on first use: ``create`` and the class
    attributes inductor reads (``supports_caching``, ...) are the real class's."""

    def __getattr__(cls, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        made = cls.__dict__["_made"]
        if not made:
            made.append(cls.__dict__["_make"]())
        return getattr(made[0], attr)


def _lazy_wrapper(name: str, make: Callable[[str], type]) -> type:
    """A wrapper code generator class, built when inductor first uses it."""
    return _Lazy("LazyWrapper", (), {"_made": [], "_make": staticmethod(lambda: make(name))})


def _unsupported_wrapper(name: str) -> type:
    from torch._inductor.codegen.wrapper import PythonWrapperCodegen

    class UnsupportedWrapper(PythonWrapperCodegen):
        @staticmethod
        def create(*args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError(
                f"torch.compile on {name}: inductor's C++ and FX wrappers are not supported for "
                f"this device; leave torch._inductor.config.cpp_wrapper and fx_wrapper off")

    return UnsupportedWrapper


class _CacheKeyBase:
    """The device's post-grad pass: inductor puts its ``uuid`` (this codegen and the
    launch mode) in the cache key of graphs, and runs it on each graph on the device
    before lowering it, which is when inductor's CPU questions must be answered for the
    device (:mod:`torchport.graph.cpu_checks`)."""

    def __init__(self, name: str, mode: str) -> None:
        self.name, self.mode = name, mode

    def __call__(self, gm: torch.fx.GraphModule) -> None:
        from torchport.graph import cpu_checks

        if self.name not in _OWN:
            cpu_checks.install(self.name)

    def uuid(self) -> str:
        from torchport.graph import cpu_checks

        own = _OWN.get(self.name)
        if own is None:
            # asked before a graph is traced for the compile caches: the answers must be there
            cpu_checks.install(self.name)
        h = hashlib.sha256(f"torchport-{CODEGEN_VERSION}:{self.name}:{self.mode}".encode())
        here = os.path.dirname(os.path.abspath(__file__))
        sources = [os.path.join(here, src) for src in ("inductor.py", "cpu_checks.py")]
        if own is not None:  # the vendor's code generator: a change of it is a new key
            sources += _codegen_sources(_resolve(own))
        for src in sources:  # the code this key covers
            with open(src, "rb") as f:
                h.update(f.read())
        return h.hexdigest()


def _codegen_sources(scheduling: type) -> list[str]:
    """The files of a vendor's inductor code generator, which the cache key covers: the
    module of its ``Scheduling``, then those of the kernel class it makes (``kernel_type``)
    and of that kernel's op overrides (``overrides``), with their base classes' -- all but
    torch's and the standard library's, so that a generator split over modules is covered
    whole."""
    files = [inspect.getfile(scheduling)]
    kernel = getattr(scheduling, "kernel_type", None)
    for cls in (scheduling, kernel, getattr(kernel, "overrides", None)):
        for c in getattr(cls, "__mro__", ()):
            top = c.__module__.partition(".")[0]
            if top == "torch" or top in sys.stdlib_module_names:
                continue
            try:
                f = inspect.getfile(c)
            except (TypeError, OSError):  # a class without a source file
                continue
            if f not in files:
                files.append(f)
    return files


_CACHE_KEYS: dict[str, Any] = {}


def cache_key(name: str) -> Any:
    """Device ``name``'s part of inductor's cache key (one object per device and launcher)."""
    mode = launcher(name).mode
    key = _CACHE_KEYS.get(name)
    if key is None or key.mode != mode:
        from torch._inductor.custom_graph_pass import CustomGraphModulePass

        cls = type("TorchportCacheKey", (_CacheKeyBase, CustomGraphModulePass), {})
        key = _CACHE_KEYS[name] = cls(name, mode)
    return key


def _op_overrides(name: str, common: Any) -> Any:
    class DeviceOps(common.DeviceOpOverrides):
        def import_get_raw_stream_as(self, alias: str) -> str:
            return f"def {alias}(index):\n    return torch.{name}.current_stream(index).stream_id\n"

        def set_device(self, device_idx: int) -> str:
            return f"torch.{name}.set_device({device_idx})"

        def synchronize(self) -> str:
            return f"torch.{name}.synchronize()"

        def device_guard(self, device_idx: int) -> str:
            return f"torch.{name}.device({device_idx})"

        def cpp_kernel_type(self) -> str:
            return "void*"

    return DeviceOps()


def _wrapper_class(name: str) -> type:
    from torch._inductor.codegen.wrapper import (
        PythonWrapperCodegen,
        SubgraphPythonWrapperCodegen,
    )
    from torch._inductor.virtualized import V

    class HostCodegen:
        """The stock Python wrapper, with the device's buffers allocated on their own
        index and its C++ kernels launched through the device's launcher."""

        def write_header(self) -> None:
            super().write_header()
            self.header.splice(
                f"""
                from torchport.graph.inductor import launcher as _tp_launcher
                _tp_{name} = _tp_launcher({name!r})
                empty_strided_{name} = _tp_{name}.allocate
                launch_{name} = _tp_{name}.launch
                """, strip=True)

        def make_allocation(self, buf: str, device: torch.device, dtype: torch.dtype,
                            shape: Any, stride: Any, allocation_shape: Any = None,
                            is_pinned: bool = False) -> str:
            if device.type != name:
                return super().make_allocation(buf, device, dtype, shape, stride,
                                               allocation_shape, is_pinned)
            if allocation_shape is None:
                allocation_shape = shape
            size = self.codegen_python_shape_tuple(shape)
            alloc = self.codegen_python_shape_tuple(allocation_shape)
            strides = self.codegen_python_shape_tuple(stride)
            out = f"{buf} = empty_strided_{name}({alloc}, {strides}, {dtype}, {device.index or 0})"
            if size != alloc:
                out += f".as_strided({size}, {strides})"
            return out

        def _generate_kernel_call_helper(self, kernel_name: str, call_args: Any, *,
                                         device: Any = None, triton: bool = True,
                                         **kwargs: Any) -> Any:
            device = device or V.graph.get_current_device_or_throw()
            if triton or device.type != name:
                return super()._generate_kernel_call_helper(
                    kernel_name, call_args, device=device, triton=triton, **kwargs)
            if name in _OWN:  # the vendor's kernel object enqueues itself
                self.writeline(self.wrap_kernel_call(kernel_name, call_args))
                return None
            if launcher(name).direct:  # called as on the CPU (the cache key names the mode)
                self.writeline(self.wrap_kernel_call(kernel_name, call_args))
                return None
            # the launcher decides when the program runs, and what memory its kernels see
            args = ", ".join([str(device.index or 0), repr(kernel_name), kernel_name, *call_args])
            self.writeline(f"launch_{name}({args}){self.ending}")
            return None

    class HostWrapperCodegen(HostCodegen, PythonWrapperCodegen):  # type: ignore[misc]
        @staticmethod
        def create(is_subgraph: bool, subgraph_name: str | None, parent_wrapper: Any,
                   partition_signatures: Any = None) -> Any:
            if is_subgraph:
                return HostSubgraphCodegen(subgraph_name, parent_wrapper, partition_signatures)
            return HostWrapperCodegen()

    class HostSubgraphCodegen(HostCodegen, SubgraphPythonWrapperCodegen):  # type: ignore[misc]
        pass

    return HostWrapperCodegen


def compilable() -> list[str]:
    """The devices ``torch.compile`` can compile for (registered, inductor enabled)."""
    return sorted(_COMPILABLE)
