"""``torch._C``'s broadcast, scatter and gather for the device: what ``nn.DataParallel`` needs.

``torch.nn.parallel.comm`` (``DataParallel``'s replicate, scatter and gather, and so
Hugging Face's Trainer whenever two devices are visible) calls
``torch._C._broadcast_coalesced``, ``_broadcast``, ``_broadcast_out``, ``_scatter``,
``_scatter_out``, ``_gather`` and ``_gather_out``. PyTorch compiles them only into CUDA
builds (``torch/csrc/cuda/python_comm.cpp``), for CUDA devices only, so the CPU build has
none of them. When a backend registers, this layer gives each one CUDA's semantics for
the device: device indices name its logical devices, a source may be a CPU tensor, ``-1``
as a gather destination is the CPU, copies are non-blocking and a scatter's ``streams``
choose the stream of each copy. A name ``torch._C`` lacks (a CPU build) is added; one it
has (a CUDA build's, also where no GPU is: the default Linux wheel) is wrapped, not
replaced: a call goes to the build's function when its tensors or streams are CUDA's, or
when none is the device's and a CUDA device is usable, and to the device's otherwise
(:func:`route`). ``reduce_add`` and ``reduce_add_coalesced`` are Python
in ``comm.py`` and need nothing.
"""
from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch._prims_common import suggest_memory_format
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from torchport.core import compat

if TYPE_CHECKING:
    from torchport.core.contracts import DeviceBackend

#: The names this layer adds to ``torch._C`` (or wraps, where the build has them).
NAMES = compat.COMM_NAMES
_PRIVATE_USE1 = 20  # c10::DeviceType::PrivateUse1, as torch.Stream.device_type reports it


def _tensor_list(value: Any, what: str) -> list[torch.Tensor]:
    """A list of tensors, or pybind's kind of error for anything else."""
    items = list(value)
    for i, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: expected a sequence of tensors, but item {i} is a "
                            f"{type(t).__name__}")
    return items


def _take_tensors(tensors: Sequence[torch.Tensor], size_limit: int) -> list[list[int]]:
    """Indices of ``tensors`` grouped per dtype, a group closed once it reaches
    ``size_limit`` bytes (``torch::utils::take_tensors``, as CUDA's coalesced broadcast
    groups them)."""
    groups: dict[Any, list[int]] = {}
    sizes: dict[Any, int] = {}
    done: list[list[int]] = []
    for i, t in enumerate(tensors):
        key = (t.layout, t.dtype)
        groups.setdefault(key, []).append(i)
        sizes[key] = sizes.get(key, 0) + t.numel() * t.element_size()
        if sizes[key] >= size_limit:
            done.append(groups.pop(key))
            sizes[key] = 0
    return done + [g for g in groups.values() if g]


def make_comm(backend: DeviceBackend, mod: Any) -> dict[str, Callable[..., Any]]:
    """The seven functions for ``backend`` (``mod``: its device module, for streams)."""
    name = backend.name
    hint = f"move it with .to('{name}:N') first"

    def device(index: int) -> torch.device:
        return backend.devices[backend.check_index(index)]

    def is_dev(t: torch.Tensor) -> bool:
        return t.device.type == name

    def check_source(t: torch.Tensor, what: str) -> None:
        if not (is_dev(t) or t.device.type == "cpu"):
            raise RuntimeError(f"Expected a CPU or {name} tensor to {what}, but got a tensor "
                               f"on {t.device}; {hint}")

    def check_outputs(out: Sequence[torch.Tensor]) -> None:
        for i, o in enumerate(out):
            if not is_dev(o):
                raise RuntimeError(
                    f"Expected all output tensors to be {name} tensors, but output tensor at "
                    f"index {i} has device '{o.device}'; allocate the outputs on {name}")

    def check_inputs(tensors: Sequence[torch.Tensor], dim: int) -> list[int]:
        """CUDA's checks of gather inputs; the result's size."""
        if not tensors:
            raise RuntimeError("Expected at least one tensor to gather from")
        expected = list(tensors[0].shape)
        for i, t in enumerate(tensors):
            if not is_dev(t):
                raise RuntimeError(f"Expected all input tensors to be {name} tensors, but "
                                   f"tensor at index {i} has device {t.device}; {hint}")
            if t.dim() != len(expected):
                raise RuntimeError(
                    f"Expected all input tensors to have the same number of dimensions, but "
                    f"tensor at index {i} has {t.dim()} dimensions, (expected {len(expected)})")
            expected[dim] = t.shape[dim]
            if list(t.shape) != expected:
                raise RuntimeError(f"Input tensor at index {i} has invalid shape "
                                   f"{list(t.shape)}, but expected {expected}")
        expected[dim] = sum(t.shape[dim] for t in tensors)
        return expected

    def wrap_dim(dim: int, t: torch.Tensor) -> int:
        n = max(t.dim(), 1)
        if not -n <= dim < n:
            raise IndexError(f"Dimension out of range (expected to be in range of "
                             f"[{-n}, {n - 1}], but got {dim})")
        return dim % n

    def own_streams(streams: Any, targets: Sequence[int]) -> list[Any]:
        """``streams`` as the device's streams (``None`` entries kept)."""
        if streams is None:
            return []
        try:
            items = list(streams)
        except TypeError:
            raise TypeError(f"streams: expected a sequence of torch.{name}.Stream or None, "
                            f"got {type(streams).__name__}") from None
        by_id = mod._stream_state.by_id
        out: list[Any] = []
        for i, s in enumerate(items):
            if s is None or isinstance(s, mod.Stream):
                out.append(s)
            elif isinstance(s, torch.Stream) and s.device_type == _PRIVATE_USE1:
                if backend._guard_device is None and s.stream_id == 0 and i < len(targets):
                    # PyTorch's Python guard names every stream it makes device 0's default
                    # stream: the only stream it can mean is the target's default stream
                    out.append(mod.default_stream(targets[i]))
                else:
                    found = by_id.get((s.device_index, s.stream_id))
                    if found is None:
                        raise RuntimeError(f"stream at index {i} ({s}) is not a stream of "
                                           f"this process; create it with torch.{name}.Stream")
                    out.append(found)
            else:
                raise RuntimeError(f"Unknown data type found in stream list. Need "
                                   f"torch.{name}.Stream or None")
        return out

    def stream_for(guard: list[Any], streams: list[Any], i: int, index: int) -> Any:
        """The stream the copy of chunk ``i`` to ``index`` goes to: CUDA's optional stream
        guard keeps the last stream set, and only on that stream's device."""
        if i < len(streams) and streams[i] is not None:
            s = streams[i]
            if s.device_index != index:
                raise RuntimeError(
                    f"Expected the device associated with the stream at index {i} (was "
                    f"{s.device_index}) to match the device supplied at that index (expected "
                    f"{index})")
            guard[0] = s
        s = guard[0]
        return s if s is not None and s.device_index == index else None

    def broadcast_out(tensor: torch.Tensor, out: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        out = _tensor_list(out, "_broadcast_out")
        check_source(tensor, "broadcast")
        check_outputs(out)
        for i, o in enumerate(out):
            if o.shape != tensor.shape:
                raise RuntimeError(
                    f"Expected all output tensors to have same shape as the source tensor "
                    f"{list(tensor.shape)}, but output tensor at index {i} has shape "
                    f"{list(o.shape)}")
        for o in out:
            o.copy_(tensor, non_blocking=True)
        return out

    def broadcast(tensor: torch.Tensor, devices: Sequence[int]) -> list[torch.Tensor]:
        devices = [operator.index(d) for d in devices]
        check_source(tensor, "broadcast")
        own = tensor.get_device() if is_dev(tensor) else -1
        result = []
        for d in devices:
            if d < 0:
                raise RuntimeError(f"Expected non-negative device index, but got {d}")
            if d == own:
                result.append(tensor)
            else:
                result.append(torch.empty(tensor.shape, dtype=tensor.dtype,
                                          device=device(d)).copy_(tensor, non_blocking=True))
        return result

    def broadcast_coalesced(tensors: Sequence[torch.Tensor], devices: Sequence[int],
                            buffer_size: int) -> list[list[torch.Tensor]]:
        tensors = _tensor_list(tensors, "_broadcast_coalesced")
        devices = [operator.index(d) for d in devices]
        buffer_size = operator.index(buffer_size)
        if not devices:
            raise RuntimeError("Expected at least one device to broadcast to")
        for i, t in enumerate(tensors):
            if not is_dev(t) or t.get_device() != devices[0]:
                raise RuntimeError(
                    f"All tensors must be on devices[0]: {devices[0]} (tensor at index {i} "
                    f"is on {t.device}); move them to {name}:{devices[0]} first")
        outputs: list[list[Any]] = [list(tensors)]
        outputs += [[None] * len(tensors) for _ in devices[1:]]
        with mod.device(devices[0]):
            for chunk in _take_tensors(tensors, buffer_size):
                parts = [tensors[i] for i in chunk]
                copies = broadcast(_flatten_dense_tensors(parts), devices)
                for k in range(1, len(devices)):
                    with mod.device(devices[k]):
                        views = _unflatten_dense_tensors(copies[k], parts)
                    for i, v in zip(chunk, views, strict=True):
                        # ``.data``: its own version counter, as CUDA re-wraps them
                        outputs[k][i] = v.data
        return outputs

    def scatter(tensor: torch.Tensor, devices: Sequence[int], chunk_sizes: Sequence[int] | None,
                dim: int, streams: Any) -> list[torch.Tensor]:
        devices = [operator.index(d) for d in devices]
        if not devices:
            raise RuntimeError("Expected at least one device to scatter to")
        if chunk_sizes is not None:
            chunk_sizes = [operator.index(c) for c in chunk_sizes]
            if len(chunk_sizes) != len(devices):
                raise RuntimeError(
                    f"Expected devices and chunk_sizes to be of same length, but got "
                    f"len(devices) = {len(devices)} and len(chunk_sizes) = {len(chunk_sizes)}")
        check_source(tensor, "scatter")
        dim = wrap_dim(operator.index(dim), tensor)
        chunks = list(tensor.split_with_sizes(chunk_sizes, dim) if chunk_sizes is not None
                      else tensor.chunk(len(devices), dim))
        own = tensor.get_device() if is_dev(tensor) else -1
        own_s = own_streams(streams, devices)
        guard: list[Any] = [None]
        for i, c in enumerate(chunks):
            d = devices[i]
            if d == own:
                continue
            s = stream_for(guard, own_s, i, d)
            if d < 0:
                raise RuntimeError(f"Expected non-negative device index, but got {d}")
            with mod.stream(s):
                chunks[i] = c.to(device(d), non_blocking=True)
        return chunks

    def scatter_out(tensor: torch.Tensor, out: Sequence[torch.Tensor], dim: int,
                    streams: Any) -> list[torch.Tensor]:
        out = _tensor_list(out, "_scatter_out")
        if not out:
            raise RuntimeError("Expected at least one output tensor to scatter to")
        check_source(tensor, "scatter")
        dim = wrap_dim(operator.index(dim), tensor)
        check_outputs(out)
        sizes = []
        for i, o in enumerate(out):
            same = o.dim() == tensor.dim()
            if same:
                sizes.append(o.shape[dim])
                same = [*o.shape[:dim], tensor.shape[dim], *o.shape[dim + 1:]] == list(tensor.shape)
            if not same:
                raise RuntimeError(
                    f"Output tensor at index {i} has incorrect shape: {list(o.shape)}. Expected "
                    f"same shape except for scatter dim {dim} as the source tensor: "
                    f"{list(tensor.shape)}")
        if sum(sizes) != tensor.shape[dim]:
            raise RuntimeError(
                f"Total size for output tensors along scatter dim {dim} does not match the "
                f"source tensor size at dim {dim}. Expected {tensor.shape[dim]}, but got total "
                f"size {sum(sizes)}")
        chunks = tensor.split_with_sizes(sizes, dim)
        own_s = own_streams(streams, [o.get_device() for o in out])
        guard: list[Any] = [None]
        for i, (o, c) in enumerate(zip(out, chunks, strict=True)):
            with mod.stream(stream_for(guard, own_s, i, o.get_device())):
                o.copy_(c, non_blocking=True)
        return out

    def gather_into(tensors: Sequence[torch.Tensor], out: torch.Tensor, dim: int) -> torch.Tensor:
        non_blocking = is_dev(out)
        chunks = out.split_with_sizes([t.shape[dim] for t in tensors], dim)
        for c, t in zip(chunks, tensors, strict=True):
            c.copy_(t, non_blocking=non_blocking)
        return out

    def gather_out(tensors: Sequence[torch.Tensor], out: torch.Tensor, dim: int) -> torch.Tensor:
        tensors = _tensor_list(tensors, "_gather_out")
        if not tensors:
            raise RuntimeError("Expected at least one tensor to gather from")
        dim = wrap_dim(operator.index(dim), tensors[0])
        expected = check_inputs(tensors, dim)
        if list(out.shape) != expected:
            raise RuntimeError(f"Expected out tensor to have shape {expected}, but got "
                               f"{list(out.shape)}")
        return gather_into(tensors, out, dim)

    def gather(tensors: Sequence[torch.Tensor], dim: int,
               destination_index: int | None) -> torch.Tensor:
        tensors = _tensor_list(tensors, "_gather")
        if not tensors:
            raise RuntimeError("Expected at least one tensor to gather from")
        dim = wrap_dim(operator.index(dim), tensors[0])
        expected = check_inputs(tensors, dim)
        fmt = suggest_memory_format(tensors[0])
        if any(suggest_memory_format(t) != fmt for t in tensors[1:]):
            fmt = torch.contiguous_format
        if destination_index is None:
            where = device(backend.current_device())
        elif operator.index(destination_index) == -1:
            where = torch.device("cpu")
        else:
            where = device(operator.index(destination_index))
        out = torch.empty(expected, dtype=tensors[0].dtype, device=where, memory_format=fmt)
        return gather_into(tensors, out, dim)

    return {"_broadcast_coalesced": broadcast_coalesced, "_broadcast": broadcast,
            "_broadcast_out": broadcast_out, "_scatter": scatter, "_scatter_out": scatter_out,
            "_gather": gather, "_gather_out": gather_out}


def _device_types(args: Sequence[Any]) -> set[str]:
    """The device types of the tensors and streams among ``args`` (and in their lists)."""
    kinds: set[str] = set()
    for a in args:
        for item in a if isinstance(a, (list, tuple)) else (a,):
            where = getattr(item, "device", None) if isinstance(
                item, (torch.Tensor, torch.Stream)) else None
            if isinstance(where, torch.device):
                kinds.add(where.type)
    return kinds


def route(name: str, own: Callable[..., Any], build: Callable[..., Any]) -> Callable[..., Any]:
    """One function over the device's ``own`` and the build's (CUDA's) ``build``: the
    device's when a tensor or stream argument is on it; CUDA's when one is on CUDA, or
    when none is on either (CPU tensors and device indices) and a CUDA device is usable;
    else the device's (where the build's could only fail: "Found no NVIDIA driver")."""

    def call(*args: Any, **kwargs: Any) -> Any:
        kinds = _device_types((*args, *kwargs.values()))
        if name not in kinds and ("cuda" in kinds or compat.cuda_usable()):
            return build(*args, **kwargs)
        return own(*args, **kwargs)

    call.__wrapped__ = build  # type: ignore[attr-defined]
    return call


def install(backend: DeviceBackend, mod: Any) -> list[str]:
    """Give ``torch._C`` the functions for ``backend``: added where it lacks them, routed
    (:func:`route`) where it has them; the names added or wrapped."""
    done = []
    for attr, fn in make_comm(backend, mod).items():
        existing = getattr(torch._C, attr, None)
        if getattr(existing, "__module__", None) == __name__:
            continue  # installed already
        if existing is not None:
            fn = route(backend.name, fn, existing)
        fn.__name__ = fn.__qualname__ = attr
        fn.__module__ = __name__
        setattr(torch._C, attr, fn)
        done.append(attr)
    return done


def on_register(backend: DeviceBackend, module: Any) -> None:
    """The feature's install as ``backend`` registers (:mod:`torchport.features`)."""
    install(backend, module)
