"""Host-op kernels without a Python entry, for devices whose memory is host memory.

A host-op kernel (:mod:`torchport.ops.hostkernels`) runs PyTorch's CPU kernel on the
chip's views of device memory. Where the host reads device memory at the device address
itself and the runtime is synchronous (the sim by default, a unified-memory device),
``native_hostops.cpp`` (part of :mod:`torchport.core.native`) does the same from C++ for an
op's common calls: tensors of one device, CPU tensors over the same memory, the CPU
kernel, new results (and ``out=`` arguments it grows) in blocks of the C++ caching
allocator. Its uncommon calls (another device, conjugate views, CPU tensors with
dimensions) it hands to the op's Python kernel, so results and errors stay the Python ones.

Served so: the functional, in-place and ``out=`` ops whose schema holds only tensors,
tensor lists, numbers, strings, dtypes, memory formats and a generator (no device or
layout), that change no tensor's metadata; random ones draw from the CPU generator the
device's generator holds (``native_generator.cpp``). And the factories whose CPU kernel is
PyTorch's composite one (``full``, ``arange``, ``randn``), which C++ runs. On an
asynchronous runtime with C++ queues (the sim's, :meth:`HostOpKernels.queues`) the same C++
kernels queue the calls the Python kernels taught them (``native_queued_ops.cpp``) and hand
the rest to the Python kernels; the copies with the host, ``Tensor.item`` and the learnt
fallback calls, which the Python kernels run on the host after the current stream's queued
work, they run the same way (waiting for that work in C++). As with the view and
empty kernels, never both are registered: where the library is missing, the memory is not
host memory at the device address, the runtime is asynchronous without C++ queues, and while
``fallback.SLOW`` is set (op statistics, forced fallback, tools intercepting ops), the
Python kernels serve.

The same kernels serve the CPU fallback's warm calls where they compute (the memory at the
device address, synchronous): the device's boxed fallback is then C++'s, which runs an
overload the Python fallback has learnt to take the CPU (:func:`learn_fallback`) as a
host op and calls the Python fallback for the rest (:mod:`torchport.ops.fallback`). On
device-only memory (a discrete device, whose runtime the host reaches only through its
copies) the same C++ fallback serves the learnt overloads through the runtime's copy
methods (:meth:`HostOpKernels.staged`, ``native_staged.cpp``) while the default stream is
current.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from torchport.core import native
from torchport.core.libraries import keep_past_exit
from torchport.ops import switch
from torchport.ops.plan import cuda_checked_args, plan_for

if TYPE_CHECKING:
    from torchport.core.contracts import DeviceBackend
    from torchport.runtime import NativeCopies

#: Where the CPU allocator's wrapper cannot serve (another CPU allocator outranks it), a
#: functional op whose first tensor is larger takes the Python kernel, which computes into
#: new device blocks directly: its results are likely as large (an activation of a large
#: batch), and C++ then computes a new result in host memory, copies it (up to
#: ``ADOPT_MIN_BYTES``) or has the runtime adopt it.
FUNCTIONAL_INPUT_MAX = 1 << 20

#: torchport's core kernels served the same way (with CPU tensors of any size: the copies
#: between the host and the device; ``_to_copy`` by a kernel of its own; ``resize_``, whose
#: CPU kernel grows the storage into a device block that the device storage takes;
#: ``Tensor.item``, read without a Python object, also by finalisers at exit).
CORE = frozenset({"copy_", "_to_copy", "resize_", "_local_scalar_dense"})

#: Those served in C++ on device-only memory too (``HostOpKernels.staged``): their blocking
#: calls on tensors of up to ``ADOPT_MIN_BYTES`` through the runtime's copies, as the
#: fallback's learnt calls (``native_staged.cpp``); the others take the Python kernels.
STAGED_CORE = frozenset({"copy_", "_to_copy", "_local_scalar_dense"})

#: What C++ is given per op: (Python kernel, functional, CPU tensors pass as they are,
#: composite factory, CUDA's registration compares its tensors' devices: a 0-dim CPU
#: operand takes the Python kernel, whose device check raises as CUDA's).
Entry = tuple[Callable[..., Any], bool, bool, bool, bool]

_ARG_TYPES = frozenset({
    "Tensor", "Tensor?", "number", "number?", "int", "int?", "bool", "bool?", "float",
    "float?", "str", "str?", "List[int]", "List[int]?", "List[bool]", "List[float]",
    "List[float]?", "ScalarType", "ScalarType?", "MemoryFormat", "MemoryFormat?",
    "List[Tensor]", "List[Optional[Tensor]]", "List[number]", "Generator?"})
_RETURN_TYPES = frozenset({"Tensor", "number", "int", "float", "bool", "List[Tensor]"})


def servable(op: torch._ops.OpOverload) -> bool:
    """Can ``op``'s host kernel be served in C++ (its schema alone decides)?"""
    p = plan_for(op)
    # (a random op draws in C++ from the CPU generator of the device's generator: the one
    # given, or through the CPU's default one, as the Python kernels do)
    # (an argument that must be a CPU tensor, foreach's ``scalars``: the Python kernel
    # checks it, hostexec.op_device)
    if p.is_view or p.has_device_arg or p.stride_blind_out or p.host_args \
            or (p.num_returns == 0 and not p.write_args) or torch.Tag.inplace_view in op.tags:
        return False
    name = op._schema.name.split("::")[1]
    if name.startswith(("resize", "set_", "_resize")):
        return False
    s = op._schema
    if any(_arg_type(a) not in _ARG_TYPES for a in s.arguments):
        return False
    if any(str(r.type) not in _RETURN_TYPES for r in s.returns):
        return False
    # written arguments: tensors or tensor lists (in-place, out=, the fused optimizers)
    return all(str(a.type) in ("Tensor", "List[Tensor]") for a in s.arguments
               if a.name in p.write_args)


def _arg_type(a: Any) -> str:
    t = a.real_type
    if isinstance(t, torch.OptionalType):
        return str(t.getElementType()) + "?"
    return str(t)


class HostOpKernels:
    """A backend's host-op kernels servable in C++, and which of the two sets serves."""

    def __init__(self, backend: DeviceBackend) -> None:
        self.backend = backend
        self.python: dict[str, Entry] = {}
        self._registered: torch.library.Library | None = None  # the Python ones, while serving
        self._kept: set[str] = set()  # served by their Python kernel whatever serves the rest
        self._kept_registered: torch.library.Library | None = None
        self._registered_names: frozenset[str] = frozenset()  # those in ``_registered``
        self.native = False
        self.staged_core = False  # STAGED_CORE served in C++ on device-only memory
        self._held = 0  # python_only() depth
        self._staged: bool | None = None  # staged(), once configured
        self._native_copies: NativeCopies | None = None  # the runtime's C copies C++ calls

    def add(self, name: str, op: torch._ops.OpOverload, kernel: Callable[..., Any], *,
            cpu_tensors: bool = False, composite: bool = False) -> None:
        """``op``'s Python host kernel, registered as ``name`` (by whichever set serves);
        ``cpu_tensors``: C++ also serves calls with CPU tensors of any size (a copy
        between the host and the device), which it passes to the CPU kernel as they are;
        ``composite``: a factory whose CPU kernel is PyTorch's composite one (``full``,
        ``arange``, ``zeros_like``), which C++ runs for the device as the CPU does (a call
        asking for pinned memory takes the Python kernel)."""
        plan = plan_for(op)
        self.python[name] = (kernel, not plan.write_args, cpu_tensors, composite,
                             bool(cuda_checked_args(plan)))
        if self.native:
            if name in self._kept:
                self._keep_registered({name: self.python[name]})
            else:
                self._enable({name: self.python[name]})
        elif self.staged_core and name in STAGED_CORE:
            self._drop_native()
            self.use(True)
        elif self._registered is not None:
            self._registered.impl(name, kernel, "PrivateUse1")
            self._registered_names |= {name}

    def remove(self, name: str) -> None:
        """Withdraw ``name``'s kernel (C++ and a Python library unregister all their kernels
        at once: the others are registered again, by whichever set served)."""
        from torchport.ops import fallback

        if self.python.pop(name, None) is None:
            return
        self._kept.discard(name)
        self._drop_native()
        if self._registered is not None:
            self._registered._destroy()
            self._registered = None
        self.use(not fallback.INTERCEPTING)

    def keep_in_python(self, name: str, keep: bool = True) -> None:
        """Serve ``name`` by its Python kernel even where C++ serves the others (it consults
        at call time what C++ does not: a vendor's ``copy_`` kernel), or no longer."""
        if keep == (name in self._kept):
            return
        if keep:
            self._kept.add(name)
        else:
            self._kept.discard(name)
        if name in self.python and (self.native or self.staged_core):
            self._drop_native()  # (C++ unregisters per library, not per op)
            self.use(True)

    def direct(self) -> bool:
        """Does the host read device memory at the device address, synchronously?"""
        rt = self.backend.runtime
        return not rt.asynchronous and self.backend.host_address_is_device_address

    def staged(self) -> bool:
        """Does the host reach device memory only through the runtime's copies, without C++
        queues, with the C++ device guard and caching allocator? Then the fallback's learnt
        calls run in C++ through those copies (``native_staged.cpp``)."""
        if self._staged is not None:
            return self._staged
        b = self.backend
        self._staged = False
        if b.runtime.host_addressable or b._guard_device is None or self.queues() is not None \
                or any(getattr(a, "new_tensor", None) is None for a in b.allocators):
            return False
        configure = native.python_function(
            "torchport_fallback_staged", [ctypes.py_object] * 6 + [ctypes.c_int], ctypes.c_int)
        if configure is None:
            return False
        rt = b.runtime
        c = rt.native_copies()
        self._native_copies = c  # (alive while C++ may call them)
        configure(rt.copy_d2h, rt.copy_h2d, _result_function(b), b.refused_dtypes(),
                  [b.phys(i) for i in range(b.device_count())],
                  None if c is None else (c.copy_d2h, c.copy_h2d, c.context, c.copy_d2d),
                  int(rt.asynchronous))
        self._staged = True
        return True

    def queues(self) -> list[int] | None:
        """The C++ queues of the devices' default streams, where the runtime is
        asynchronous, has them (the sim's ``native_queue``), and the host reads device
        memory at the device address: C++ then queues the calls the Python kernels taught
        it (``native_queued_ops.cpp``)."""
        b = self.backend
        rt = b.runtime
        queue = getattr(rt, "native_queue", None)
        if not rt.asynchronous or queue is None or not b.host_address_is_device_address:
            return None
        handles = [queue(b.visible[i]) for i in range(b.device_count())]
        return None if not handles or None in handles else handles

    def _library(self, staged: bool = False) -> Any:
        """The library's enable function, where C++ can serve the device (``staged``: on
        device-only memory, through the runtime's copies)."""
        b = self.backend
        if b._guard_device is None or not (
                self.staged() if staged else self.direct() or self.queues() is not None) \
                or any(getattr(a, "new_tensor", None) is None for a in b.allocators):
            return None
        return native.python_function(
            "torchport_native_hostops_enable",
            [ctypes.py_object, ctypes.py_object, ctypes.py_object, ctypes.c_int, ctypes.c_int64,
             ctypes.c_int64, ctypes.c_int], ctypes.c_int)

    def _enable(self, kernels: dict[str, Entry], staged: bool = False) -> bool:
        from torchport.memory.allocator import ADOPT_MIN_BYTES

        enable = self._library(staged)
        if enable is None:
            return False
        if self._registered is not None and not staged:  # never both registered
            self._registered._destroy()
            self._registered = None
            self._registered_names = frozenset()
        enable({n: k for n, k in kernels.items() if n not in self._kept},
               _result_function(self.backend), self.backend.refused_dtypes(),
               self.backend.device_count(),
               FUNCTIONAL_INPUT_MAX, ADOPT_MIN_BYTES - 1, int(staged))
        if staged:
            return True
        _queued(self.queues())
        self._keep_registered({n: k for n, k in kernels.items() if n in self._kept})
        return True

    def _keep_registered(self, kernels: dict[str, Entry]) -> None:
        """Register the kept ops' Python kernels beside the C++ ones."""
        if not kernels:
            return
        if self._kept_registered is None:
            self._kept_registered = keep_past_exit(torch.library.Library("aten", "IMPL"))
        for name, (kernel, *_) in kernels.items():
            self._kept_registered.impl(name, kernel, "PrivateUse1")

    def _drop_native(self) -> None:
        """Unregister the C++ kernels and the kept ops' Python ones."""
        cpp = native.loaded()
        if cpp is not None and hasattr(cpp, "torchport_native_hostops_disable"):
            cpp.torchport_native_hostops_disable()
        _queued(None)
        if self._kept_registered is not None:
            self._kept_registered._destroy()
            self._kept_registered = None
        self.native = self.staged_core = False
        from torchport.ops import fallback

        fallback.serve_learnt(False)

    @contextlib.contextmanager
    def python_only(self) -> Iterator[None]:
        """Within: the Python kernels serve whatever else switches (tests of their paths)."""
        from torchport.ops import fallback

        self._held += 1
        self.use(False)
        try:
            yield
        finally:
            self._held -= 1
            self.use(not fallback.INTERCEPTING)

    def use(self, from_cpp: bool) -> None:
        """Serve the ops from C++ (where it can) or from the Python kernels."""
        from torchport.ops import fallback
        if from_cpp and not self._held and self.python:
            if self.native:
                return
            if self._enable(self.python):
                native.enabled("host-op kernels")
                self.native = True
                fallback.serve_learnt(self.direct() or self.queues() is not None)
                return
        self._drop_native()
        staged = from_cpp and not self._held and self.staged()
        # on device-only memory C++ serves the core copies, the Python kernels the rest
        cpp = {n: e for n, e in self.python.items() if n in STAGED_CORE and n not in self._kept} \
            if staged and self._library(staged=True) is not None else {}
        names = frozenset(self.python) - frozenset(cpp)
        if self._registered is not None and self._registered_names != names:
            self._registered._destroy()  # (before C++ registers: never both registered)
            self._registered = None
        if cpp:
            self.staged_core = self._enable(cpp, staged=True)
        if self._registered is None:
            self._registered = keep_past_exit(torch.library.Library("aten", "IMPL"))
            self._registered_names = names
            for name in names:
                self._registered.impl(name, self.python[name][0], "PrivateUse1")
        if staged:
            fallback.serve_learnt(True)


def _queued(handles: list[int] | None) -> None:
    """Queue host ops from C++ on these default-stream queues (``None``: no longer), and
    let the Python kernels teach C++ what they queued (``switch.QUEUED_TEACH``)."""
    enable = native.python_function("torchport_queued_enable", [ctypes.py_object], ctypes.c_int)
    if enable is None:
        return
    enable(handles or [])
    if not handles:
        switch.QUEUED_TEACH = None
        return
    teach = native.python_function(
        "torchport_queued_teach",
        [ctypes.c_char_p, ctypes.c_char_p, ctypes.py_object, ctypes.py_object], ctypes.c_int)
    teach_copied = native.python_function(
        "torchport_queued_teach_copied",
        [ctypes.c_char_p, ctypes.c_char_p, ctypes.py_object], ctypes.c_int)

    def taught(op: torch._ops.OpOverload, out: torch._ops.OpOverload | None,
               specs: list | None, copied: bool = False) -> None:
        """``op`` queued in place (``out`` None), into new tensors laid out as ``specs``
        by its ``out=`` overload ``out``, or (``copied``) by its functional kernel whose
        list of results is copied into them."""
        name = op._schema.name.encode()
        overload = op._schema.overload_name.encode()
        layouts = [(s.size, s.stride, s.dtype, s.nbytes) for s in specs or ()]
        if copied:
            teach_copied(name, overload, layouts)
        elif out is None:
            teach(name, overload, None, None)
        else:
            teach(name, overload, (out._schema.name, out._schema.overload_name), layouts)

    switch.QUEUED_TEACH = taught


def _result_function(backend: DeviceBackend) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """A CPU result C++ does not copy itself, on device ``index`` (as the Python kernels
    move theirs: large ones adopted)."""
    def result(cpu: torch.Tensor, index: int) -> torch.Tensor:
        if cpu._is_zerotensor():
            cpu = torch.zeros(cpu.shape, dtype=cpu.dtype)
        return backend.result_to_device(cpu, index)
    return result


def counts() -> tuple[int, int, int]:
    """(calls served in C++, calls handed to the Python kernels, new results copied or
    converted after the CPU kernel made them in host memory) in this process."""
    return native.counters("torchport_native_hostops_counts", 3)  # type: ignore[return-value]


def install_fallback(fn: Callable[..., Any], routes: Iterable[torch._ops.OpOverload] = ()
                     ) -> bool:
    """Register C++'s boxed fallback for the device, calling ``fn`` for what it does not
    serve (the caller removed ``fn``'s registration), and as the device's kernel of the
    overloads ``routes``; False where the library cannot (nothing then registered)."""
    install = native.python_function("torchport_fallback_install", [ctypes.py_object],
                                     ctypes.c_int)
    route = native.python_function("torchport_fallback_route", [ctypes.c_char_p], ctypes.c_int)
    if install is None or route is None:
        return False
    try:
        install(fn)
        for op in routes:
            route(plan_for(op).overload_name.encode())
    except RuntimeError:
        uninstall_fallback()
        return False
    return True


def uninstall_fallback() -> None:
    """Remove C++'s boxed fallback (the caller registers the Python one)."""
    cpp = native.loaded()
    if cpp is not None and hasattr(cpp, "torchport_fallback_uninstall"):
        cpp.torchport_fallback_uninstall()


def serve_fallback(on: bool) -> None:
    """C++'s fallback serves the learnt overloads (True) or hands each call to Python."""
    cpp = native.loaded()
    if cpp is not None and hasattr(cpp, "torchport_fallback_serve"):
        cpp.torchport_fallback_serve(int(on))


def learn_fallback(op: torch._ops.OpOverload) -> bool:
    """Serve ``op``'s later fallback calls with a host-op kernel in C++ (its schema must be
    :func:`servable`); the calls it does not serve still reach the Python fallback."""
    learn = native.python_function(
        "torchport_fallback_learn", [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int,
                                     ctypes.c_int, ctypes.c_uint64, ctypes.c_int], ctypes.c_int)
    if learn is None:
        return False
    plan = plan_for(op)
    written = [plan.arg_names.index(n) for n in plan.written_args]
    stageable = all(i < 64 for i in written)  # (C++ takes them as a 64-bit mask)
    return bool(learn(op._schema.name.encode(), op._schema.overload_name.encode(),
                      int(not plan.written_args), int(bool(cuda_checked_args(plan))),
                      sum(1 << i for i in written if i < 64), int(stageable)))


def forget_fallback() -> None:
    """Forget the learnt overloads (the Python fallback decides their paths again)."""
    cpp = native.loaded()
    if cpp is not None and hasattr(cpp, "torchport_fallback_forget"):
        cpp.torchport_fallback_forget()


def fallback_counts() -> tuple[int, int]:
    """(overloads learnt, calls C++'s fallback handed to the Python one) in this process."""
    return native.counters("torchport_fallback_counts", 2)  # type: ignore[return-value]


def staging_buffer_counts() -> tuple[int, int]:
    """(host buffers the staged calls took from the C library, buffers they reused) in this
    process: a warm call on device-only memory reuses the buffers of the calls before it."""
    return native.counters("torchport_staging_buffer_counts", 2)  # type: ignore[return-value]


def _connect_fallback() -> None:
    """Give the fallback (a layer below, which cannot import this module) the functions that
    switch C++'s fallback."""
    from torchport.ops import fallback

    fallback.connect_cpp(sys.modules[__name__])


_connect_fallback()


def install(backend: DeviceBackend) -> None:
    """Serve the backend's servable host ops natively unless ops are slowed down."""
    from torchport.ops import fallback

    kernels = backend.host_op_kernels
    kernels.use(not fallback.INTERCEPTING)
    fallback.on_slow_change(lambda slow: kernels.use(not slow))
