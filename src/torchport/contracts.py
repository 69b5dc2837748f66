"""What the layers below registration know of a backend: the :class:`DeviceBackend` protocol.

:class:`torchport.backend.Backend` is the one implementation. It sits in the registration
layer, above the memory, op and integration layers it installs; those layers receive the
backend as an argument and name its type here, so that none of them imports the module
that imports them (``docs/architecture.md``, Layers; ``make lint`` checks it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # annotations only
    import types

    import torch

    from torchport.runtime import Runtime


class BackendError(RuntimeError):
    """A backend cannot be registered or used as asked."""


class DeviceBackend(Protocol):
    """A registered device type: its runtime, devices, memory and kernels."""

    name: str  # the device type's name ("sim"), PrivateUse1 renamed
    runtime: Runtime
    visible: list[int]  # logical index -> the runtime's physical index
    allocators: list[Any]  # torchport.allocator.DeviceAllocator, one per logical device
    generators: list[torch.Generator]  # each device's random state (CPU generators)
    default_generators: tuple[torch.Generator, ...]
    stream_hook: Any  # logical index -> current stream handle (set by the stream layer)
    device_module: types.ModuleType | None  # torch.<device>, made at registration
    view_kernels: Any  # torchport.ops.native_views.ViewKernels
    host_op_kernels: Any  # torchport.ops.native_hostops.HostOpKernels
    kernel_sets: list[Any]
    registered: bool  # Backend.register() has completed
    initialized: bool  # some device memory was taken from the runtime
    bad_fork: bool  # this process was forked after the device was used
    pinned_memory: bool  # pin_memory() gives pinned memory (the C++ hooks serve)
    pinned_host_memory: Any  # the runtime's host_alloc/host_free callbacks, in use
    _guard_device: Any  # the C++ device guard's current device, or None

    @property
    def devices(self) -> list[torch.device]: ...
    @property
    def adopts_host(self) -> bool: ...

    # devices
    def device_count(self) -> int: ...
    def phys(self, index: int | None) -> int: ...
    def check_index(self, index: int | None) -> int: ...
    def current_device(self) -> int: ...
    def set_device(self, index: int) -> None: ...
    def index_of(self, device: Any) -> int: ...
    def allocator(self, index: int | None) -> Any: ...  # DeviceAllocator
    def synchronize(self, index: int | None = None) -> None: ...
    def current_stream_handle(self, index: int) -> Any: ...
    def keep_alive_until_stream(self, phys: int, stream: Any, obj: Any) -> None: ...

    # tensors
    def check_dtype(self, dtype: torch.dtype) -> None: ...
    def empty(self, size: Any, dtype: torch.dtype | None = None,
              device: Any = None) -> torch.Tensor: ...
    def empty_strided(self, size: Any, stride: Any, dtype: torch.dtype | None,
                      device: Any = None) -> torch.Tensor: ...
    def _new_tensor(self, index: int, size: Any, stride: Any, dtype: torch.dtype,
                    nbytes: int) -> torch.Tensor: ...
    def to_device(self, cpu: torch.Tensor, index: int) -> torch.Tensor: ...
    def result_to_device(self, cpu: torch.Tensor, index: int) -> torch.Tensor: ...
    def host_sync(self, index: int) -> None: ...
    def host_view(self, t: torch.Tensor) -> torch.Tensor: ...
    def to_host(self, t: torch.Tensor) -> torch.Tensor: ...
    def write_tensor(self, dev: torch.Tensor, cpu: torch.Tensor,
                     non_blocking: bool = False) -> None: ...
    def grow_storage(self, storage: torch.UntypedStorage, nbytes: int) -> None: ...
    def resize_device_tensor(self, t: torch.Tensor, size: Any, stride: Any) -> None: ...

    # registration
    def library(self, ns: str = "aten") -> torch.library.Library: ...
