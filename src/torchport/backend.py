"""Registering a backend: PrivateUse1 renamed, device module, kernels, fallback.

A :class:`Backend` binds a device name to a :class:`~torchport.runtime.Runtime`
and a kernel set. PyTorch has one PrivateUse1 key, so a process hosts one
backend: registering the same one again is a no-op; a different one is an error.
"""

from __future__ import annotations

import atexit
import functools
import sys
import threading
from collections.abc import Iterable
from typing import Any

import torch

from torchport.core import native, settings
from torchport.core.collector import collector_paused
from torchport.core.contracts import BackendError
from torchport.core.libraries import keep_past_exit
from torchport.memory import qtensors, tensors
from torchport.memory.allocator import (
    ADOPT_MIN_BYTES,
    DeviceAllocator,
    NativeAllocator,
    make_allocators,
)
from torchport.ops.quantized import check_available
from torchport.runtime import Runtime

_ACTIVE: Backend | None = None
_CPU_KS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_set_storage = torch.ops.aten.set_.source_Storage_storage_offset
DEFAULT_SEED = 67280421310721  # CUDA's default generator seed
QUANTIZED_DTYPES = frozenset({torch.qint8, torch.quint8, torch.qint32, torch.quint4x2,
                              torch.quint2x4})


def parse_visible_devices(text: str | None, count: int) -> list[int]:
    """``TORCHPORT_VISIBLE_DEVICES`` -> physical indices, like ``CUDA_VISIBLE_DEVICES``:
    a comma list of indices; the list stops at the first invalid entry."""
    if text is None:
        return list(range(count))
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part.lstrip("-").isdigit():
            break
        i = int(part)
        if i < 0 or i >= count or i in out:
            break
        out.append(i)
    return out


class Backend:
    """A device type made from a runtime and kernels."""

    def __init__(self, name: str, runtime: Runtime, kernels: Iterable[Any] = ()) -> None:
        self.name = name
        self.runtime = runtime
        self.kernel_sets = list(kernels)
        self.visible = parse_visible_devices(settings.get("TORCHPORT_VISIBLE_DEVICES"),
                                             runtime.device_count())
        # the Python allocators until registration, which may give the device the C++ ones
        self.allocators: list[DeviceAllocator] | list[NativeAllocator] = [
            DeviceAllocator(runtime, p, i, name) for i, p in enumerate(self.visible)]
        self._devices: list[torch.device] | None = None
        self.stream_hook: Any = None  # index -> current stream handle (set by the stream layer)
        # the state of each device's random numbers: its random ops draw from it, and with
        # the C++ library it is the state of the device's default generator too
        self.generators = [torch.Generator().manual_seed(DEFAULT_SEED) for _ in self.visible]
        # torch.<device>.default_generators: these, or (made at registration, with the C++
        # library) torch.Generator objects of the device holding them
        self.default_generators: tuple[torch.Generator, ...] = tuple(self.generators)
        self._tls = threading.local()
        self._guard_device: native.GuardDevice | None = None
        self.initialized = False  # some device memory was taken from the runtime
        self.bad_fork = False
        self.device_module: Any = None
        self.registered = False
        self.pinned_memory = False  # pin_memory() gives pinned memory (the C++ hooks serve)
        self.pinned_host_memory: Any = None  # the runtime's host_alloc/host_free callbacks, in use
        self._libs: list[torch.library.Library] = []
        from torchport.ops.native_views import ViewKernels
        self.view_kernels = ViewKernels()  # C++ view kernels, or the Python ones
        from torchport.ops.native_hostops import HostOpKernels
        self.host_op_kernels = HostOpKernels(self)  # C++ host-op kernels, or the Python ones
        self._keep_alive: list[tuple[int, Any, Any]] = []

    # ---- devices ------------------------------------------------------------
    def device_count(self) -> int:
        return len(self.visible)

    def phys(self, index: int | None) -> int:
        """Physical runtime index of logical device ``index`` (``None``: current)."""
        return self.visible[self.check_index(index)]

    def check_index(self, index: int | None) -> int:
        if index is None:
            index = self.current_device()  # valid, unless no device is visible
        if not isinstance(index, int) or not 0 <= index < len(self.visible):
            raise torch.AcceleratorError(
                f"{self.name}: invalid device ordinal {index}; {len(self.visible)} {self.name} "
                f"device(s) are visible (TORCHPORT_VISIBLE_DEVICES="
                f"{settings.raw('TORCHPORT_VISIBLE_DEVICES', 'unset')})"
            ) if hasattr(torch, "AcceleratorError") else RuntimeError(
                f"{self.name}: invalid device ordinal {index}")
        return index

    def current_device(self) -> int:
        """This thread's current device: the C++ guard's, once registered with the native
        library (one state with ``torch.accelerator`` and PyTorch's index resolution)."""
        g = self._guard_device
        return getattr(self._tls, "device", 0) if g is None else g.get()

    def set_device(self, index: int) -> None:
        index = self.check_index(index)
        g = self._guard_device
        if g is None:
            self._tls.device = index
        else:
            g.set(index)

    def index_of(self, device: Any) -> int:
        """Logical index named by a device spec (``torch.device``, str, int, None)."""
        if device is None:
            return self.check_index(None)
        if isinstance(device, int):
            return self.check_index(device)
        d = torch.device(device)
        if d.type != self.name:
            raise ValueError(f"expected a {self.name} device, got {d}")
        return self.check_index(d.index)

    @property
    def devices(self) -> list[torch.device]:
        """``torch.device`` of each logical index (made once PrivateUse1 bears our name)."""
        if self._devices is None:
            self._devices = [torch.device(self.name, i) for i in range(len(self.visible))]
        return self._devices

    def allocator(self, index: int | None) -> DeviceAllocator | NativeAllocator:
        return self.allocators[self.check_index(index)]

    # ---- tensors ------------------------------------------------------------
    def refused_dtypes(self) -> list[torch.dtype]:
        """The dtypes the dense kernels refuse (quantized ones: PyTorch keys those tensors
        ``QuantizedPrivateUse1``, :mod:`torchport.ops.quantized`; the runtime's unsupported
        ones), for the C++ kernels to hand to :meth:`check_dtype`'s error."""
        return sorted(QUANTIZED_DTYPES | set(self.runtime.unsupported_dtypes), key=str)

    def check_dtype(self, dtype: torch.dtype) -> None:
        if dtype in self.runtime.unsupported_dtypes:
            raise TypeError(
                f"{self.name} does not support {dtype} (the runtime declares it unsupported); "
                f"cast to a supported dtype first, e.g. .to(torch.float32)")
        if dtype in QUANTIZED_DTYPES:
            raise TypeError(
                f"{self.name}'s dense kernels got a quantized dtype ({dtype}): a quantized "
                f"tensor needs quantization parameters; make it with torch.quantize_per_tensor"
                f"/quantize_per_channel or torch._empty_affine_quantized(..., device=...)")

    def empty_strided(self, size, stride, dtype: torch.dtype | None,
                      device: Any = None, *, given_strides: bool = True) -> torch.Tensor:
        """A new device tensor with exactly these size/strides, memory from the allocator
        (``given_strides``: the caller's, not computed from a memory format, which PyTorch's
        errors name)."""
        dtype = dtype or torch.get_default_dtype()
        self.check_dtype(dtype)
        index = self.index_of(device)
        size, stride = list(size), list(stride)
        nbytes = tensors.check_layout(size, stride, dtype.itemsize, given_strides=given_strides)
        return self._new_tensor(index, size, stride, dtype, nbytes)

    def _new_tensor(self, index: int, size, stride, dtype: torch.dtype,
                    nbytes: int) -> torch.Tensor:
        hook = self.stream_hook
        return tensors.new_device_tensor(self.devices[index], self.allocators[index], nbytes,
                                         dtype, size, stride,
                                         None if hook is None else hook(index))

    def empty(self, size, dtype: torch.dtype | None = None, device: Any = None) -> torch.Tensor:
        return self.empty_strided(size, tensors.contiguous_strides(size), dtype, device,
                                  given_strides=False)

    def synchronize(self, index: int | None = None) -> None:
        """Wait for all work on a device (``torch.<device>.synchronize``)."""
        self.runtime.synchronize(self.phys(index))

    def current_stream_handle(self, index: int) -> Any:
        """The runtime stream new work on ``index`` goes to (``None``: default stream)."""
        hook = self.stream_hook
        return None if hook is None else hook(index)

    def keep_alive_until_stream(self, phys: int, stream: Any, obj: Any) -> None:
        """Hold a host buffer until an asynchronous copy on ``stream`` has run."""
        self._keep_alive.append((phys, stream, obj))
        if len(self._keep_alive) > 64:
            self._keep_alive = [e for e in self._keep_alive
                                if not self.runtime.query_stream(e[0], e[1])]

    def to_device(self, cpu: torch.Tensor, index: int) -> torch.Tensor:
        """Move a CPU tensor to logical device ``index`` keeping its strides when dense."""
        if cpu.is_quantized:
            return self._quantized_to_device(cpu, index)
        if cpu.is_contiguous() or tensors.is_non_overlapping_and_dense(cpu):
            dtype = cpu.dtype
            if dtype in self.runtime.unsupported_dtypes:
                self.check_dtype(dtype)
            n = cpu.numel() * dtype.itemsize  # dense: the span is exactly the elements
            out = self._new_tensor(index, cpu.shape, cpu.stride(), dtype, n)
            if n:  # same layout, one span: a single copy of its bytes
                self.runtime.copy_h2d(self.visible[index], out.data_ptr(), cpu.data_ptr(), n)
            return out
        out = self.empty(cpu.shape, cpu.dtype, index)
        tensors.write_from_host(self, out, cpu)
        return out

    def _quantized_to_device(self, cpu: torch.Tensor, index: int) -> torch.Tensor:
        """A quantized CPU tensor on device ``index``: its integers copied into device memory
        under a device tensor with the same quantization parameters (dense layouts kept)."""
        check_available(self)
        if cpu.dtype in self.runtime.unsupported_dtypes:
            self.check_dtype(cpu.dtype)
        if cpu.storage_offset() or not (cpu.is_contiguous()
                                         or tensors.is_non_overlapping_and_dense(cpu)):
            cpu = cpu.clone(memory_format=torch.contiguous_format)
        n = qtensors.dense_bytes(cpu)
        storage = self.empty([n], torch.uint8, index).untyped_storage()
        if n:
            self.runtime.copy_h2d(self.visible[index], storage.data_ptr(), cpu.data_ptr(), n)
        return qtensors.over_storage(cpu, storage, 0, cpu.shape, cpu.stride())

    @functools.cached_property
    def host_address_is_device_address(self) -> bool:
        """Does the host reach a block at the block's device address itself (a unified-
        memory device, the sim by default)? Then C++ kernels may read ``data_ptr()``."""
        rt = self.runtime
        if not rt.host_addressable or not self.visible:
            return False
        ptr = rt.malloc(self.visible[0], 64)
        if ptr is None:
            return False
        try:
            return rt.host_address(ptr) == ptr
        finally:
            rt.free(self.visible[0], ptr)

    @functools.cached_property
    def adopts_host(self) -> bool:
        """Does the runtime take host memory as device memory (:meth:`Runtime.adopt_host`)?"""
        return type(self.runtime).adopt_host is not Runtime.adopt_host

    def result_to_device(self, cpu: torch.Tensor, index: int) -> torch.Tensor:
        """A CPU result nothing else uses, on device ``index``: a large one is adopted by
        the runtime where it can (no copy), anything else is copied (:meth:`to_device`)."""
        if cpu.dtype in self.runtime.unsupported_dtypes:
            self.check_dtype(cpu.dtype)
        st = cpu.untyped_storage()
        n = st.nbytes()
        if n >= ADOPT_MIN_BYTES and not cpu.is_quantized and self.adopts_host and cpu.storage_offset() == 0 \
                and n == cpu.numel() * cpu.element_size() \
                and torch._C._storage_Use_Count(st._cdata) <= 2 \
                and (cpu.is_contiguous() or tensors.is_non_overlapping_and_dense(cpu)):  # 2: cpu, st
            alloc = self.allocators[index]
            stream = self.current_stream_handle(index)
            adopted_tensor = getattr(alloc, "adopted_tensor", None)
            if adopted_tensor is not None:  # the C++ allocator: its storage frees it
                t = adopted_tensor(st, cpu.dtype, cpu.shape, cpu.stride(), stream)
                return self.to_device(cpu, index) if t is None else t
            block = alloc.adopt(st, stream)
            if block is not None:
                return tensors.wrap_block(self.devices[index], alloc, block, n, cpu.dtype,
                                          list(cpu.shape), list(cpu.stride()))
        return self.to_device(cpu, index)

    def host_sync(self, index: int) -> None:
        """Before the host reads or writes device memory itself (host views, blocking
        copies, the CPU fallback): with an asynchronous runtime, let the work queued on
        the current stream finish and report its errors -- CUDA's order for a blocking
        copy or an op issued on that stream."""
        if self.runtime.asynchronous:
            self.runtime.synchronize_stream(self.visible[index], self.current_stream_handle(index))

    def host_view(self, t: torch.Tensor) -> torch.Tensor:
        """A CPU tensor aliasing ``t``'s memory (host-addressable runtimes only)."""
        return tensors.host_view(self, t)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """CPU tensor with ``t``'s values: an alias when host-addressable, else a copy."""
        self.host_sync(t.device.index)
        if self.runtime.host_addressable:
            return tensors.host_view(self, t)
        return tensors.read_to_host(self, t)

    def write_tensor(self, dev: torch.Tensor, cpu: torch.Tensor, non_blocking: bool = False) -> None:
        """Store CPU values ``cpu`` (broadcastable, any dtype) into device tensor ``dev``."""
        if non_blocking and self.runtime.asynchronous and self._queue_from_pinned(dev, cpu):
            return
        self.host_sync(dev.device.index)
        if self.runtime.host_addressable:
            tensors.host_view(self, dev).copy_(cpu)
            return
        if dev.is_quantized:  # the CPU's quantized copy into a copy of the span, stored
            span = tensors.read_to_host(self, dev)
            span.copy_(cpu)
            tensors.store_span(self, dev, span)
            return
        stream = self.current_stream_handle(dev.device.index) if non_blocking else None
        tensors.write_from_host(self, dev, cpu.expand(dev.shape), stream)

    def _queue_from_pinned(self, dev: torch.Tensor, cpu: torch.Tensor) -> bool:
        """A non-blocking copy of pinned host memory into a dense tensor of its dtype is
        queued on the current stream as it is, as CUDA queues one from page-locked memory:
        the host goes on at once, and the pinned block stays alive until the copy ran."""
        if cpu.dtype != dev.dtype or cpu.shape != dev.shape or not cpu.is_contiguous() \
                or not tensors.is_dense_row_major(dev) or not cpu.is_pinned():
            return False
        index = dev.device.index
        phys, stream = self.phys(index), self.current_stream_handle(index)
        self.runtime.copy_h2d(phys, dev.data_ptr(), cpu.data_ptr(),
                              dev.numel() * dev.element_size(), stream)
        self.keep_alive_until_stream(phys, stream, cpu)
        return True

    def grow_storage(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Grow a device storage to at least ``nbytes`` in place, as a tensor's ``resize_``
        or ``set_`` past the storage's end does on CUDA."""
        if nbytes > storage.nbytes():
            storage.resize_(nbytes)  # the C++ hooks' resize, or torchport's in Python

    def resize_device_tensor(self, t: torch.Tensor, size, stride) -> None:
        """``resize_`` semantics: grow the storage when needed, keeping its bytes -- in
        place, as CUDA does, so that every tensor sharing it sees the new memory."""
        size, stride = list(size), list(stride)
        self.grow_storage(t.untyped_storage(), tensors.check_layout(
            size, stride, t.element_size(), t.storage_offset(), sizes_first=True,
            given_strides=False))
        _set_storage.redispatch(_CPU_KS, t, t.untyped_storage(), t.storage_offset(), size,
                                stride)

    def library(self, ns: str = "aten") -> torch.library.Library:
        """A registration library of this backend's (``torch.library.Library(ns, "IMPL")``),
        alive as long as the process, exit handlers included."""
        lib = keep_past_exit(torch.library.Library(ns, "IMPL"))
        self._libs.append(lib)
        return lib

    def add_kernels(self, ks: Any) -> list[str]:
        """Add a :class:`~torchport.ops.KernelSet` (also after registration); returns the
        overloads it made native (ones that already have a kernel keep it)."""
        self.kernel_sets.append(ks)
        if not self.registered:
            return []
        from torchport.ops import registry
        return registry.add_kernel_set(self, ks)

    def remove_kernels(self, ks: Any) -> None:
        """Withdraw a :class:`~torchport.ops.KernelSet` added with :meth:`add_kernels`:
        its overloads take the path they took before it. A set given at registration
        stays (``ValueError``); none of its kernels may be running in another thread."""
        if not any(k is ks for k in self.kernel_sets):
            raise ValueError(f"kernel set {getattr(ks, 'name', ks)!r} is not one of backend "
                             f"{self.name!r}'s; add it with add_kernels first")
        if self.registered:
            from torchport.ops import registry
            registry.remove_kernel_set(self, ks)
        self.kernel_sets = [k for k in self.kernel_sets if k is not ks]

    # ---- registration -------------------------------------------------------
    def register(self) -> Backend:
        """Make the device usable from PyTorch; idempotent."""
        with collector_paused():
            return self._register()

    def _register(self) -> Backend:
        global _ACTIVE
        if _ACTIVE is not None:
            if _ACTIVE is self:
                return self
            raise BackendError(
                f"cannot register backend {self.name!r}: backend {_ACTIVE.name!r} already owns "
                f"PrivateUse1 in this process (PyTorch allows one); use a separate process")
        current = torch._C._get_privateuse1_backend_name()
        if current != "privateuseone" and current != self.name:
            raise BackendError(f"PrivateUse1 is already renamed to {current!r} by another plug-in")
        from torchport import features
        from torchport.core import interrupts
        from torchport.device import (
            accelerator_memory,
            device_module,
            forking,
            profiling,
            serialization,
            streams,
            tensor_types,
        )
        from torchport.graph import dynamo_device
        from torchport.memory import pinned
        from torchport.ops import registry

        # the device's caching allocators: C++ where the library loads (nothing was
        # allocated before registration)
        self.allocators = make_allocators(self.runtime, self.visible, self.name)
        # Ctrl-C as C++ calls into Python (the allocator's, the streams' callbacks) is held
        # until the callback returned
        interrupts.enable()
        self.device_module = device_module.make_device_module(self)
        features.install(self, self.device_module)
        _ACTIVE = self
        try:
            # the hooks in C++ (pinned memory), where the library loads; first, since the
            # set-up below keeps hooks registered before its Python ones
            hooks_in_cpp = native.use_hooks(self.device_count())
            torch.utils.backend_registration._setup_privateuseone_for_python_backend(
                self.name, backend_module=self.device_module, hook=_Hooks(self),
                device_guard=_Guard())
            # the guard in C++, where the library loads: the real current device
            self._guard_device = native.use_guard(self.device_count())
            if self._guard_device is not None:  # its streams and events are the device's
                streams.connect_guard(self, self._guard_device)
                self._guard_device.set_unsupported(set(self.runtime.unsupported_dtypes))
            torch.utils.generate_methods_for_privateuse1_backend(
                for_tensor=False, for_module=False, for_packed_sequence=False, for_storage=True,
                unsupported_dtype=list(self.runtime.unsupported_dtypes))
            registry.install(self)
            serialization.install(self, storages_in_cpp=accelerator_memory.install(self))
            tensor_types.install(self)
            forking.install(self)
            dynamo_device.install(self)
            pinned.install(self, hooks_in_cpp)
            profiling.install(self)
            if self._guard_device is None:
                self._autograd_in_calling_threads()
            else:
                # after the exit handlers registered above run: last out, first in
                atexit.register(self._settle_autograd_threads)
        except Exception:
            _ACTIVE = None
            raise
        self.registered = True
        return self


    def _settle_autograd_threads(self) -> None:
        """At exit, before the interpreter finalizes: let autograd's device threads finish
        their last task. PyTorch's engine (2.13) keeps a Python object in each backward's
        graph task (``_engine_run_backward`` stashes a ``contextvars`` context in the
        thread-local state the task copies); the device thread that ran the last node can
        drop the task's last reference after the caller went on, and then needs the GIL --
        during finalization Python ends such a thread inside a C++ destructor, and the
        process aborts ("terminate called without an active exception"; CUDA's device
        threads are no different). A backward per device through the engine directly
        (no stashed context) queues behind that epilogue and returns after it. It runs a
        view's backward and the leaf's gradient accumulator, which takes the view as it is:
        no kernel runs (an error an asynchronous device still holds stays for the handler
        that reports it), and its graph task holds nothing of Python's."""
        from torchport.device import forking

        if not forking.used(self) or self.bad_fork \
                or isinstance(getattr(sys, "last_value", None), KeyboardInterrupt):
            return  # (after Ctrl-C, queued device work is abandoned, not waited for)
        engine = torch.autograd.variable.Variable._execution_engine
        try:
            with torch.enable_grad(), torch.autograd.set_multithreading_enabled(True):
                for device in self.devices:
                    leaf = torch.empty((), device=device, requires_grad=True)
                    engine.run_backward((leaf.view(()),), (torch.empty((), device=device),),
                                        False, False, (), True, True)
        except Exception:  # noqa: BLE001 -- exiting: the device may be gone already
            pass

    def _autograd_in_calling_threads(self) -> None:
        """Without the C++ guard PyTorch's Python guard reports one device, and the autograd
        engine's per-device threads would assert on an index >= 1; its switch to run backward
        in the calling thread is per thread, so it is turned on here and in every thread at
        its first device allocation (backward makes its first gradient on the device)."""
        torch.autograd.set_multithreading_enabled(False)
        done = threading.local()
        done.off = True
        for alloc in self.allocators:
            def malloc(nbytes: int, stream: Any = None, _malloc: Any = alloc.malloc) -> Any:
                if not getattr(done, "off", False):
                    done.off = True
                    torch.autograd.set_multithreading_enabled(False)
                return _malloc(nbytes, stream)

            alloc.malloc = malloc  # type: ignore[method-assign]


def active_backend() -> Backend:
    if _ACTIVE is None:
        raise BackendError("no torchport backend is registered; import torchport.sim "
                           "(or your vendor backend) first")
    return _ACTIVE


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    def __init__(self, backend: Backend) -> None:
        super().__init__()
        self.backend = backend

    def is_available(self) -> bool:
        return self.backend.device_count() > 0

    def has_primary_context(self, dev_id: int) -> bool:
        return 0 <= dev_id < self.backend.device_count()

    def is_built(self) -> bool:
        return True


_PRIVATE_USE1 = torch._C._autograd.DeviceType.PrivateUse1


class _Guard(torch._C._acc.DeviceGuard):
    """PyTorch's Python-backend guard; ``native_guard.cpp`` replaces it where it can."""

    def type_(self):  # called from C++ by autograd for every node on the device: kept minimal
        return _PRIVATE_USE1
