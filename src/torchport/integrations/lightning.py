"""PyTorch Lightning trains on the torchport device: ``Trainer(accelerator="<device>")``.

Lightning 2.6 (``pytorch_lightning``, or ``lightning.pytorch``) finds accelerators by name
in its ``AcceleratorRegistry``, which a third-party accelerator may join: :func:`install`
registers one for the device (:func:`accelerator_class`) as soon as Lightning's
``accelerators`` package is imported (nothing of Lightning is imported here). Lightning's
accelerator connector, though, treats every accelerator that is not the CPU's or MPS's as
CUDA in three places, which no hook reaches, so these are patched (recorded, reversible,
and only ever acting for the device's accelerator):

* ``_choose_strategy``: for one device it builds ``SingleDeviceStrategy("cpu")`` unless
  the accelerator is CUDA's or MPS's; for the device's accelerator it is the device's
  strategy (``SingleDeviceStrategy(<device>:N)``). Two devices and more take Lightning's own
  ``ddp`` (or the ``strategy`` asked for), whose process group backend is the device's
  entry of PyTorch's ``default_device_backend_map``: torchport's c10d backend.
* ``_check_and_init_precision``: ``16-mixed``/``bf16-mixed`` build ``MixedPrecision(...,
  "cuda")`` (CUDA's autocast, and a GradScaler of CUDA, which disables itself); for the
  device's accelerator they get ``MixedPrecision(..., "<device>")``: the device's autocast
  and GradScaler.
* ``DDPStrategy._setup_model``: wraps the model in DDP inside a side stream of CUDA's
  (``torch.cuda.stream``) whenever it has device ids; for the device, a stream of the
  device's. (Lightning registers DDP communication hooks on CUDA only: none on the device.)
* ``_choose_auto_accelerator`` / ``_choose_gpu_accelerator_backend``: ``accelerator="auto"``
  chooses the device where it would choose the CPU, and ``"gpu"`` where no CUDA or MPS
  device exists (as Lightning chooses a GPU), so CUDA scripts run unchanged after migration.
* ``_check_device_config_and_set_final_flags``: under ``torchport run`` (``torch.device("cuda")``
  is the device), an accelerator resolved to ``"cuda"`` (``"gpu"``, ``"cuda"``, ``"auto"``)
  is the device's: Lightning's CUDA accelerator refuses a device whose type is not ``cuda``.

``TORCHPORT_LIGHTNING_INTEGRATION=0`` leaves Lightning alone (``accelerator="<device>"``
is then unknown to it).
"""

from __future__ import annotations

import functools
import importlib
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from torchport.core import lazy, settings
from torchport.integrations import claim

if TYPE_CHECKING:
    from torchport.core.contracts import DeviceBackend

__all__ = ["PACKAGES", "accelerator_class", "install", "installed", "patched", "uninstall"]

#: The Lightning packages served: the standalone one, and the one in the ``lightning`` bundle.
PACKAGES = ("pytorch_lightning", "lightning.pytorch")
_MISSING = object()


class DeviceSelectionError(ValueError):
    """``Trainer(devices=...)`` names devices the torchport device does not have."""


class _State:
    def __init__(self) -> None:
        self.name: str | None = None  # the device type, while installed
        self.undo: list[tuple[Any, str, Any]] = []  # (object, attribute, previous value)
        self.done: list[str] = []  # what was patched or registered, for reports
        self.classes: dict[str, type] = {}  # Lightning package -> its accelerator class
        self.registered: list[tuple[dict, str]] = []  # (AcceleratorRegistry, name)


_S = _State()


def _module() -> Any:
    assert _S.name is not None
    return torch.get_device_module(_S.name)


def _available() -> bool:
    return _S.name is not None and _module().device_count() > 0


def _cuda_names_the_device() -> bool:
    """``torch.device("cuda")`` is the device: CUDA code is being transferred."""
    return _S.name is not None and torch.device("cuda").type == _S.name


def _set(obj: Any, attr: str, value: Any) -> None:
    """``setattr``, the class's own previous attribute recorded for :func:`uninstall`."""
    _S.undo.append((obj, attr, obj.__dict__.get(attr, _MISSING)))
    setattr(obj, attr, value)


def parse_devices(devices: int | str | list[int] | tuple[int, ...], count: int) -> list[int]:
    """Lightning's ``devices`` (a count, ``-1`` for all, ``"0,2"``, a list of indices) as
    device indices, checked against the ``count`` devices visible."""
    value: Any = devices
    if isinstance(value, str):
        text = value.strip()
        value = [int(x) for x in text.split(",") if x.strip()] if "," in text else int(text)
    if isinstance(value, int):
        if value < -1 or value == 0:
            raise DeviceSelectionError(f"Trainer(devices={devices!r}) is not a device count; "
                                       f"use a positive number, -1 for all, or a list of indices")
        value = list(range(count if value == -1 else value))
    ids = list(value)
    bad = [i for i in ids if not isinstance(i, int) or not 0 <= i < count]
    if bad or not ids or len(set(ids)) != len(ids):
        raise DeviceSelectionError(f"Trainer(devices={devices!r}) asks for devices the "
                                   f"{_S.name} device does not have ({count} visible); use "
                                   f"indices below {count} (TORCHPORT_VISIBLE_DEVICES selects them)")
    return ids


def _make_accelerator(package: str) -> type:
    """The device's Accelerator class for ``package`` (a subclass of its ``Accelerator``)."""
    base = importlib.import_module(f"{package}.accelerators.accelerator").Accelerator
    device = _S.name
    assert device is not None

    class DeviceAccelerator(base):  # type: ignore[misc, valid-type]
        """Lightning's accelerator for the torchport device (its ``torch.<device>``
        module does what ``torch.cuda`` does for CUDA's accelerator)."""

        torchport_device = device

        def setup_device(self, device: torch.device) -> None:
            if device.type != self.torchport_device:
                raise DeviceSelectionError(f"the {self.torchport_device} accelerator was given "
                                           f"device {device}; pass a {self.torchport_device} "
                                           f"device")
            torch.get_device_module(device.type).set_device(device)

        def teardown(self) -> None:
            torch.get_device_module(self.torchport_device).empty_cache()

        def get_device_stats(self, device: Any) -> dict[str, Any]:
            return torch.get_device_module(self.torchport_device).memory_stats(device)

        @staticmethod
        def parse_devices(devices: Any) -> list[int]:
            return parse_devices(devices, torch.get_device_module(device).device_count())

        @staticmethod
        def get_parallel_devices(devices: list[int]) -> list[torch.device]:
            return [torch.device(device, i) for i in devices]

        @staticmethod
        def auto_device_count() -> int:
            return torch.get_device_module(device).device_count()

        @staticmethod
        def is_available() -> bool:
            return torch.get_device_module(device).device_count() > 0

        @staticmethod
        def name() -> str:
            return device

        @classmethod
        def register_accelerators(cls, accelerator_registry: Any) -> None:
            accelerator_registry.register(device, cls, description=cls.__name__, override=True)

        def __reduce__(self) -> tuple[Callable[[str], Any], tuple[str]]:
            # made per package at run time: a spawned process (ddp_spawn) rebuilds it
            return _accelerator_instance, (package,)

    DeviceAccelerator.__name__ = DeviceAccelerator.__qualname__ = \
        f"{device.capitalize()}Accelerator"
    DeviceAccelerator.__module__ = __name__
    return DeviceAccelerator


def accelerator_class(package: str = "pytorch_lightning") -> type:
    """The device's Lightning ``Accelerator`` class for ``package`` (one of
    :data:`PACKAGES`), made on first use; :func:`install` first."""
    if _S.name is None:
        raise RuntimeError("torchport: the Lightning integration is not installed; import the "
                           "backend (import torchport.sim) first")
    cls = _S.classes.get(package)
    if cls is None:
        cls = _S.classes[package] = _make_accelerator(package)
    return cls


def _accelerator_instance(package: str) -> Any:
    """An accelerator of ``package`` (unpickling in a spawned process)."""
    if _S.name is None:
        install()
    return accelerator_class(package)()


def _ours(package: str, accelerator: Any) -> bool:
    """Is ``accelerator`` (a name or an instance) the device's accelerator?"""
    if _S.name is None:
        return False
    if isinstance(accelerator, str):
        return accelerator == _S.name
    return getattr(type(accelerator), "torchport_device", None) == _S.name


# ---- the patches ---------------------------------------------------------------------------
def _register(package: str, module: types.ModuleType) -> None:
    """Register the device's accelerator in ``<package>.accelerators.AcceleratorRegistry``."""
    if _S.name is None:
        return
    registry = module.AcceleratorRegistry
    accelerator_class(package).register_accelerators(registry)
    _S.registered.append((registry, _S.name))
    _S.done.append(f"{package}.accelerators.AcceleratorRegistry[{_S.name!r}]")


def _patch_connector(package: str, module: types.ModuleType) -> None:
    if _S.name is None:
        return
    cls = module._AcceleratorConnector
    if "_torchport_device" in cls.__dict__:  # hooked twice (installed again)
        return
    single = module.SingleDeviceStrategy
    mixed = module.MixedPrecision
    not_for_us = (module.FSDPStrategy, module.DeepSpeedStrategy)
    misconfigured = module.MisconfigurationException
    choose_strategy = cls.__dict__["_choose_strategy"]
    init_precision = cls.__dict__["_check_and_init_precision"]
    choose_auto = cls.__dict__["_choose_auto_accelerator"].__func__
    choose_gpu = cls.__dict__["_choose_gpu_accelerator_backend"].__func__
    device_flags = cls.__dict__["_check_device_config_and_set_final_flags"]

    @functools.wraps(choose_strategy)
    def _choose_strategy(self: Any) -> Any:
        strategy = choose_strategy(self)
        if _ours(package, self._accelerator_flag) and isinstance(strategy, single) \
                and len(self._parallel_devices) == 1:
            return single(device=self._parallel_devices[0])
        return strategy

    @functools.wraps(init_precision)
    def _check_and_init_precision(self: Any) -> Any:
        if _ours(package, self.accelerator) and self._precision_plugin_flag is None \
                and self._precision_flag in ("16-mixed", "bf16-mixed") \
                and not isinstance(self.strategy, not_for_us):
            self._validate_precision_choice()
            return mixed(self._precision_flag, _S.name)
        return init_precision(self)

    @functools.wraps(choose_auto)
    def _choose_auto_accelerator() -> str:
        chosen = choose_auto()
        return _S.name if chosen == "cpu" and _available() else chosen  # type: ignore[return-value]

    @functools.wraps(choose_gpu)
    def _choose_gpu_accelerator_backend() -> str:
        try:
            return choose_gpu()
        except misconfigured:
            if not _available():
                raise
            return _S.name  # type: ignore[return-value]

    @functools.wraps(device_flags)
    def _check_device_config_and_set_final_flags(self: Any, *args: Any, **kwargs: Any) -> Any:
        # CUDA code run unchanged (torchport run): "cuda" names the device, whose tensors
        # Lightning's CUDA accelerator would refuse ("Device should be GPU")
        if self._accelerator_flag == "cuda" and _cuda_names_the_device():
            self._accelerator_flag = _S.name
        return device_flags(self, *args, **kwargs)

    _set(cls, "_torchport_device", _S.name)
    _set(cls, "_check_device_config_and_set_final_flags", _check_device_config_and_set_final_flags)
    _set(cls, "_choose_strategy", _choose_strategy)
    _set(cls, "_check_and_init_precision", _check_and_init_precision)
    _set(cls, "_choose_auto_accelerator", staticmethod(_choose_auto_accelerator))
    _set(cls, "_choose_gpu_accelerator_backend", staticmethod(_choose_gpu_accelerator_backend))
    _S.done.append(f"{module.__name__}._AcceleratorConnector")


def _patch_ddp(package: str, module: types.ModuleType) -> None:
    if _S.name is None:
        return
    cls = module.DDPStrategy
    if "_torchport_device" in cls.__dict__:
        return
    setup_model = cls.__dict__["_setup_model"]
    ddp = module.DistributedDataParallel

    @functools.wraps(setup_model)
    def _setup_model(self: Any, model: torch.nn.Module) -> Any:
        if _S.name is None or self.root_device.type != _S.name:
            return setup_model(self, model)
        device_ids = self.determine_ddp_device_ids()
        device_module = torch.get_device_module(_S.name)
        with device_module.stream(device_module.Stream()):  # as Lightning does on CUDA
            return ddp(module=model, device_ids=device_ids, **self._ddp_kwargs)

    _set(cls, "_torchport_device", _S.name)
    _set(cls, "_setup_model", _setup_model)
    _S.done.append(f"{module.__name__}.DDPStrategy._setup_model")


_HOOKS: dict[str, Callable[[str, types.ModuleType], None]] = {
    "accelerators": _register,
    "trainer.connectors.accelerator_connector": _patch_connector,
    "strategies.ddp": _patch_ddp,
}


def install(device_type: str | None = None) -> None:
    """Make Lightning know the ``device_type`` accelerator (default: the registered
    PrivateUse1 device): now where Lightning is imported, else as it is. Idempotent."""
    if not claim(_S, device_type, "Lightning"):
        return
    for package in PACKAGES:
        for sub, hook in _HOOKS.items():
            lazy.when_imported(f"{package}.{sub}", functools.partial(_guarded, hook, package))


def _guarded(hook: Callable[[str, types.ModuleType], None], package: str,
             module: types.ModuleType) -> None:
    """Run ``hook``; a Lightning release it does not fit gets a warning, not a failed import."""
    try:
        hook(package, module)
    except Exception as e:  # never break the user's import
        import warnings

        warnings.warn(f"torchport: could not adapt {module.__name__} to the {_S.name} device "
                      f"({e!r}); Trainer(accelerator={_S.name!r}) may not work", stacklevel=2)


def uninstall() -> None:
    """Restore the patched methods and remove the registered accelerators; modules imported
    later are left alone (their hooks see no installation)."""
    for registry, name in _S.registered:
        registry.pop(name, None)
    for obj, attr, old in reversed(_S.undo):
        if old is _MISSING:
            delattr(obj, attr)
        else:
            setattr(obj, attr, old)
    _S.undo.clear()
    _S.registered.clear()
    _S.done.clear()
    _S.classes.clear()
    _S.name = None


def installed() -> str | None:
    """The device type the integration is installed for, or ``None``."""
    return _S.name


def patched() -> list[str]:
    """What has been registered and patched so far (Lightning modules not imported yet are
    adapted when they are)."""
    return list(_S.done)


def on_register(backend: DeviceBackend, module: types.ModuleType) -> None:
    """Install for ``backend`` as it registers, unless TORCHPORT_LIGHTNING_INTEGRATION is
    off (:mod:`torchport.features`)."""
    if not settings.get("TORCHPORT_LIGHTNING_INTEGRATION"):
        return
    install(backend.name)
