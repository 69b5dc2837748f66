"""NVIDIA Apex's ``amp.initialize`` / ``amp.scale_loss`` API on torchport devices.

Code written for Apex runs unchanged with ``from torchport.device import amp``:

* ``O0``: fp32 (loss scaling still available);
* ``O1``: the model's forward runs under ``torch.autocast`` (the lower-precision op
  list runs in fp16, fp32 ops in fp32), weights stay fp32;
* ``O2``: the model is cast to fp16 except batch norm, its inputs are cast to fp16
  and outputs back to fp32; the optimizer steps fp32 master weights that are
  copied back into the model after each step.

Loss scaling is ``"dynamic"`` (start 2**16, halve and skip the step on inf/nan,
double after 2000 clean steps) or a fixed float (never skips, as in Apex).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

_LEVELS = ("O0", "O1", "O2")


@dataclass
class LossScaler:
    """Apex's loss scaler: static, or dynamic with backoff on overflow and periodic growth."""

    dynamic: bool
    scale: float = 2.0**16
    factor: float = 2.0
    window: int = 2000
    max_scale: float = 2.0**24
    min_scale: float = 1.0 / 2**24
    clean_steps: int = 0

    def update(self, found_inf: bool) -> bool:
        """Adjust the scale after a backward; return True when the step must be skipped."""
        if not self.dynamic:
            return False
        if found_inf:
            self.scale = max(self.scale / self.factor, self.min_scale)
            self.clean_steps = 0
            return True
        self.clean_steps += 1
        if self.clean_steps >= self.window:
            self.scale = min(self.scale * self.factor, self.max_scale)
            self.clean_steps = 0
        return False


@dataclass
class _Stash:
    """What ``initialize`` attached to one optimizer."""

    opt_level: str
    scaler: LossScaler
    pairs: list[tuple[nn.Parameter, nn.Parameter]] = field(default_factory=list)  # model, master
    skip_next: bool = False
    saved_grads: list[torch.Tensor | None] = field(default_factory=list)


def _cast_floats(v: Any, dtype: torch.dtype) -> Any:
    if isinstance(v, torch.Tensor):
        return v.to(dtype) if v.is_floating_point() and v.dtype != torch.float64 else v
    if isinstance(v, (list, tuple)):
        return type(v)(_cast_floats(x, dtype) for x in v)
    if isinstance(v, dict):
        return {k: _cast_floats(x, dtype) for k, x in v.items()}
    return v


def _device_type(models: list[nn.Module]) -> str:
    for m in models:
        for p in m.parameters():
            return p.device.type
    raise ValueError("amp.initialize: the model has no parameters (move it to the device first)")


def _patch_forward(model: nn.Module, opt_level: str, device_type: str,
                   dtype: torch.dtype) -> None:
    orig = model.forward

    if opt_level == "O1":
        def forward(*args: Any, **kwargs: Any) -> Any:
            with torch.autocast(device_type=device_type, dtype=dtype):
                return orig(*args, **kwargs)
    else:
        def forward(*args: Any, **kwargs: Any) -> Any:
            out = orig(*_cast_floats(args, dtype), **_cast_floats(kwargs, dtype))
            return _cast_floats(out, torch.float32)
    model.forward = forward


def _cast_model_o2(model: nn.Module, dtype: torch.dtype) -> None:
    model.to(dtype)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.float()


def _attach(optimizer: torch.optim.Optimizer, stash: _Stash, dtype: torch.dtype) -> None:
    if getattr(optimizer, "_torchport_amp", None) is not None:
        raise RuntimeError("amp.initialize was already called for this optimizer")
    if optimizer.state:
        raise RuntimeError("amp.initialize must be called before the optimizer's first step")
    if stash.opt_level == "O2":
        for group in optimizer.param_groups:
            new = []
            for p in group["params"]:
                if p.dtype == dtype:
                    master = nn.Parameter(p.detach().float().clone(), requires_grad=p.requires_grad)
                    stash.pairs.append((p, master))
                    new.append(master)
                else:
                    new.append(p)
            group["params"] = new
    orig_step, orig_zero = optimizer.step, optimizer.zero_grad

    def step(*args: Any, **kwargs: Any) -> Any:
        if stash.skip_next:  # overflow in the last backward: drop this step
            stash.skip_next = False
            return None
        out = orig_step(*args, **kwargs)
        with torch.no_grad():
            for model_p, master in stash.pairs:
                model_p.copy_(master)
        return out

    def zero_grad(set_to_none: bool = True) -> None:
        orig_zero(set_to_none)
        for model_p, _ in stash.pairs:
            model_p.grad = None

    optimizer.step = step
    optimizer.zero_grad = zero_grad
    optimizer._torchport_amp = stash


def initialize(models: nn.Module | list[nn.Module],
               optimizers: torch.optim.Optimizer | list[torch.optim.Optimizer] | None = None,
               opt_level: str = "O1", loss_scale: str | float | None = None,
               cast_dtype: torch.dtype = torch.float16) -> Any:
    """Prepare models and optimizers for mixed precision (Apex's ``amp.initialize``).

    Models must already be on the device, and optimizers built on their parameters
    but not stepped. Returns what was passed in (``(model, optimizer)`` or ``model``)."""
    if opt_level not in _LEVELS:
        raise ValueError(f"opt_level must be one of {_LEVELS} (O3 is not supported), "
                         f"got {opt_level!r}")
    model_list = models if isinstance(models, list) else [models]
    opt_list = [] if optimizers is None else (
        optimizers if isinstance(optimizers, list) else [optimizers])
    device_type = _device_type(model_list)
    if loss_scale is None:
        loss_scale = 1.0 if opt_level == "O0" else "dynamic"
    if loss_scale != "dynamic" and not isinstance(loss_scale, (int, float)):
        raise ValueError(f"loss_scale must be 'dynamic' or a number, got {loss_scale!r}")
    for m in model_list:
        if opt_level == "O2":
            _cast_model_o2(m, cast_dtype)
        if opt_level != "O0":
            _patch_forward(m, opt_level, device_type, cast_dtype)
    for opt in opt_list:
        scaler = LossScaler(dynamic=True) if loss_scale == "dynamic" else \
            LossScaler(dynamic=False, scale=float(loss_scale))
        _attach(opt, _Stash(opt_level, scaler), cast_dtype)
    if optimizers is None:
        return models
    return models, optimizers


def _stash_of(optimizer: torch.optim.Optimizer) -> _Stash:
    stash = getattr(optimizer, "_torchport_amp", None)
    if stash is None:
        raise RuntimeError("scale_loss: call torchport.device.amp.initialize(model, optimizer) first")
    return stash


def _direct_params(optimizer: torch.optim.Optimizer, st: _Stash) -> list[torch.Tensor]:
    """Optimizer parameters that receive gradients themselves (all but O2 master copies)."""
    masters = {id(m) for _, m in st.pairs}
    return [p for g in optimizer.param_groups for p in g["params"] if id(p) not in masters]


@contextlib.contextmanager
def scale_loss(loss: torch.Tensor,
               optimizers: torch.optim.Optimizer | list[torch.optim.Optimizer]
               ) -> Iterator[torch.Tensor]:
    """``with scale_loss(loss, opt) as scaled: scaled.backward()`` -- multiplies the loss by
    the current scale, then unscales the new gradients (into fp32 master gradients for
    O2), checks them for inf/nan and makes the next ``step()`` a no-op on overflow.
    Gradients accumulated over several ``scale_loss`` blocks are handled."""
    opts = optimizers if isinstance(optimizers, list) else [optimizers]
    stashes = [_stash_of(o) for o in opts]
    scale = stashes[0].scaler.scale
    for o, st in zip(opts, stashes, strict=True):
        params = _direct_params(o, st)
        st.saved_grads = [p.grad for p in params]
        for p in params:
            p.grad = None
    yield loss.float() * scale
    for o, st in zip(opts, stashes, strict=True):
        _finish(o, st, scale)


def _finish(optimizer: torch.optim.Optimizer, st: _Stash, scale: float) -> None:
    """Unscale this backward's gradients, check them, merge with earlier gradients."""
    to_master = []
    for model_p, master in st.pairs:
        if model_p.grad is not None:
            to_master.append((master, model_p.grad.float()))
            model_p.grad = None
    direct = _direct_params(optimizer, st)
    grads = [g for _, g in to_master] + [p.grad for p in direct if p.grad is not None]
    found_inf = False
    if grads:
        dev = grads[0].device
        found = torch.zeros((), dtype=torch.float32, device=dev)
        inv = torch.full((), 1.0 / scale, dtype=torch.float32, device=dev)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for group in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(group, found, inv)
        found_inf = bool(found.item())
    for master, g in to_master:
        master.grad = g if master.grad is None else master.grad + g
    for p, old in zip(direct, st.saved_grads, strict=True):
        if old is not None:
            p.grad = old if p.grad is None else p.grad + old
    st.saved_grads = []
    if st.scaler.update(found_inf):
        st.skip_next = True
