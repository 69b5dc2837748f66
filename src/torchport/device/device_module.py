"""``torch.<device>``: the device module, mirroring ``torch.cuda``.

PyTorch looks attributes up on this module (AMP asks ``get_amp_supported_dtype``,
serialization ``device_count``, ``torch.manual_seed`` ``manual_seed_all``), so it is
a real module object, registered in ``sys.modules`` as ``torch.<device>``. Its names
are declared: :data:`EXPORTS` (and the private :data:`PYTORCH_PRIVATE` PyTorch calls),
plus what the feature layers (streams, amp, ...) add with :func:`add` as a backend
registers (:mod:`torchport.features`); ``module.__all__`` lists the public ones.
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

import torch

from torchport.core import native
from torchport.device import forking
from torchport.memory.allocator import format_size

if TYPE_CHECKING:
    from torchport.core.contracts import DeviceBackend

# The public names of every device module, torch.cuda's where torch.cuda has the name;
# ``backend`` (the Backend) and ``get_amp_supported_dtype`` (asked by autocast) are ours.
EXPORTS: tuple[str, ...] = (
    # devices
    "is_available", "is_initialized", "init", "device_count", "current_device",
    "set_device", "device", "device_of", "get_device_properties", "get_device_name",
    "get_device_capability", "synchronize",
    # memory
    "memory_stats", "memory_allocated", "max_memory_allocated", "memory_reserved",
    "max_memory_reserved", "reset_peak_memory_stats", "reset_max_memory_allocated",
    "reset_max_memory_cached", "reset_accumulated_memory_stats", "empty_cache",
    "mem_get_info", "set_per_process_memory_fraction", "get_per_process_memory_fraction",
    "memory_snapshot", "memory_summary", "list_gpu_processes", "OutOfMemoryError",
    # random numbers
    "default_generators", "manual_seed", "manual_seed_all", "seed", "seed_all",
    "initial_seed", "get_rng_state", "get_rng_state_all", "set_rng_state",
    "set_rng_state_all",
    # dtypes
    "get_amp_supported_dtype", "is_bf16_supported",
    # torchport's
    "backend",
)
# Private names PyTorch calls on a device module, as on torch.cuda.
PYTORCH_PRIVATE: tuple[str, ...] = ("_lazy_init", "_is_in_bad_fork")


def add(module: types.ModuleType, **names: Any) -> None:
    """Add a feature layer's names to a device module (public ones join ``__all__``)."""
    for name, value in names.items():
        setattr(module, name, value)
        if not name.startswith("_") and name not in module.__all__:
            module.__all__.append(name)


def make_device_module(backend: DeviceBackend) -> types.ModuleType:
    """``torch.<device>`` for ``backend`` with the names of :data:`EXPORTS`; the feature
    layers add theirs as the backend registers (:func:`add`)."""
    mod = types.ModuleType(f"torch.{backend.name}",
                           f"torch.{backend.name}: the {backend.name} device, mirroring torch.cuda.")
    b = backend

    def _index(device: Any = None) -> int:
        if isinstance(device, str) and device == b.name:
            return b.current_device()
        return b.index_of(device)

    # ---- devices ---------------------------------------------------------------
    def is_available() -> bool:
        return b.device_count() > 0

    def is_initialized() -> bool:
        return forking.used(b) and not b.bad_fork

    def init() -> None:
        """Initialise the device now (it is initialised on first use anyway)."""
        if b.bad_fork:
            raise forking.error(b)
        b.initialized = True

    def _lazy_init() -> None:
        init()

    def _is_in_bad_fork() -> bool:
        return b.bad_fork

    def device_count() -> int:
        return b.device_count()

    def current_device() -> int:
        return b.current_device()

    def set_device(device: Any) -> None:
        idx = _index(device)
        if idx >= 0:
            b.set_device(idx)

    class device:
        """Context manager that changes the current device (``torch.cuda.device``)."""

        def __init__(self, device: Any) -> None:
            self.idx = -1 if device is None or (isinstance(device, int) and device < 0) \
                else _index(device)
            self.prev = -1

        def __enter__(self) -> None:
            self.prev = b.current_device()
            if self.idx >= 0:
                b.set_device(self.idx)

        def __exit__(self, *exc: Any) -> bool:
            if self.idx >= 0:
                b.set_device(self.prev)
            return False

    class device_of(device):
        """Context manager that makes the device of ``obj`` current (CPU: no-op)."""

        def __init__(self, obj: Any) -> None:
            d = obj.device if obj.device.type == b.name else None
            super().__init__(d.index if d is not None else -1)

    def get_device_properties(device: Any = None):
        return b.runtime.get_device_properties(b.phys(_index(device)))

    def get_device_name(device: Any = None) -> str:
        return get_device_properties(device).name

    def get_device_capability(device: Any = None) -> tuple[int, int]:
        p = get_device_properties(device)
        return (p.major, p.minor)

    def synchronize(device: Any = None) -> None:
        b.synchronize(_index(device))

    # ---- memory ----------------------------------------------------------------
    def memory_stats(device: Any = None) -> dict[str, int]:
        return b.allocator(_index(device)).memory_stats()

    def memory_allocated(device: Any = None) -> int:
        return b.allocator(_index(device)).allocated()

    def max_memory_allocated(device: Any = None) -> int:
        return b.allocator(_index(device)).stat("allocated_bytes").peak

    def memory_reserved(device: Any = None) -> int:
        return b.allocator(_index(device)).reserved()

    def max_memory_reserved(device: Any = None) -> int:
        return b.allocator(_index(device)).stat("reserved_bytes").peak

    def reset_peak_memory_stats(device: Any = None) -> None:
        b.allocator(_index(device)).reset_peak()

    def reset_max_memory_allocated(device: Any = None) -> None:
        reset_peak_memory_stats(device)

    def reset_max_memory_cached(device: Any = None) -> None:
        reset_peak_memory_stats(device)

    def reset_accumulated_memory_stats(device: Any = None) -> None:
        b.allocator(_index(device)).reset_accumulated()

    def empty_cache() -> None:
        for a in b.allocators:
            a.empty_cache()

    def mem_get_info(device: Any = None) -> tuple[int, int]:
        return b.runtime.mem_get_info(b.phys(_index(device)))

    def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
        if not isinstance(fraction, float) or not 0 <= fraction <= 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        b.allocator(_index(device)).fraction = fraction

    def get_per_process_memory_fraction(device: Any = None) -> float:
        f = b.allocator(_index(device)).fraction
        return 1.0 if f is None else f

    def memory_snapshot() -> list[dict[str, Any]]:
        return [seg for a in b.allocators for seg in a.snapshot()]

    def memory_summary(device: Any = None, abbreviated: bool = False) -> str:
        return _summary(b, _index(device), memory_stats(device))

    def list_gpu_processes(device: Any = None) -> str:
        return f"{b.name}:{_index(device)}: process listing is not available for {b.name}"

    # ---- random numbers --------------------------------------------------------
    # One state per device, shared by its random ops (which draw from the CPU generator
    # b.generators[i]) and, with the C++ library, by the device's default generator, a
    # torch.Generator of the device holding that CPU generator (native_generator.cpp).
    device_generators = native.use_generators(b.generators)
    if device_generators is not None:
        b.default_generators = device_generators
    default_generators = b.default_generators

    def manual_seed(seed: int) -> None:
        b.generators[b.current_device()].manual_seed(int(seed))

    def manual_seed_all(seed: int) -> None:
        seed = int(seed)
        for g in b.generators:
            g.manual_seed(seed)

    def seed() -> None:
        b.generators[b.current_device()].seed()

    def seed_all() -> None:
        s = torch.Generator().seed()
        manual_seed_all(s)

    def initial_seed() -> int:
        return b.generators[b.current_device()].initial_seed()

    def get_rng_state(device: Any = b.name) -> torch.Tensor:
        return b.generators[_index(device)].get_state()

    def get_rng_state_all() -> list[torch.Tensor]:
        return [g.get_state() for g in b.generators]

    def set_rng_state(new_state: torch.Tensor, device: Any = b.name) -> None:
        b.generators[_index(device)].set_state(new_state.clone().cpu())

    def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
        for i, s in enumerate(new_states):
            b.generators[i].set_state(s.clone().cpu())

    # ---- dtypes ----------------------------------------------------------------
    def get_amp_supported_dtype() -> list[torch.dtype]:
        return [d for d in (torch.float16, torch.bfloat16)
                if d not in b.runtime.unsupported_dtypes]

    def is_bf16_supported(including_emulation: bool = True) -> bool:
        return torch.bfloat16 not in b.runtime.unsupported_dtypes

    OutOfMemoryError = torch.OutOfMemoryError
    # only the declared names go out: a helper defined above and not declared stays here
    defined = locals()
    for name in EXPORTS + PYTORCH_PRIVATE:
        setattr(mod, name, defined[name])
    mod.__all__ = list(EXPORTS)
    sys.modules[mod.__name__] = mod
    return mod


def _summary(b: DeviceBackend, index: int, st: dict[str, int]) -> str:
    """A ``torch.cuda.memory_summary``-style table."""
    rows = [("Allocated memory", "allocated_bytes", True),
            ("Active memory", "active_bytes", True),
            ("Requested memory", "requested_bytes", True),
            ("Reserved memory", "reserved_bytes", True),
            ("Non-releasable memory", "inactive_split_bytes", True),
            ("Allocations", "allocation", False),
            ("Active allocs", "active", False),
            ("Reserved segments", "segment", False),
            ("Non-releasable allocs", "inactive_split", False)]
    line = "|" + "=" * 75 + "|"
    out = [line,
           f"|{'PyTorch ' + b.name.upper() + ' memory summary, device ID ' + str(index):^75}|",
           "|" + "-" * 75 + "|",
           f"|  {b.name.upper()} OOMs: {st['num_ooms']:<12}| "
           f"{b.name}Malloc retries: {st['num_alloc_retries']:<27}|",
           line,
           "|        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  |",
           "|" + "-" * 75 + "|"]
    for title, key, is_bytes in rows:
        for pool in ("all", "large_pool", "small_pool"):
            vals = [st[f"{key}.{pool}.{m}"] for m in ("current", "peak", "allocated", "freed")]
            cells = [format_size(v).replace(" bytes", " B") if is_bytes else str(v) for v in vals]
            label = title if pool == "all" else f"      from {pool.replace('_pool', '')} pool"
            out.append(f"| {label:<22}|" + "|".join(f" {c:>10} " for c in cells) + "|")
        out.append("|" + "-" * 75 + "|")
    out.append(line)
    return "\n".join(out) + "\n"

