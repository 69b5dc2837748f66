"""Hugging Face ``accelerate`` and ``transformers`` choose the torchport device as a GPU.

accelerate 1.15 and transformers 5.23 pick a device from fixed lists of vendors (CUDA,
XPU, NPU, MLU, MUSA, HPU, ...), each probed by its own ``is_*_available()``; neither asks
``torch.accelerator``, so with only a PrivateUse1 device they train on the CPU, refuse
``bf16=True`` and refuse fp16. What the device itself must provide they find already
(``torch.<device>.is_bf16_supported``, ``set_device``, ``device_count``, a GradScaler and
CUDA's autocast policy for the device, the fused AdamW kernel). No supported hook decides
the choice: ``ACCELERATE_TORCH_DEVICE`` names a device for both, but accelerate then
ignores ``cpu=True`` (and the Trainer's ``use_cpu=True``), so a process could no longer
train on the CPU. Hence these patches, each applied when its module is imported (nothing
is imported here) and only ever turning a CPU answer into the device where
``torch.accelerator.current_accelerator()`` is the device:

* ``accelerate.state.PartialState.default_device``: the device where it would say CPU
  (single process; ``cpu=True`` never asks it);
* ``accelerate.utils.modeling.get_grad_scaler`` (and the names bound to it):
  ``torch.amp.GradScaler("<device>")`` for a state on the device (else it makes
  ``GradScaler("cuda")``, which disables itself without CUDA);
* ``accelerate.Accelerator.__init__``: the device joins the constant tuple of device
  types fp16 accepts (a code constant: the check is inline);
* ``transformers.utils.import_utils.is_torch_bf16_gpu_available`` (and the names bound to
  it): also true where the device's ``is_bf16_supported()`` is;
* ``transformers.TrainingArguments._setup_devices``: ``<device>:0`` with one device per
  process (what it does for XPU, NPU, MLU) where accelerate's state chose the device and
  the arguments say nothing of the CPU; ``dataloader_pin_memory`` off where the device has
  no pinned memory (PyTorch's DataLoader does the same for MPS).

:func:`install` is called when a backend registers (``TORCHPORT_HF_INTEGRATION=0``
leaves the libraries alone); :func:`uninstall` restores every patched object.
"""

from __future__ import annotations

import functools
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from torchport.core import settings
from torchport.integrations import claim

if TYPE_CHECKING:
    from torchport.core.contracts import DeviceBackend

__all__ = ["install", "installed", "patched", "uninstall"]

_MISSING = object()


class _State:
    def __init__(self) -> None:
        self.name: str | None = None  # the device type, while installed
        self.undo: list[tuple[Any, str, Any]] = []  # (object, attribute, previous value)
        self.done: list[str] = []  # what was patched, for reports
        # (package, attribute, old, new) of functions replaced by name: modules imported
        # later bind the new one, and get the old one back too
        self.rebound: list[tuple[str, str, Any, Any]] = []


_S = _State()


def _device() -> torch.device | None:
    """The device, where it is the current accelerator and available; else ``None``."""
    name = _S.name
    if name is None:
        return None
    acc = torch.accelerator.current_accelerator(check_available=True)
    return torch.device(name) if acc is not None and acc.type == name else None


def _set(obj: Any, attr: str, value: Any) -> None:
    """``setattr``, with the previous value recorded for :func:`uninstall`: a class's or
    module's own attribute (or that it had none), another object's attribute (a
    function's code)."""
    own = isinstance(obj, (type, types.ModuleType))
    _S.undo.append((obj, attr, obj.__dict__.get(attr, _MISSING) if own else getattr(obj, attr)))
    setattr(obj, attr, value)


def _rebind(module: types.ModuleType, attr: str, new: Any, package: str) -> None:
    """``module.attr = new``, and every loaded module of ``package`` that imported the old
    object by name gets the new one (read from ``__dict__``: lazy modules stay lazy)."""
    old = module.__dict__[attr]
    _S.rebound.append((package, attr, old, new))
    for m in _modules_binding(package, attr, old):
        _set(m, attr, new)


def _modules_binding(package: str, attr: str, value: Any) -> list[types.ModuleType]:
    """The loaded modules of ``package`` whose ``attr`` is ``value``."""
    return [m for name, m in list(sys.modules.items())
            if (name == package or name.startswith(package + ".")) and m is not None
            and getattr(m, "__dict__", {}).get(attr) is value]


# ---- the patches, one per module -------------------------------------------------------------
def _patch_partial_state(mod: types.ModuleType) -> None:
    cls = mod.PartialState
    orig = cls.__dict__["default_device"]

    def default_device(self: Any) -> torch.device:
        device = orig.fget(self)
        ours = _device()
        return ours if ours is not None and device.type == "cpu" else device

    _set(cls, "default_device", property(default_device, doc=orig.__doc__))
    _S.done.append("accelerate.state.PartialState.default_device")


def _state_device_type() -> str | None:
    from accelerate.state import PartialState

    device = PartialState._shared_state.get("device")
    return device.type if isinstance(device, torch.device) else None


def _patch_grad_scaler(mod: types.ModuleType) -> None:
    orig = mod.get_grad_scaler
    from accelerate.utils.dataclasses import DistributedType

    @functools.wraps(orig)
    def get_grad_scaler(distributed_type: Any = None, **kwargs: Any) -> Any:
        ours = _device()
        if ours is not None and distributed_type != DistributedType.FSDP \
                and _state_device_type() == ours.type:
            return torch.amp.GradScaler(ours.type, **kwargs)
        return orig(distributed_type, **kwargs)

    _rebind(mod, "get_grad_scaler", get_grad_scaler, "accelerate")
    _S.done.append("accelerate.utils.modeling.get_grad_scaler")


def _patch_fp16_devices(mod: types.ModuleType) -> None:
    init = mod.Accelerator.__init__
    code = init.__code__
    name = _S.name
    consts = list(code.co_consts)
    found = False
    for i, c in enumerate(consts):
        if isinstance(c, tuple) and {"cuda", "xpu", "mps"} <= set(c) \
                and all(isinstance(x, str) for x in c):
            found = True
            if name not in c:
                consts[i] = (*c, name)
    if not found:
        warnings.warn("torchport: accelerate.Accelerator has no list of fp16 devices to add "
                      f"{name!r} to (another accelerate version?); fp16 may be refused",
                      stacklevel=2)
        return
    _set(init, "__code__", code.replace(co_consts=tuple(consts)))
    _S.done.append("accelerate.Accelerator.__init__ (fp16 device types)")


def _patch_bf16_probe(mod: types.ModuleType) -> None:
    orig = mod.is_torch_bf16_gpu_available

    def probe() -> bool:
        if orig():
            return True
        ours = _device()
        return ours is not None and bool(torch.get_device_module(ours.type).is_bf16_supported())

    probe.__name__ = probe.__qualname__ = orig.__name__
    probe.__doc__ = orig.__doc__
    probe._dynamo_marked_constant = True  # a constant of the process, as transformers marks it
    _rebind(mod, "is_torch_bf16_gpu_available", functools.lru_cache(probe), "transformers")
    _S.done.append("transformers.utils.import_utils.is_torch_bf16_gpu_available")


@functools.cache
def _can_pin() -> bool:
    """Can a CPU tensor be pinned for the current accelerator?"""
    try:
        torch.empty(1).pin_memory()
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _patch_setup_devices(mod: types.ModuleType) -> None:
    cls = mod.TrainingArguments
    orig = cls.__dict__["_setup_devices"]
    func = orig.func

    def _setup_devices(self: Any) -> torch.device:
        device = func(self)
        ours = _device()
        state = getattr(self, "distributed_state", None)
        if ours is None or device.type != "cpu" or self.use_cpu or state is None \
                or getattr(state, "device", None) is None or state.device.type != ours.type \
                or state.distributed_type != "NO":  # a str enum
            return device
        device = torch.device(ours.type, 0)
        torch.get_device_module(ours.type).set_device(device)
        self._n_gpu = 1
        if self.dataloader_pin_memory and not _can_pin():
            self.dataloader_pin_memory = False
        return device

    _setup_devices.__doc__ = orig.__doc__
    new = functools.cached_property(_setup_devices)
    new.__set_name__(cls, "_setup_devices")
    _set(cls, "_setup_devices", new)
    _S.done.append("transformers.TrainingArguments._setup_devices")


_PATCHES: dict[str, Callable[[types.ModuleType], None]] = {
    "accelerate.state": _patch_partial_state,
    "accelerate.utils.modeling": _patch_grad_scaler,
    "accelerate.accelerator": _patch_fp16_devices,
    "transformers.utils.import_utils": _patch_bf16_probe,
    "transformers.training_args": _patch_setup_devices,
}


def _apply(name: str, module: types.ModuleType) -> None:
    if _S.name is None or module.__dict__.get("_torchport_patched"):
        return
    try:
        _PATCHES[name](module)
    except Exception as e:  # never break the user's import
        warnings.warn(f"torchport: could not adapt {name} to the {_S.name} device: {e!r}",
                      stacklevel=2)
        return
    _set(module, "_torchport_patched", True)
    if _all_patched() and _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)


# ---- applying patches as the modules load ----------------------------------------------------
class _Loader:
    """Runs a patched module with its own loader (given back to the module), then patches."""

    def __init__(self, loader: Any, name: str) -> None:
        self.loader = loader
        self.name = name

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__spec__.loader = module.__loader__ = self.loader
        self.loader.exec_module(module)
        _apply(self.name, module)


class _Finder:
    """A ``sys.meta_path`` finder answering only for the modules still to patch; it leaves
    ``sys.meta_path`` when none is left."""

    @staticmethod
    def find_spec(fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in _PATCHES or _S.name is None or fullname in sys.modules:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _Loader(spec.loader, fullname)
        return spec

    @staticmethod
    def invalidate_caches() -> None:
        pass


_FINDER = _Finder()


def _all_patched() -> bool:
    return all(getattr(sys.modules.get(n), "_torchport_patched", False) for n in _PATCHES)


def install(device_type: str | None = None) -> None:
    """Make accelerate and transformers choose ``device_type`` (default: the registered
    PrivateUse1 device) as they choose a GPU: patches the modules already imported and
    the others as they are imported. Idempotent."""
    if not claim(_S, device_type, "Hugging Face"):
        return
    for mod_name in _PATCHES:
        module = sys.modules.get(mod_name)
        if module is not None:
            _apply(mod_name, module)
    if not _all_patched() and _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def uninstall() -> None:
    """Restore every object :func:`install` patched and stop patching new imports."""
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    for obj, attr, old in reversed(_S.undo):
        if old is _MISSING:
            delattr(obj, attr)
        else:
            setattr(obj, attr, old)
    for package, attr, old, new in _S.rebound:
        for m in _modules_binding(package, attr, new):
            setattr(m, attr, old)
    _S.undo.clear()
    _S.rebound.clear()
    _S.done.clear()
    _S.name = None
    _can_pin.cache_clear()


def installed() -> str | None:
    """The device type the integration is installed for, or ``None``."""
    return _S.name


def patched() -> list[str]:
    """The objects patched so far (modules not imported yet are patched when they are)."""
    return list(_S.done)


def on_register(backend: DeviceBackend, module: types.ModuleType) -> None:
    """Install for ``backend`` as it registers, unless TORCHPORT_HF_INTEGRATION is off
    (:mod:`torchport.features`)."""
    if not settings.get("TORCHPORT_HF_INTEGRATION"):
        return
    install(backend.name)
