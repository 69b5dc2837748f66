"""The device for TorchDynamo: a ``DeviceInterface`` over ``torch.<device>``.

Dynamo and inductor look a device up with ``torch._dynamo.device_interface.
get_interface_for_device``: current device, count, streams, events, synchronisation,
properties, memory. Importing ``torch._dynamo`` costs seconds, so the interface is
registered when that module is first imported (an import hook that removes itself), or at
once if it already is.
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING, Any

import torch

from torchport.core import lazy

if TYPE_CHECKING:
    from torchport.core.contracts import DeviceBackend

_MODULE = "torch._dynamo.device_interface"


def make_interface(backend: DeviceBackend, di: types.ModuleType) -> type:
    """The ``DeviceInterface`` subclass of ``backend``'s device module."""
    mod = backend.device_module
    name = backend.name
    worker_device: dict[str, int] = {}

    class Worker:
        """What inductor's compile workers ask, without touching the device there."""

        @staticmethod
        def set_device(device: int) -> None:
            worker_device[name] = device

        @staticmethod
        def current_device() -> int:
            return worker_device.get(name, mod.current_device())

        @staticmethod
        def get_device_properties(device: torch.types.Device = None) -> Any:
            if device is None:
                device = Worker.current_device()
            return mod.get_device_properties(device)

    def exchange_device(device: int) -> int:
        prev = mod.current_device()
        if device >= 0 and device != prev:
            mod.set_device(device)
        return prev

    def get_compute_capability(device: torch.types.Device = None) -> int:
        major, minor = mod.get_device_capability(device)
        return major * 10 + minor

    def get_raw_stream(device_index: int) -> int:
        return mod.current_stream(device_index).stream_id

    def set_stream_by_id(stream_id: int, device_index: int, device_type: int) -> None:
        mod.set_stream(mod.Stream(stream_id=stream_id, device_index=device_index,
                                  device_type=device_type))

    def is_bf16_supported(including_emulation: bool = False) -> bool:
        return torch.bfloat16 not in backend.runtime.unsupported_dtypes

    attrs = {
        "__doc__": f"TorchDynamo's view of the {name} device (torch.{name}).",
        "device": mod.device, "Event": mod.Event, "Stream": mod.Stream, "Worker": Worker,
        "current_device": staticmethod(mod.current_device),
        "set_device": staticmethod(mod.set_device),
        "device_count": staticmethod(mod.device_count),
        "is_available": staticmethod(mod.is_available),
        "stream": staticmethod(mod.stream),
        "current_stream": staticmethod(mod.current_stream),
        "set_stream": staticmethod(mod.set_stream),
        "_set_stream_by_id": staticmethod(set_stream_by_id),
        "get_raw_stream": staticmethod(get_raw_stream),
        "synchronize": staticmethod(mod.synchronize),
        "get_device_properties": staticmethod(mod.get_device_properties),
        "get_compute_capability": staticmethod(get_compute_capability),
        "exchange_device": staticmethod(exchange_device),
        "maybe_exchange_device": staticmethod(exchange_device),
        "memory_allocated": staticmethod(mod.memory_allocated),
        "is_bf16_supported": staticmethod(is_bf16_supported),
    }
    return type(f"{name.capitalize()}Interface", (di.DeviceInterface,), attrs)


def _register(backend: DeviceBackend, di: types.ModuleType) -> None:
    di.register_interface_for_device(backend.name, make_interface(backend, di))


# Traced by dynamo: transfer's stand-ins for torch's functions (``torch.arange`` mapping
# ``device="cuda"``) are traced as the functions they stand for.
_TRACED = frozenset({"transfer"})


def _skip_torchport(trace_rules: types.ModuleType) -> None:
    """Dynamo must not trace torchport's own frames: its kernels are the device's code,
    called by the dispatcher (as CUDA's C++ kernels are), also while a compiled
    function runs eagerly after a graph break. Every module is skipped but those of
    ``_TRACED``; the skip pattern is rebuilt (dynamo caches it from its first use)."""
    import pkgutil
    from pathlib import Path

    package = Path(__file__).parents[1]  # torchport's folder (this module is in graph/)
    for module in pkgutil.iter_modules([str(package)]):
        if module.name not in _TRACED:
            trace_rules.add(f"{package.name}.{module.name}")
    trace_rules.SKIP_DIRS.append(str(package / "__init__.py"))
    recompile = trace_rules._recompile_re
    getattr(recompile, "cache_clear", lambda: None)()
    recompile()


def install(backend: DeviceBackend) -> None:
    lazy.when_imported(_MODULE, lambda di: _register(backend, di))
    lazy.when_imported("torch._dynamo.trace_rules", _skip_torchport)
