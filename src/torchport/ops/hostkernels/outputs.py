"""Results on the device: new device tensors for an op's outputs, or CPU results moved.

:func:`new_output` is the one way a host kernel makes an output tensor (the functional
kernel inlines it on its hot path; a test proves the two make the same tensor). A CPU
result the kernel could not compute into device tensors is moved by
:func:`results_to_device` / :func:`result_on_device`: small dense ones copied into new
blocks, large ones adopted where the runtime can (no copy).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

from torchport.memory import tensors
from torchport.memory.allocator import ADOPT_MIN_BYTES
from torchport.memory.tensors import storage_ptr
from torchport.ops import hostviews
from torchport.ops.hostkernels.mapping import CPU_KS

if TYPE_CHECKING:
    from torchport.core.contracts import DeviceBackend

Tensor = torch.Tensor
_as_strided = torch.ops.aten.as_strided.default
_copy_boxed = torch.ops.aten.copy_.default._handle.redispatch_boxed
_foreach_copy_boxed = torch.ops.aten._foreach_copy_.default._handle.redispatch_boxed


class OutputSpec(NamedTuple):
    """An output's layout, with what making it needs precomputed."""

    nbytes: int  # the storage bytes of the layout
    dtype: torch.dtype
    size: list[int]
    stride: list[int]
    shape: tuple[int, ...]  # size and stride as tuples: the host-view cache's key
    strides: tuple[int, ...]
    headers: list  # the layout's DLPack header on each device (tensors.layout_header)


def spec_for(backend: DeviceBackend, shape, stride, dtype: torch.dtype) -> OutputSpec:
    """The :class:`OutputSpec` of a (shape, stride, dtype) layout on ``backend``'s devices
    (the device's error for a dtype it refuses)."""
    if dtype in backend.runtime.unsupported_dtypes:
        backend.check_dtype(dtype)
    return OutputSpec(tensors.storage_nbytes(shape, stride, dtype.itemsize), dtype,
                      list(shape), list(stride), tuple(shape), tuple(stride),
                      [tensors.layout_header(d.index, dtype, shape, stride)
                       for d in backend.devices])


def new_output(backend: DeviceBackend, index: int, spec: OutputSpec) -> Tensor:
    """A new tensor on device ``index`` laid out as ``spec``, its block taken for the
    current stream."""
    return tensors.new_device_tensor(backend.devices[index], backend.allocators[index],
                                     spec.nbytes, spec.dtype, spec.size, spec.stride,
                                     backend.current_stream_handle(index),
                                     spec.headers[index])


def new_dense_like(backend: DeviceBackend, index: int, t: Tensor) -> Tensor:
    """A new tensor on device ``index`` in dense ``t``'s layout and dtype."""
    if t.dtype in backend.runtime.unsupported_dtypes:
        backend.check_dtype(t.dtype)
    return tensors.new_device_tensor(backend.devices[index], backend.allocators[index],
                                     t.numel() * t.element_size(), t.dtype, list(t.shape),
                                     list(t.stride()), backend.current_stream_handle(index))


def results_to_device(backend: DeviceBackend, views: hostviews.HostViews,
                      results: list[Tensor], index: int) -> list[Tensor]:
    """CPU results on device ``index``: each dense one below the adoption size gets a new
    block, and one foreach copy between the chip's views fills them all (an optimizer's
    ``_foreach_sqrt`` returns a tensor per parameter); the others go one by one
    (``backend.result_to_device``: large ones adopted)."""
    moved: list[Tensor] = []
    dsts: list[Tensor] = []
    srcs: list[Tensor] = []
    for x in results:
        n = x.numel() * x.element_size()
        if 0 < n < ADOPT_MIN_BYTES and (x.is_contiguous() or tensors.is_non_overlapping_and_dense(x)):
            d = new_dense_like(backend, index, x)
            dsts.append(views.entry(d)[0])
            srcs.append(x)
        else:
            d = backend.result_to_device(x, index)
        moved.append(d)
    if len(dsts) == 1:  # a third of the list copy's cost
        _copy_boxed(CPU_KS, dsts[0], srcs[0])
    elif dsts:
        _foreach_copy_boxed(CPU_KS, dsts, srcs)
    return moved


def result_on_device(r: Tensor, index: int, views: list[Tensor], args: tuple,
                     adopt: Callable[[Tensor, int], Tensor], cache: hostviews.HostViews) -> Tensor:
    """A new device tensor with ``r``'s values -- or, when the CPU kernel returned (a
    view of) an input, the same view of the device input (``views``: the chip's views
    of ``args``' tensors, in order). An adopted ``r`` (the device tensor lies at its
    address) becomes that tensor's entry in ``cache``."""
    if r.numel():
        ptr = storage_ptr(r)
        for i, v in enumerate(views):
            if storage_ptr(v) == ptr:
                dev = [a for a in args if isinstance(a, Tensor)][i]
                # offsets count from the view's storage, which may start before dev's
                shift = v.storage_offset() - dev.storage_offset()
                return _as_strided.redispatch(CPU_KS, dev, r.shape, r.stride(),
                                              r.storage_offset() - shift)
    d = adopt(r, index)
    if r.numel() and d.data_ptr() == r.data_ptr():
        cache.add(d, (d.data_ptr(), d.dtype, d.shape, d.stride()), view=r)
    return d


def copy_into_views(views: hostviews.HostViews, outs: list[Tensor], results: list) -> None:
    """Copy CPU ``results`` into the device tensors ``outs`` through the chip's views."""
    for o, x in zip(outs, results, strict=True):
        if o.numel():
            _copy_boxed(CPU_KS, views.entry(o)[0], x)
