"""A vendor's out= kernel written in C: its arguments as ``torchport_kernel.h`` describes.

A vendor with a C library declares a kernel by its function's address
(``KernelSet.c_out_kernel("add.out", lib.vendor_add_out)``, ``lib`` a ``ctypes.CDLL``).
torchport derives the functional and in-place overloads from it as from a Python
``out_kernel``; C++ (``native_vendor_kernels.cpp``) calls the function itself, without
Python. :class:`CKernel` is its Python twin: the same call through ``ctypes`` for the calls
Python serves (ops intercepted, no C++ library, a layout C++ leaves to Python), so that the
kernel sees the same arguments either way: DLPack tensors (the runtime's address of the
first element, strides in elements, ``kDLExtDev`` and the logical index), numbers, lists,
strings and dtypes, in the ``out=`` overload's schema order.
"""

from __future__ import annotations

import ctypes
import operator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from torchport.ops.declarations import CFunction, Decline

if TYPE_CHECKING:
    from torchport.core.contracts import DeviceBackend

#: The header a C kernel includes (``#include "torchport_kernel.h"``; DLPack's header from
#: torch's ``include/`` directory, ``ATen/dlpack.h``, or ``dlpack/dlpack.h``).
HEADER = Path(__file__).parent.parent / "csrc" / "torchport_kernel.h"

ABI = 1
NONE, TENSOR, INT, FLOAT, BOOL, COMPLEX, TENSOR_LIST, INT_LIST, FLOAT_LIST, STRING, DTYPE = range(11)
OK, DECLINE, ERROR = 0, 1, 2
_DL_CPU, _DL_EXT_DEV = 1, 12
_DL_INT, _DL_UINT, _DL_FLOAT, _DL_BFLOAT, _DL_COMPLEX, _DL_BOOL = 0, 1, 2, 4, 5, 6

_CODES: dict[torch.dtype, int] = {
    torch.bool: _DL_BOOL, torch.uint8: _DL_UINT, torch.uint16: _DL_UINT,
    torch.uint32: _DL_UINT, torch.uint64: _DL_UINT, torch.int8: _DL_INT,
    torch.int16: _DL_INT, torch.int32: _DL_INT, torch.int64: _DL_INT,
    torch.float16: _DL_FLOAT, torch.float32: _DL_FLOAT, torch.float64: _DL_FLOAT,
    torch.bfloat16: _DL_BFLOAT, torch.complex32: _DL_COMPLEX, torch.complex64: _DL_COMPLEX,
    torch.complex128: _DL_COMPLEX}

#: Schema argument types a C kernel can be given.
_TYPES = frozenset({"Tensor", "Tensor?", "List[Tensor]", "int", "int?", "float", "float?",
                    "bool", "bool?", "number", "number?", "List[int]", "List[int]?",
                    "List[float]", "List[float]?", "str", "str?", "ScalarType",
                    "ScalarType?"})


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class TorchportArg(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int32), ("count", ctypes.c_int32), ("name", ctypes.c_char_p),
                ("tensor", DLTensor), ("tensors", ctypes.POINTER(DLTensor)),
                ("i", ctypes.c_int64), ("f", ctypes.c_double * 2),
                ("ints", ctypes.POINTER(ctypes.c_int64)),
                ("floats", ctypes.POINTER(ctypes.c_double)), ("str", ctypes.c_char_p),
                ("dtype", DLDataType)]


class TorchportCall(ctypes.Structure):
    _fields_ = [("abi", ctypes.c_int32), ("nargs", ctypes.c_int32),
                ("args", ctypes.POINTER(TorchportArg)), ("device", ctypes.c_int32),
                ("stream", ctypes.c_int64), ("error", ctypes.c_char_p),
                ("error_size", ctypes.c_size_t)]


_KERNEL = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.POINTER(TorchportCall))


def dl_dtype(dtype: torch.dtype) -> DLDataType | None:
    """DLPack's type of ``dtype`` (``None``: not one a C kernel is given)."""
    code = _CODES.get(dtype)
    return None if code is None else DLDataType(code, dtype.itemsize * 8, 1)


def check_schema(op: torch._ops.OpOverload) -> None:
    """Refuse, at declaration, an op whose arguments a C kernel cannot be given."""
    for a in op._schema.arguments:
        name = _type_name(a)
        if name not in _TYPES:
            raise ValueError(f"c_out_kernel({op}): argument {a.name!r} of type {name} has no "
                             "C form (torchport_kernel.h); declare a Python out_kernel for it")


def stream_handle(backend: DeviceBackend, index: int) -> int:
    """The runtime's handle of device ``index``'s current stream, as a C kernel gets it (0:
    the default stream; a handle that is not an int gives its ``__index__``)."""
    handle = backend.current_stream_handle(index)
    if handle is None:
        return 0
    try:
        return operator.index(handle)
    except TypeError:
        raise TypeError(f"{backend.name}: a C kernel is given the runtime's stream handle as an "
                        f"int64, and this runtime's create_stream returned a "
                        f"{type(handle).__name__}; return an int (the address of your queue) "
                        f"or give the handle an __index__") from None


class CKernel:
    """``fn``'s C function called through ``ctypes`` with ``out_op``'s arguments."""

    def __init__(self, fn: CFunction, out_op: torch._ops.OpOverload,
                 backend: DeviceBackend) -> None:
        check_schema(out_op)
        self.address = fn.address
        self.out_op = out_op
        self.backend = backend
        self._call = _KERNEL(fn.address)
        self._names = [(a.name, a.kwarg_only, a.name.encode(), _type_name(a))
                       for a in out_op._schema.arguments]

    def __repr__(self) -> str:
        return f"<C kernel of {self.out_op} at {self.address:#x}>"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        n = len(self._names)
        packed = (TorchportArg * n)()
        keep: list[Any] = []
        index = None
        positional = iter(args)
        for i, (name, kwarg_only, bname, tname) in enumerate(self._names):
            if kwarg_only or i >= len(args):
                v = kwargs.get(name)
            else:
                v = next(positional)
            a = packed[i]
            a.name = bname
            if isinstance(v, torch.Tensor) and index is None and v.device.type != "cpu":
                index = v.device.index
            self._pack(a, v, tname, keep)
        if index is None:
            index = self.backend.current_device()
        error = ctypes.create_string_buffer(1024)
        call = TorchportCall(ABI, n, packed, index, stream_handle(self.backend, index),
                             ctypes.cast(error, ctypes.c_char_p), len(error))
        rc = self._call(ctypes.byref(call))
        if rc == DECLINE:
            raise Decline(f"{self.out_op}: the vendor's C kernel declined")
        if rc != OK:
            text = error.value.decode(errors="replace") if rc == ERROR else f"returned {rc}"
            raise RuntimeError(f"{_overload(self.out_op)}: the vendor's C kernel failed: {text}")
        return kwargs.get("out")

    @staticmethod
    def _tensor(t: torch.Tensor, into: DLTensor, keep: list[Any]) -> None:
        dt = dl_dtype(t.dtype)
        if dt is None or t.layout != torch.strided or t.is_conj() or t.is_neg():
            raise Decline(f"a C kernel is not given {t.dtype} {t.layout} tensors")
        shape = (ctypes.c_int64 * max(t.dim(), 1))(*t.shape)
        strides = (ctypes.c_int64 * max(t.dim(), 1))(*t.stride())
        keep += (shape, strides)
        into.data = t.data_ptr() if t.numel() else None
        cpu = t.device.type == "cpu"
        into.device = DLDevice(_DL_CPU if cpu else _DL_EXT_DEV, 0 if cpu else t.device.index)
        into.ndim = t.dim()
        into.dtype = dt
        into.shape = shape
        into.strides = strides
        into.byte_offset = 0

    def _pack(self, a: TorchportArg, v: Any, tname: str, keep: list[Any]) -> None:
        if v is None:
            a.kind = NONE
        elif isinstance(v, torch.Tensor):
            a.kind = TENSOR
            self._tensor(v, a.tensor, keep)
        elif tname.startswith("ScalarType"):
            dt = dl_dtype(v)
            if dt is None:
                raise Decline(f"a C kernel is not given dtype {v}")
            a.kind, a.dtype = DTYPE, dt
        elif tname.startswith("List[Tensor]"):
            arr = (DLTensor * max(len(v), 1))()
            for x, into in zip(v, arr, strict=False):
                self._tensor(x, into, keep)
            keep.append(arr)
            a.kind, a.count, a.tensors = TENSOR_LIST, len(v), arr
        elif tname.startswith("List[int]"):
            ints = (ctypes.c_int64 * max(len(v), 1))(*v)
            keep.append(ints)
            a.kind, a.count, a.ints = INT_LIST, len(v), ints
        elif tname.startswith("List[float]"):
            floats = (ctypes.c_double * max(len(v), 1))(*(float(x) for x in v))
            keep.append(floats)
            a.kind, a.count, a.floats = FLOAT_LIST, len(v), floats
        elif isinstance(v, bool):
            a.kind, a.i = BOOL, int(v)
        elif isinstance(v, int):
            a.kind, a.i = INT, v
        elif isinstance(v, float):
            a.kind = FLOAT
            a.f[0] = v
        elif isinstance(v, complex):
            a.kind = COMPLEX
            a.f[0], a.f[1] = v.real, v.imag
        elif isinstance(v, str):
            raw = v.encode()
            keep.append(raw)
            a.kind, a.str, a.count = STRING, raw, len(raw)
        else:
            raise Decline(f"a C kernel is not given a {type(v).__name__}")


def _type_name(a: Any) -> str:
    t = a.real_type
    return str(t.getElementType()) + "?" if isinstance(t, torch.OptionalType) else str(t)


def _overload(op: torch._ops.OpOverload) -> str:
    s = op._schema
    return s.name.split("::")[1] + ("." + s.overload_name if s.overload_name else "")
