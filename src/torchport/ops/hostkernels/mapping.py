"""A call's device tensors mapped to the chip's views of them (:mod:`torchport.ops.hostviews`).

A host kernel runs PyTorch's CPU kernel on those views. Only calls whose tensors are
plain tensors of one device are mapped; anything else (a tensor of another device, a
keyword tensor, a conjugate view an op could see) is the general path's business,
:func:`torchport.ops.hostexec.run_on_host`, which handles the whole schema.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from torchport.ops import fallback, hostexec, hostviews

if TYPE_CHECKING:
    from torchport.core.contracts import DeviceBackend

Tensor = torch.Tensor
CPU_KS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
Call = Callable[[tuple, dict], Any]  # (args, kwargs) -> result: the general and slow paths


def device_views(args: tuple, kwargs: dict, views: hostviews.HostViews,
                 bits: bool = True, key: list | None = None) -> list | None:
    """``args`` with every device tensor (also inside tensor lists) replaced by the chip's
    view of it, when all are plain tensors of one device and no keyword argument holds
    a tensor; ``None`` otherwise. ``bits``: conjugate and negative views can reach the
    op (:func:`~torchport.ops.hostkernels.schema.sees_view_bits`), and are refused.
    ``key``: receives what the outputs' layouts can depend on (the tensors' layout ids,
    the other arguments, floats by type only), as a layout cache key."""
    entries, add = views.entries, views.add
    device = None
    cargs: list = []
    for a in args:
        if isinstance(a, Tensor):
            items, single = (a,), True
        elif type(a) in (list, tuple) and any(isinstance(x, Tensor) for x in a):
            items, single = a, False
        else:
            cargs.append(a)
            if key is not None:
                t = type(a)
                key.append(t if t is float else (t, tuple(a) if t is list else a))
            continue
        mapped = []
        for t in items:
            if not isinstance(t, Tensor):
                if t is None and not single:  # an index list: x[:, idx] is [None, idx]
                    mapped.append(None)
                    if key is not None:
                        key.append(None)
                    continue
                return None  # None entries elsewhere, scalars
            e = entries.get((t.data_ptr(), t.dtype, t.shape, t.stride()))
            if e is None:
                e = add(t, (t.data_ptr(), t.dtype, t.shape, t.stride()))
                if e is None:
                    return None
            if e[2] is not device:
                if device is not None:
                    return None
                device = e[2]
            if bits and (t.is_conj() or t.is_neg()):
                return None
            mapped.append(e[0])
            if key is not None:
                key.append(e[1])
        cargs.append(mapped[0] if single else mapped)
        if key is not None and not single:
            key.append(len(items))  # where the list ends
    if device is None:
        return None
    for v in kwargs.values():
        if isinstance(v, (Tensor, list, tuple)):
            return None
    return cargs


def plain_device(name: str, args: tuple, kwargs: dict) -> torch.device | None:
    """The one device of a call's tensors (keyword ones and those in tensor lists too), when
    all are plain tensors (no conjugate or negative view) of device type ``name``; else
    ``None``, as when the call has no tensor."""
    device = None
    for a in (*args, *kwargs.values()):
        if isinstance(a, Tensor):
            items: Any = (a,)
        elif type(a) is list or type(a) is tuple:  # cat's tensors, index's indices
            items = a
        else:
            continue
        for t in items:
            if isinstance(t, Tensor):
                if t.device.type != name or (device is not None and t.device != device) \
                        or t.is_conj() or t.is_neg():
                    return None
                device = t.device
    return device


def host_arguments(views: hostviews.HostViews, args: tuple, kwargs: dict) -> tuple[list, dict]:
    """The chip's views of a call's tensors, keyword ones and those in tensor lists too
    (``None`` stays, as in ``x[:, i]``'s indices): a call :func:`plain_device` accepted."""
    entry = views.entry

    def host(a: Any) -> Any:
        if isinstance(a, Tensor):
            return entry(a, False)[0]
        if type(a) is list or type(a) is tuple:
            return type(a)(entry(x, False)[0] if isinstance(x, Tensor) else x for x in a)
        return a
    return [host(a) for a in args], {k: host(v) for k, v in kwargs.items()}


def on_views(views: hostviews.HostViews, bits: bool, general: Call, slow: Call | None,
             body: Callable[[tuple, list, dict], Any]) -> Callable[..., Any]:
    """A kernel calling ``body(args, the chip's views of args, kwargs)``; calls
    :func:`device_views` cannot map go to ``general``, and to ``slow`` while
    ``fallback.SLOW`` is set."""
    fb = fallback

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if slow is not None and fb.SLOW:
            return slow(args, kwargs)
        cargs = device_views(args, kwargs, views, bits)
        if cargs is None:
            return general(args, kwargs)
        return body(args, cargs, kwargs)

    return kernel


def device_index(args: tuple, kwargs: dict) -> int:
    """The device index of a mapped call's first tensor (lists included)."""
    return next(hostexec._iter_tensors(args, kwargs)).device.index


def sync_devices(backend: DeviceBackend, args: tuple, kwargs: dict) -> None:
    """Wait for the work queued on every device a call's tensors live on: the host is
    about to read or write their memory."""
    done = set()
    for v in hostexec._iter_tensors(args, kwargs):
        d = v.device
        if d.type == backend.name and d.index not in done:
            done.add(d.index)
            backend.host_sync(d.index)
