"""The OpenCL backend's kernels: OpenCL C generated per op, dtype and rank, launched on the
tensor's current stream (an in-order queue) with buffer arguments found through the
runtime's segment table.

Every kernel reads its operands where they are, strided (views, broadcast inputs with
stride 0, storage offsets), so no kernel copies an input first (but the GEMM's transposed
right operand, copied once so that its rows load as vectors). Three generators cover the
ops: elementwise (any number of inputs, broadcasting, type promotion as PyTorch's
``elementwise_dtypes`` says, the computation in PyTorch's "opmath" type), row kernels
(one work-item per output element looping over the reduced dimensions: reductions,
softmax) and a register-blocked GEMM. Programs are built once per source and device, on
first use (PoCL and pyopencl keep built binaries on disk); the generated source is kept per
signature (op, dtypes, rank), so a warm call builds no string, and each kernel's scalar
parameter types are declared to pyopencl once, so arguments are packed without numpy's
generic path. What no kernel here handles raises :class:`~torchport.ops.Decline`:
decompositions, then the CPU fallback, take it.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyopencl as cl
import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND as PROMOTE
from torch._prims_common import elementwise_dtypes

import torchport
from torchport.backends.opencl.runtime import REPORT_INDEX, OpenCLRuntime
from torchport.core import settings
from torchport.ops import Decline, KernelSet

_CL = {torch.float32: "float", torch.float64: "double", torch.float16: "half",
       torch.int64: "long", torch.int32: "int", torch.int16: "short", torch.int8: "char",
       torch.uint8: "uchar", torch.bool: "uchar"}
_NP = {torch.float32: np.float32, torch.float64: np.float64, torch.int64: np.int64,
       torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8,
       torch.uint8: np.uint8, torch.bool: np.uint8}
FLOATS = (torch.float32, torch.float64, torch.float16)
# index kernels whose CPU counterparts raise IndexError for a bad index (embedding's too)
_LOOKUP_ERRORS = frozenset({"index_select", "embedding_dense_backward"})
DTYPES = frozenset(_CL)
_OPTIONS = ["-cl-fp32-correctly-rounded-divide-sqrt"]  # IEEE division and sqrt, as the CPU
# a float rounded to float16 and back (vstore_half needs no cl_khr_fp16)
_ROUND_HALF = """inline float round_half(float v) {
  ushort h; vstore_half_rte(v, 0, (__private half*)&h); return vload_half(0, (__private const half*)&h);
}
"""

# Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3"): the first
# output word at counter (i, 0, 0, 0), as a uniform float in [0, 1) from its top 24 bits
_PHILOX = """inline float philox_uniform(ulong i, uint k0, uint k1) {
  uint c0 = (uint)i, c1 = (uint)(i >> 32), c2 = 0, c3 = 0;
  for (int r = 0; r < 10; r++) {
    ulong p0 = (ulong)0xD2511F53u * c0, p1 = (ulong)0xCD9E8D57u * c2;
    uint n0 = (uint)(p1 >> 32) ^ c1 ^ k0, n2 = (uint)(p0 >> 32) ^ c3 ^ k1;
    c1 = (uint)p1; c3 = (uint)p0; c0 = n0; c2 = n2;
    k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
  }
  return (float)(c0 >> 8) * 0x1.0p-24f;
}
"""


# OpenCL C scalar parameter types -> the numpy type pyopencl packs the argument as
_PARAM = {"long": np.int64, "ulong": np.uint64, "int": np.int32, "uint": np.uint32,
          "short": np.int16, "ushort": np.uint16, "char": np.int8, "uchar": np.uint8,
          "float": np.float32, "double": np.float64}
_SIGNATURE = re.compile(r"__kernel\s+void\s+\w+\s*\(([^)]*)\)")


def scalar_arg_dtypes(source: str) -> list[Any] | None:
    """Per parameter of ``source``'s kernel the numpy type of a scalar, ``None`` for a
    pointer: with them set, pyopencl packs arguments directly (a numpy scalar otherwise
    goes through its generic buffer path, several microseconds per argument). ``None``
    when a parameter type is not one of :data:`_PARAM`."""
    found = _SIGNATURE.search(source)
    if found is None:
        return None
    dtypes: list[Any] = []
    for param in found.group(1).split(","):
        if "*" in param:
            dtypes.append(None)
            continue
        words = param.split()
        if len(words) != 2 or words[0] not in _PARAM:
            return None
        dtypes.append(_PARAM[words[0]])
    return dtypes


class Programs:
    """Built programs per (device, source): compiled on first use, then reused. A kernel's
    scalar parameter types are declared to pyopencl once (:func:`scalar_arg_dtypes`), so
    scalar arguments may be Python numbers or numpy scalars."""

    def __init__(self, runtime: OpenCLRuntime) -> None:
        self.runtime = runtime
        self.kernels: dict[tuple[int, str], cl.Kernel] = {}
        self.lock = threading.Lock()  # a kernel object's arguments are set, then enqueued

    def kernel(self, index: int, source: str) -> cl.Kernel:
        k = self.kernels.get((index, source))
        if k is None:
            head = "#pragma OPENCL FP_CONTRACT OFF\n"  # no fused multiply-add: the CPU's rounding
            if self.runtime.fp64[index]:
                head += "#pragma OPENCL EXTENSION cl_khr_fp64 : enable\n"
            if "round_half(" in source:
                head += _ROUND_HALF
            if "philox_uniform(" in source:
                head += _PHILOX
            if "report_index(" in source:
                head += REPORT_INDEX
            program = cl.Program(self.runtime.contexts[index], head + source).build(_OPTIONS)
            k = program.all_kernels()[0]
            dtypes = scalar_arg_dtypes(source)
            if dtypes is not None and len(dtypes) == k.num_args:
                k.set_scalar_arg_dtypes(dtypes)
            self.kernels[(index, source)] = k
        return k

    def run(self, index: int, queue: cl.CommandQueue, source: str, size: Sequence[int],
            args: list[Any], local: Sequence[int] | None = None) -> None:
        k = self.kernel(index, source)
        with self.lock:
            k(queue, tuple(size), None if local is None else tuple(local), *args)


@dataclass
class Operand:
    """A kernel argument: a device tensor (buffer, byte offset, strides) or a scalar."""

    dtype: torch.dtype
    tensor: torch.Tensor | None = None
    value: Any = None


def _operand(v: Any) -> Operand:
    if isinstance(v, torch.Tensor):
        if v.device.type == "cpu":
            if v.dim() != 0:
                raise Decline("a CPU tensor operand")
            return Operand(v.dtype, value=v.item())
        if v.dtype not in DTYPES or v.is_conj() or v.is_neg():
            raise Decline(f"ocl kernels do not handle {v.dtype}")
        return Operand(v.dtype, tensor=v)
    if isinstance(v, bool):
        return Operand(torch.bool, value=v)
    if isinstance(v, int):
        return Operand(torch.int64, value=v)
    if isinstance(v, float):
        return Operand(torch.float64, value=v)
    raise Decline(f"operand {type(v).__name__}")


def _coalesce(sizes: list[int], strides: list[list[int]]) -> tuple[list[int], list[list[int]]]:
    """Drop size-1 dimensions and merge neighbours every operand walks as one (the order of
    elements is kept: row-major over ``sizes``)."""
    keep = [d for d, s in enumerate(sizes) if s != 1]
    sizes = [sizes[d] for d in keep]
    strides = [[st[d] for d in keep] for st in strides]
    i = len(sizes) - 1
    while i > 0:
        if all(st[i - 1] == st[i] * sizes[i] for st in strides):
            sizes[i - 1] *= sizes[i]
            for st in strides:
                st[i - 1] = st[i]
                del st[i]
            del sizes[i]
        i -= 1
    return sizes, strides


def _load(dtype: torch.dtype, ptr: str, index: str) -> str:
    if dtype == torch.float16:
        return f"vload_half({index}, (__global const half*)({ptr}))"
    return f"((__global const {_CL[dtype]}*)({ptr}))[{index}]"


def _store(dtype: torch.dtype, ptr: str, index: str, value: str) -> str:
    if dtype == torch.float16:
        return f"vstore_half_rte((float)({value}), {index}, (__global half*)({ptr}));"
    if dtype == torch.bool:
        return f"((__global uchar*)({ptr}))[{index}] = ({value}) != 0;"
    return f"((__global {_CL[dtype]}*)({ptr}))[{index}] = ({_CL[dtype]})({value});"


def _ctype(dtype: torch.dtype) -> str:
    """The C type a value of ``dtype`` is computed in (half: in float, as PyTorch's opmath)."""
    return "float" if dtype == torch.float16 else _CL[dtype]


def _scalar(dtype: torch.dtype, value: Any) -> Any:
    return _NP[torch.float32 if dtype == torch.float16 else dtype](value)


def _positions(rank: int, count: int) -> list[str]:
    """C statements: ``q{k}``, element ``r`` of the index space ``z0..`` in operand ``k``'s
    strides ``t{k}_0..`` (one dimension: no division, the common contiguous case)."""
    if rank == 1:
        return [f"q{k} = r * t{k}_0;" for k in range(count)]
    return [f"{{ long c = r % z{d}; r /= z{d}; "
            + " ".join(f"q{k} += c * t{k}_{d};" for k in range(count)) + "}"
            for d in reversed(range(rank))]


def _broadcast_strides(t: torch.Tensor, shape: Sequence[int]) -> list[int]:
    """``t``'s strides broadcast to ``shape`` (``t.expand(shape).stride()`` without making
    the view; the meta kernel that shaped the output checked the shapes)."""
    lead = len(shape) - t.dim()
    own, sizes = t.stride(), t.shape
    if lead < 0 or any(n != 1 and n != shape[d + lead] for d, n in enumerate(sizes)):
        return list(t.expand(shape).stride())  # raises expand's error
    return [0 if d < lead or (sizes[d - lead] == 1 and shape[d] != 1) else own[d - lead]
            for d in range(len(shape))]


def _elementwise_source(out_dtype: torch.dtype, ops: Sequence[Operand],
                        computes: Sequence[torch.dtype], rank: int, expr: str,
                        scalars: Sequence[torch.dtype], at: Sequence[str | None], pre: str,
                        checked: int | None) -> str:
    """OpenCL C of :meth:`Launcher.elementwise`: one work-item per output element; the
    parameters are ``n``, the sizes, per tensor (output first) its buffer, byte offset and
    strides, the scalar operands, the ``scalars``, and for a ``checked`` input the
    extent and the error word's arguments."""
    count = 1 + sum(o.tensor is not None for o in ops)
    params = ["long n"] + [f"long z{d}" for d in range(rank)]
    body = ["long i = get_global_id(0);", "if (i >= n) return;", "long r = i;"]
    for k in range(count):
        params += [f"__global char* p{k}", f"ulong o{k}"] + [f"long t{k}_{d}" for d in range(rank)]
        body.append(f"long q{k} = 0;")
    body += _positions(rank, count)
    k = 1
    for j, (o, ct) in enumerate(zip(ops, computes, strict=True)):
        if o.tensor is not None:
            where = at[j] if j < len(at) and at[j] is not None else f"q{k}"
            where = where.replace("QSELF", f"q{k}")
            body.append(f"{_ctype(ct)} a{j} = ({_ctype(ct)})"
                        f"{_load(o.dtype, f'p{k} + o{k}', where)};")
            if checked == j:
                body.append(f"if (a{j} < 0 || a{j} >= ext) "
                            f"{{ report_index(err, eop, edim, a{j}, ext); return; }}")
            k += 1
        else:
            params.append(f"{_ctype(ct)} a{j}")
    for j, dt in enumerate(scalars):
        params.append(f"{_ctype(dt)} s{j}")
    if checked is not None:
        params += ["long ext", "__global long* err", "long eop", "long edim"]
    if pre:
        body.append(pre)
    body.append(_store(out_dtype, "p0 + o0", "q0", expr))
    return f"__kernel void elementwise({', '.join(params)}) {{\n  " + "\n  ".join(body) + "\n}\n"


def _rows_source(outs: int, inputs: Sequence[torch.dtype], kept: int, reduced: int,
                 body: str, extra: Sequence[str]) -> str:
    """OpenCL C of :meth:`Launcher.rows`: parameters ``n``, ``m``, the kept and the reduced
    sizes, per tensor (outputs, then inputs) its buffer, byte offset and strides over the
    kept dims, per input its strides over the reduced dims, then ``extra``."""
    count = outs + len(inputs)
    params = ["long n", "long m"] + [f"long z{d}" for d in range(kept)] \
        + [f"long y{d}" for d in range(reduced)]
    code = ["long i = get_global_id(0);", "if (i >= n) return;", "long r = i;"]
    for k in range(count):
        params += [f"__global char* p{k}", f"ulong o{k}"] + [f"long t{k}_{d}" for d in range(kept)]
        code.append(f"long q{k} = 0;")
    for j in range(len(inputs)):
        params += [f"long u{outs + j}_{d}" for d in range(reduced)]
    code += _positions(kept, count)
    macros = []
    for j, dtype in enumerate(inputs):
        k = outs + j
        macros.append(f"inline long inner{k}(long j{''.join(f', long y{d}, long u{d}' for d in range(reduced))}) "
                      + ("{ return j * u0; }" if reduced == 1 else  # j < y0: no division
                         "{ long q = 0; " + " ".join(f"q += (j % y{d}) * u{d}; j /= y{d};"
                                                      for d in reversed(range(reduced)))
                         + " return q; }"))
        call = f"inner{k}(j{''.join(f', y{d}, u{k}_{d}' for d in range(reduced))})"
        code.append(f"#define IN{j}(j) ({_load(dtype, f'p{k} + o{k}', f'q{k} + {call}')})")
    params += extra
    code.append(body)
    return "\n".join(macros) + f"\n__kernel void rows({', '.join(params)}) {{\n  " \
        + "\n  ".join(code) + "\n}\n"


class Launcher:
    """Builds and enqueues the generated kernels for one runtime."""

    def __init__(self, runtime: OpenCLRuntime) -> None:
        self.runtime = runtime
        self.programs = Programs(runtime)
        self.placeholders: dict[int, cl.Buffer] = {}
        self.sources: dict[tuple, str] = {}  # generated source per kernel signature

    def _where(self, t: torch.Tensor) -> tuple[int, cl.CommandQueue]:
        index = torchport.device_index(t)
        return index, self.runtime.queue(index, torchport.current_stream(t))

    def _buffer(self, index: int, t: torch.Tensor) -> list[Any]:
        if t.numel() == 0:  # owns no memory, and no work-item reads it
            if index not in self.placeholders:
                self.placeholders[index] = cl.Buffer(self.runtime.contexts[index],
                                                     cl.mem_flags.READ_WRITE, 256)
            return [self.placeholders[index], np.uint64(0)]
        buf, off = self.runtime.locate(index, torchport.device_address(t))
        return [buf, off]

    def index_error(self, t: torch.Tensor, op: str, dim: int) -> list[Any]:
        """The arguments ``__global long* err, long eop, long edim`` of a kernel on ``t``'s
        stream that checks its indices (``report_index``: the runtime's error word)."""
        word, code = self.runtime.error_word(torchport.device_index(t),
                                             torchport.current_stream(t), op,
                                             lookup=op in _LOOKUP_ERRORS)
        return [word, np.int64(code), np.int64(dim)]

    def after_index_kernel(self, t: torch.Tensor) -> None:
        """``TORCHPORT_LAUNCH_BLOCKING=1``: wait for the kernel just queued on ``t``'s stream,
        so that a bad index raises at its op (as ``CUDA_LAUNCH_BLOCKING=1``)."""
        if settings.get("TORCHPORT_LAUNCH_BLOCKING"):
            self.runtime.synchronize_stream(torchport.device_index(t),
                                            torchport.current_stream(t))

    # ---- elementwise ----
    def elementwise(self, out: torch.Tensor, inputs: Sequence[Any], expr: str,
                    compute: torch.dtype | Sequence[torch.dtype],
                    scalars: Sequence[tuple[torch.dtype, Any]] = (),
                    at: Sequence[str | None] = (), pre: str = "",
                    index_check: tuple[int, int, str, int] | None = None) -> torch.Tensor:
        """``out[i] = expr`` over ``out``'s elements: ``a0``, ``a1``, ... are the inputs
        (broadcast to ``out``) converted to the computation type (``compute``: one, or one
        per input), ``s0``, ``s1``, ... the ``scalars``. ``at[j]``: a C expression for the
        element index input ``j`` is read at instead of its own position ``q{k}`` (indexed
        reads: earlier ``a``'s are in scope); ``pre``: C statements before the store (``i``
        is the row-major output element). ``index_check``: ``(j, extent, op, dim)``, input
        ``j`` is an index into a dimension of ``extent`` elements; an element whose index is
        out of range reads and writes nothing and reports it (the runtime's error word)."""
        if out.numel() == 0:
            return out
        ops = [_operand(v) for v in inputs]
        computes = (compute,) * len(ops) if isinstance(compute, torch.dtype) else tuple(compute)
        index, queue = self._where(out)
        shape = out.shape
        tensors = [out] + [o.tensor for o in ops if o.tensor is not None]
        device = out.device
        strides = [list(out.stride())]
        for t in tensors[1:]:
            if t.device != device:
                raise Decline("operands on two devices")
            strides.append(_broadcast_strides(t, shape))
        sizes, strides = _coalesce(list(shape), strides)
        key = ("elementwise", expr, computes, tuple((o.dtype, o.tensor is None) for o in ops),
               out.dtype, len(sizes), tuple(dt for dt, _ in scalars), tuple(at), pre,
               None if index_check is None else index_check[0])
        source = self.sources.get(key)
        if source is None:
            source = self.sources[key] = _elementwise_source(
                out.dtype, ops, computes, len(sizes), expr, [dt for dt, _ in scalars], at, pre,
                None if index_check is None else index_check[0])
        args: list[Any] = [out.numel(), *sizes]
        for t, st in zip(tensors, strides, strict=True):
            args += self._buffer(index, t)
            args += st
        for o, ct in zip(ops, computes, strict=True):
            if o.tensor is None:
                args.append(_scalar(ct, o.value))
        for dt, v in scalars:
            args.append(_scalar(dt, v))
        if index_check is not None:
            args += [index_check[1]] + self.index_error(out, index_check[2], index_check[3])
        self.programs.run(index, queue, source, [args[0]], args)
        if index_check is not None:
            self.after_index_kernel(out)
        return out

    # ---- row kernels: one work-item per output element, a loop over reduced dims ----
    def rows(self, outs: Sequence[torch.Tensor], out_kept: Sequence[Sequence[int]],
             inputs: Sequence[torch.Tensor], kept: Sequence[int], reduced: Sequence[int],
             body: str, extra: Sequence[tuple[str, Any]] = ()) -> None:
        """For each position over ``inputs[0]``'s dims ``kept``: ``body`` with ``m``
        (the number of reduced elements), ``IN{k}(j)`` (element ``j`` of input ``k`` along
        the reduced dims, row-major) and output ``k`` at ``p{k} + o{k}``, element ``q{k}``.
        ``out_kept``: each output's strides over ``kept``; ``extra``: more kernel parameters
        (declaration, value)."""
        x = inputs[0]
        index, queue = self._where(x)
        kept_sizes = [x.shape[d] for d in kept]
        red_sizes = [x.shape[d] for d in reduced]
        n, m = math.prod(kept_sizes), math.prod(red_sizes)
        if n == 0:
            return
        ksz, kst = _coalesce(kept_sizes, [list(s) for s in out_kept]
                             + [[t.stride(d) for d in kept] for t in inputs])
        rsz, rst = _coalesce(red_sizes, [[t.stride(d) for d in reduced] for t in inputs])
        key = ("rows", body, len(outs), tuple(t.dtype for t in inputs), len(ksz), len(rsz),
               tuple(decl for decl, _ in extra))
        source = self.sources.get(key)
        if source is None:
            source = self.sources[key] = _rows_source(len(outs), [t.dtype for t in inputs],
                                                      len(ksz), len(rsz), body,
                                                      [decl for decl, _ in extra])
        args: list[Any] = [n, m, *ksz, *rsz]
        for k, t in enumerate([*outs, *inputs]):
            args += self._buffer(index, t)
            args += kst[k]
        for st in rst:
            args += st
        args += [value for _, value in extra]
        self.programs.run(index, queue, source, [n], args)

    # ---- hand-written kernels over contiguous or explicitly strided tensors ----
    def raw(self, where: torch.Tensor, source: str, size: Sequence[int],
            args: Sequence[Any]) -> None:
        """Enqueue ``source``'s kernel on ``where``'s current stream; a tensor in ``args``
        becomes two arguments, its buffer and byte offset (``__global char* p, ulong o``)."""
        index, queue = self._where(where)
        flat: list[Any] = []
        for a in args:
            flat += self._buffer(index, a) if isinstance(a, torch.Tensor) else [a]
        self.programs.run(index, queue, source, size, flat)

    # ---- GEMM ----
    def gemm(self, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             bias: torch.Tensor | None = None, alpha: Any = 1, beta: Any = 1) -> torch.Tensor:
        """``out = beta * bias + alpha * (a @ b)`` (batched when ``out`` is 3-d); ``bias``
        broadcast to ``out``. Register-blocked (:func:`_gemm_source`): each work-item
        computes :data:`GEMM_ROWS` rows of one column or of :data:`GEMM_WIDTHS` columns (a
        vector, where ``b``'s rows are contiguous), summing over ``k`` in order."""
        if out.numel() == 0:
            return out
        dt = out.dtype
        if dt not in (torch.float32, torch.float64, torch.int64, torch.float16) \
                or any(t.dtype != dt for t in (a, b) + ((bias,) if bias is not None else ())):
            raise Decline(f"ocl gemm does not handle {dt}")
        if out.dim() == 2:
            out, a, b = out[None], a[None], b[None]
            bias = None if bias is None else bias.expand(out.shape[1:])[None]
        elif bias is not None:
            bias = bias.expand(out.shape)
        index, queue = self._where(out)
        batch, m, n = out.shape
        k = a.shape[-1]
        if b.stride(2) != 1 and m > GEMM_ROWS and n % GEMM_WIDTHS[-1] == 0:
            b = b.contiguous()  # a transposed weight: one copy, then vector loads of its rows
        tensors = (out, a, b) + ((bias,) if bias is not None else ())
        # unit strides are compiled in: the loads along them are contiguous (vectorizable)
        units = tuple(tuple(s == 1 for s in t.stride()) for t in tensors)
        item = 8 if dt in (torch.float64, torch.int64) else 4  # bytes of the computation type
        width = next((w for w in GEMM_WIDTHS if units[2][2] and n % w == 0
                      and w * item <= 64), 1)  # a vector of 64 bytes at most
        key = ("gemm", dt, bias is not None, units, width, GEMM_ROWS)
        source = self.sources.get(key)
        if source is None:
            source = self.sources[key] = _gemm_source(dt, bias is not None, units, width)
        args: list[Any] = [batch, m, n, k, _scalar(dt, alpha),
                           _scalar(dt, beta if bias is not None else 0)]
        for t in tensors:
            args += self._buffer(index, t)
            args += t.stride()
        columns = n // width if width > 1 else n
        local = min(GEMM_LOCAL, 1 << max(columns - 1, 0).bit_length())
        size = [-(-columns // local) * local, -(-m // GEMM_ROWS), batch]
        self.programs.run(index, queue, source, size, args, [local, 1, 1])
        return out


# rows of the output one GEMM work-item computes, the widths of the vector of columns it
# computes (the first dividing the columns, where ``b``'s rows are contiguous; else one
# column), work-items in a group
GEMM_ROWS = 8
GEMM_WIDTHS = (16, 8, 4)
GEMM_LOCAL = 8


def _gemm_source(dt: torch.dtype, bias: bool, units: Sequence[Sequence[bool]],
                 width: int) -> str:
    """OpenCL C of :meth:`Launcher.gemm`. Work-item ``(j, i, z)`` computes rows ``i * R ..
    i * R + R - 1`` (``R`` = :data:`GEMM_ROWS`) of columns ``j * width .. j * width +
    width - 1`` of batch ``z``: per ``k`` one element (``width`` 1) or a vector of ``b``'s row
    and ``R`` elements of ``a``, the ``R`` accumulators in registers. Each output sums its
    products over ``k`` in order, without fused multiply-adds (float16 in float), whatever
    the width; rows past the end read the last row and store nothing. ``units``: per tensor
    (out, a, b, bias) which strides are 1, compiled in."""
    ct = "float" if dt == torch.float16 else _CL[dt]
    vt = ct if width == 1 else f"{ct}{width}"
    rows = GEMM_ROWS
    names = ("c", "a", "b", "e")[: 3 + bias]
    params = ["long B", "long M", "long N", "long K", f"{ct} alpha", f"{ct} beta"]
    for name in names:
        params += [f"__global char* {name}p", f"ulong {name}o"] + [f"long {name}s{d}" for d in range(3)]

    def stride(name: str, d: int) -> str:
        return "1" if units[names.index(name)][d] else f"{name}s{d}"

    body = [f"long j0 = get_global_id(0) * {width}, i0 = get_global_id(1) * {rows}, "
            "z = get_global_id(2);",
            f"long ab = z * {stride('a', 0)};"]
    if width == 1:  # a column past the end reads the last one
        body.append(f"long bb = z * {stride('b', 0)} + (j0 < N ? j0 : N - 1) * {stride('b', 2)};")
        b_at = f"({ct}){_load(dt, 'bp + bo', f'bb + k * {stride(chr(98), 1)}')}"
    else:  # the width divides N
        body.append(f"long bb = z * {stride('b', 0)} + j0;")
        # loads of 32 bytes at most: wider vector returns change the ABI without AVX-512
        chunk = min(width, 32 // (8 if ct in ("double", "long") else 4))
        row = f"bb + k * {stride('b', 1)}"
        fn, ptr = ((f"vload_half{chunk}", f"(__global const half*)(bp + bo) + {row}")
                   if dt == torch.float16 else
                   (f"vload{chunk}", f"(__global const {ct}*)(bp + bo) + {row}"))
        parts = [f"{fn}({c}, {ptr})" for c in range(width // chunk)]
        b_at = parts[0] if len(parts) == 1 else f"({vt})({', '.join(parts)})"
    for r in range(rows):
        body.append(f"long ar{r} = ab + (i0 + {r} < M ? i0 + {r} : M - 1) * {stride('a', 1)};")
        body.append(f"{vt} acc{r} = 0;")
    loop = [f"{vt} bv = {b_at};"]
    for r in range(rows):
        a_at = _load(dt, "ap + ao", f"ar{r} + k * {stride('a', 2)}")
        loop.append(f"acc{r} += ({ct}){a_at} * bv;")
    body.append("for (long k = 0; k < K; k++) {\n    " + "\n    ".join(loop) + "\n  }")
    body.append("if (j0 >= N) return;")
    for r in range(rows):
        gm = f"(i0 + {r})"
        stores = []
        for c in range(width):
            gn = f"(j0 + {c})"
            acc = f"acc{r}" if width == 1 else f"acc{r}.s{c:x}"
            value = f"alpha * {acc}"
            if bias:
                e_at = f"({ct}){_load(dt, 'ep + eo', f'z * es0 + {gm} * es1 + {gn} * es2')}"
                value = f"(beta == 0 ? 0 : beta * {e_at}) + alpha * {acc}"
            stores.append(_store(dt, "cp + co", f"z * cs0 + {gm} * cs1 + {gn} * cs2", value))
        body.append(f"if ({gm} < M) {{ " + " ".join(stores) + " }")
    return f"__kernel void gemm({', '.join(params)}) {{\n  " + "\n  ".join(body) + "\n}\n"


def make_kernels(runtime: OpenCLRuntime) -> KernelSet:
    """The backend's kernel set over ``runtime``."""
    ks = KernelSet("opencl")
    L = Launcher(runtime)
    dtypes = DTYPES if all(runtime.fp64) else DTYPES - {torch.float64}
    floats = [d for d in FLOATS if d in dtypes]

    promoted: dict[tuple, torch.dtype] = {}
    plain = (bool, int, float, complex, type(None))

    def promote(kind: PROMOTE, *args: Any) -> torch.dtype:
        """The computation dtype ``elementwise_dtypes`` gives, cached by what it reads: each
        tensor's dtype and whether it has dimensions, each number's type, the default dtype."""
        key: tuple | None = (kind, torch.get_default_dtype())
        for a in args:
            if isinstance(a, torch.Tensor):
                key += (a.dtype, a.dim() == 0)
            elif type(a) in plain:
                key += (type(a),)
            else:  # SymInt and the like: not cached
                key = None
                break
        hit = promoted.get(key) if key is not None else None
        if hit is None:
            hit = elementwise_dtypes(*args, type_promotion_kind=kind)[0]
            if key is not None:
                promoted[key] = hit
        return hit

    def isfloat(dt: torch.dtype) -> bool:
        return dt.is_floating_point

    # ---- binary ----
    def binary(name: str, expr: Callable[[torch.dtype], str],
               kind: PROMOTE = PROMOTE.DEFAULT) -> None:
        @ks.out_kernel(name, dtypes=dtypes)
        def kernel(self, other, *, out, alpha=1):
            ct = promote(kind, self, other)
            scalars = [(ct, alpha)] if alpha != 1 else []
            e = expr(ct) if alpha == 1 else expr(ct).replace("a1", "(s0 * a1)")
            return L.elementwise(out, [self, other], e, ct, scalars)

    binary("add.out", lambda ct: "a0 + a1")
    binary("sub.out", lambda ct: "a0 - a1")
    binary("mul.out", lambda ct: "a0 * a1")
    maxi = "isnan(a0) ? a0 : (isnan(a1) ? a1 : (a0 {} a1 ? a0 : a1))"
    binary("maximum.out", lambda ct: maxi.format(">") if isfloat(ct) else "a0 > a1 ? a0 : a1")
    binary("minimum.out", lambda ct: maxi.format("<") if isfloat(ct) else "a0 < a1 ? a0 : a1")
    for op, sym in (("eq", "=="), ("ne", "!="), ("lt", "<"), ("le", "<="), ("gt", ">"),
                    ("ge", ">=")):
        binary(f"{op}.Tensor_out", lambda ct, s=sym: f"a0 {s} a1", PROMOTE.ALWAYS_BOOL)
        binary(f"{op}.Scalar_out", lambda ct, s=sym: f"a0 {s} a1", PROMOTE.ALWAYS_BOOL)

    @ks.out_kernel("div.out", dtypes=dtypes)
    def div_out(self, other, *, out):
        ct = promote(PROMOTE.INT_TO_FLOAT, self, other)
        return L.elementwise(out, [self, other], "a0 / a1", ct)

    @ks.out_kernel("threshold_backward.grad_input", dtypes=dtypes)
    def threshold_backward(grad_output, self, threshold, *, grad_input):
        ct = promote(PROMOTE.DEFAULT, grad_output, self)
        return L.elementwise(grad_input, [grad_output, self], "a1 <= s0 ? 0 : a0", ct,
                             [(ct, threshold)])

    @ks.out_kernel("sigmoid_backward.grad_input", dtypes=floats)
    def sigmoid_backward(grad_output, output, *, grad_input):
        ct = promote(PROMOTE.DEFAULT, grad_output, output)
        return L.elementwise(grad_input, [grad_output, output], "a0 * (1 - a1) * a1", ct)

    @ks.out_kernel("tanh_backward.grad_input", dtypes=floats)
    def tanh_backward(grad_output, output, *, grad_input):
        ct = promote(PROMOTE.DEFAULT, grad_output, output)
        return L.elementwise(grad_input, [grad_output, output], "a0 * (1 - a1 * a1)", ct)

    # ---- ternary (the optimizers' foreach ops decompose into these) ----
    @ks.out_kernel("addcmul.out", dtypes=dtypes)
    def addcmul(self, tensor1, tensor2, *, value=1, out):
        ct = promote(PROMOTE.DEFAULT, self, tensor1, tensor2)
        return L.elementwise(out, [self, tensor1, tensor2], "a0 + s0 * a1 * a2", ct,
                             [(ct, value)])

    @ks.out_kernel("addcdiv.out", dtypes=floats)
    def addcdiv(self, tensor1, tensor2, *, value=1, out):
        ct = promote(PROMOTE.DEFAULT, self, tensor1, tensor2)
        return L.elementwise(out, [self, tensor1, tensor2], "a0 + s0 * a1 / a2", ct,
                             [(ct, value)])

    lerp = "fabs(a2) < 0.5f ? a0 + a2 * (a1 - a0) : a1 - (a1 - a0) * (1 - a2)"

    @ks.out_kernel("lerp.Scalar_out", dtypes=floats)
    def lerp_scalar(self, end, weight, *, out):
        ct = promote(PROMOTE.DEFAULT, self, end)
        return L.elementwise(out, [self, end, weight], lerp, ct)

    @ks.out_kernel("lerp.Tensor_out", dtypes=floats)
    def lerp_tensor(self, end, weight, *, out):
        ct = promote(PROMOTE.DEFAULT, self, end, weight)
        return L.elementwise(out, [self, end, weight], lerp, ct)

    @ks.out_kernel("where.self_out", dtypes=dtypes)
    def where(condition, self, other, *, out):
        ct = promote(PROMOTE.NO_OPMATH, self, other)
        return L.elementwise(out, [condition, self, other], "a0 ? a1 : a2",
                             [torch.bool, ct, ct])

    one_true = torch.ones((), dtype=torch.bool)

    def masked_fill(self: torch.Tensor, mask: torch.Tensor, value: Any,
                    out: torch.Tensor) -> torch.Tensor:
        """``out = mask ? value : self``; ``value`` converted to ``self``'s dtype by the
        CPU's own conversion (its rounding, and its error for a value out of range)."""
        if mask.dtype != torch.bool or "cpu" in (mask.device.type, self.device.type):
            raise Decline("masked_fill with a non-bool mask or a CPU operand")  # CPU's error
        if isinstance(value, torch.Tensor):
            if value.dim() != 0:
                raise Decline("masked_fill with a value tensor of several elements")
            value = value.item()  # as CUDA's kernel: a device value is read first
        fill = torch.zeros((), dtype=self.dtype).masked_fill_(one_true, value).item()
        return L.elementwise(out, [mask, self], "a0 ? s0 : a1", [torch.bool, self.dtype],
                             [(self.dtype, fill)])

    @ks.out_kernel("masked_fill.Scalar_out", dtypes=dtypes)
    def masked_fill_scalar(self, mask, value, *, out):
        return masked_fill(self, mask, value, out)

    @ks.out_kernel("masked_fill.Tensor_out", dtypes=dtypes)
    def masked_fill_tensor(self, mask, value, *, out):
        return masked_fill(self, mask, value, out)

    def as_common(common: torch.dtype, inputs: Sequence[Any],
                  own: Sequence[int] = ()) -> list[Any]:
        """``inputs`` as TensorIterator casts them to the common dtype before the kernel
        reads them: host scalars converted by the CPU's own cast (float16's rounding
        included). A float16 computation reads other device tensors in float, unrounded,
        so those decline (the CPU runs them); ``own``: inputs read as they are (the CPU's
        kernel takes their original value)."""
        done = []
        for j, v in enumerate(inputs):
            o = _operand(v)
            if o.tensor is None and j not in own:
                v = torch.tensor(o.value, dtype=o.dtype).to(common).item()
            elif (o.tensor is not None and common == torch.float16 and j not in own
                  and o.dtype not in (torch.float16, torch.bool)):
                raise Decline(f"a {o.dtype} operand of a float16 computation")
            done.append(v)
        return done

    # ---- logical ----
    def logical(name: str, expr: str) -> None:
        @ks.out_kernel(name, dtypes=dtypes)
        def kernel(self, other, *, out):
            common = promote(PROMOTE.NO_OPMATH, self, other)
            return L.elementwise(out, as_common(common, [self, other]), expr, common)

    logical("logical_and.out", "(a0 != 0) && (a1 != 0)")
    logical("logical_or.out", "(a0 != 0) || (a1 != 0)")
    logical("logical_xor.out", "(a0 != 0) != (a1 != 0)")

    @ks.out_kernel("logical_not.out", dtypes=dtypes)
    def logical_not(self, *, out):
        return L.elementwise(out, [self], "a0 == 0", self.dtype)

    # sign: (0 < a) - (a < 0) as the CPU, so NaN and -0.0 give +0.0
    for name in ("sign.out", "sgn.out"):
        @ks.out_kernel(name, dtypes=dtypes)
        def sign(self, *, out):
            return L.elementwise(out, [self], "(a0 > 0) - (a0 < 0)", self.dtype)

    # ---- pow with a tensor exponent ----
    # integers: the CPU's powi (a negative exponent gives 0 unless the base is 1 or -1),
    # products wrapping as the CPU's
    powi = ("long pw = 1, pb = a0, pe = a1; "
            "if (pe < 0) pw = pb == 1 ? 1 : (pb == -1 ? ((pe & 1) ? -1 : 1) : 0); "
            "else while (pe) { if (pe & 1) pw = (long)((ulong)pw * (ulong)pb); pe /= 2; "
            "pb = (long)((ulong)pb * (ulong)pb); }")

    def pow_expr(common: torch.dtype, base: str, exponent: str) -> str:
        """Floating ``pow``: float and float16 through double where the device has it
        (PoCL's float pow misses the CPU's, nearly correctly rounded, by an ulp ten times
        as often)."""
        if common != torch.float64 and all(runtime.fp64):
            return f"(float)pow((double){base}, (double){exponent})"
        return f"pow({base}, {exponent})"

    def power(out: torch.Tensor, base: Any, exponent: Any) -> torch.Tensor:
        common = promote(PROMOTE.NO_OPMATH, base, exponent)
        if common == torch.bool:
            raise Decline("pow of bool")  # the CPU's error
        args = as_common(common, [base, exponent])
        if isfloat(common):
            return L.elementwise(out, args, pow_expr(common, "a0", "a1"), common)
        return L.elementwise(out, args, "pw", torch.int64, pre=powi)

    @ks.out_kernel("pow.Tensor_Tensor_out", dtypes=dtypes)
    def pow_tensor(self, exponent, *, out):
        return power(out, self, exponent)

    @ks.out_kernel("pow.Scalar_out", dtypes=dtypes)
    def pow_scalar_base(self, exponent, *, out):
        if not isinstance(self, int | float) or isinstance(self, bool):
            raise Decline("pow with a complex or bool base")
        return power(out, self, exponent)

    # ---- division with a rounding mode ----
    def floor_div(ct: str, half: bool) -> str:
        """C statements: ``fq``, the CPU's floor division of ``a0`` by ``a1``
        (``c10::div_floor_floating``); ``half``: each step rounded to float16, as the
        CPU's float16 kernel computes."""
        def h(e: str) -> str:
            return f"round_half({e})" if half else e

        div = h(f"({h('a0 - fm')}) / a1")
        return (f"{ct} fq, fb = {h('a0 / a1')}; if (a1 == 0) fq = fb; else {{ "
                f"{ct} fm = fmod(a0, a1); {ct} fd = {div}; "
                f"if (fm != 0 && (a1 < 0) != (fm < 0)) fd = {h('fd - 1')}; "
                f"if (fd != 0) {{ fq = floor(fd); if (fd - fq > 0.5f) fq = {h('fq + 1')}; }} "
                f"else fq = copysign(({ct})0, fb); }}")

    @ks.out_kernel("div.out_mode", dtypes=dtypes)
    def div_mode(self, other, *, rounding_mode=None, out):
        if rounding_mode is None:
            return div_out(self, other, out=out)
        common = promote(PROMOTE.NO_OPMATH, self, other)
        if common == torch.bool:
            raise Decline("div with a rounding mode of bool")  # the CPU's error
        if not isfloat(common):
            args = as_common(common, [self, other])
            if not isinstance(args[1], torch.Tensor) and args[1] == 0:
                raise RuntimeError("ZeroDivisionError")  # the CPU's check of a host divisor
            # a zero divisor on the device gives 0, as CUDA's kernel checks nothing; -1
            # negates (dividing the most negative value by it traps on a CPU)
            q = "(a1 == -1 ? -a0 : a0 / a1)"
            if rounding_mode == "floor":
                q = f"((a0 < 0) != (a1 < 0) && a1 != -1 && a0 % a1 != 0 ? a0 / a1 - 1 : {q})"
            return L.elementwise(out, args, f"a1 == 0 ? 0 : {q}", common)
        ct = promote(PROMOTE.DEFAULT, self, other)
        # a float16 computation by a one-element divisor: in float with the divisor's
        # original value (the CPU's scalar path); else float16 steps
        single = common == torch.float16 and (not isinstance(other, torch.Tensor)
                                             or other.numel() == 1)
        half = common == torch.float16 and not single
        args = as_common(common, [self, other], own=[1] if single else [])
        if rounding_mode == "trunc":
            expr = "trunc(round_half(a0 / a1))" if half else "trunc(a0 / a1)"
            return L.elementwise(out, args, expr, ct)
        return L.elementwise(out, args, "fq", ct, pre=floor_div(_ctype(ct), half))

    @ks.out_kernel("floor_divide.out", dtypes=dtypes)
    def floor_divide(self, other, *, out):
        return div_mode(self, other, rounding_mode="floor", out=out)

    # ---- unary ----
    def unary(name: str, expr: Callable[[torch.dtype], str], kind: PROMOTE = PROMOTE.DEFAULT,
              only: Sequence[torch.dtype] = tuple(dtypes)) -> None:
        @ks.out_kernel(name, dtypes=only)
        def kernel(self, *, out):
            ct = promote(kind, self)
            return L.elementwise(out, [self], expr(ct), ct)

    unary("neg.out", lambda ct: "-a0", only=tuple(dtypes - {torch.bool}))
    unary("abs.out", lambda ct: "fabs(a0)" if isfloat(ct) else "(a0 < 0 ? -a0 : a0)")
    for fn in ("exp", "log", "sqrt", "tanh", "sin", "cos", "log1p", "expm1"):
        unary(f"{fn}.out", lambda ct, f=fn: f"{f}(a0)", PROMOTE.INT_TO_FLOAT)
    unary("rsqrt.out", lambda ct: "1 / sqrt(a0)", PROMOTE.INT_TO_FLOAT)
    unary("sigmoid.out", lambda ct: "1 / (1 + exp(-a0))", PROMOTE.INT_TO_FLOAT)
    unary("reciprocal.out", lambda ct: "1 / a0", PROMOTE.INT_TO_FLOAT)

    def relu_expr(t: torch.Tensor) -> str:
        return "isnan(a0) ? a0 : (a0 > 0 ? a0 : 0)" if isfloat(t.dtype) else "a0 > 0 ? a0 : 0"

    @ks.kernel("relu.default", dtypes=dtypes - {torch.bool})
    def relu(self):
        out = torch.empty_like(self)
        return L.elementwise(out, [self], relu_expr(self), self.dtype)

    @ks.kernel("relu_", dtypes=dtypes - {torch.bool})
    def relu_(self):
        return L.elementwise(self, [self], relu_expr(self), self.dtype)

    @ks.out_kernel("pow.Tensor_Scalar_out", dtypes=floats)
    def pow_scalar(self, exponent, *, out):
        if not isinstance(exponent, int | float) or isinstance(exponent, bool):
            raise Decline("pow with a complex exponent")
        ct = promote(PROMOTE.DEFAULT, self, exponent)
        general = pow_expr(self.dtype, "a0", "s0")
        if self.dtype == torch.float16:  # the CPU: pow for every exponent, in float16
            (exponent,) = as_common(torch.float16, [exponent])
            return L.elementwise(out, [self], general, ct, [(ct, exponent)])
        # the CPU's special cases, for its rounding
        expr = {2: "a0 * a0", 3: "a0 * a0 * a0", 0.5: "sqrt(a0)", -0.5: "1 / sqrt(a0)",
                -1: "1 / a0", -2: "1 / (a0 * a0)", 1: "a0", 0: "1"}.get(exponent, general)
        return L.elementwise(out, [self], expr, ct, [(ct, exponent)])

    # ---- fill and copies ----
    @ks.kernel("fill_.Scalar", dtypes=dtypes)
    def fill_scalar(self, value):
        ct = self.dtype
        return L.elementwise(self, [], "s0", ct, [(ct, value)])

    @ks.kernel("fill_.Tensor", dtypes=dtypes)
    def fill_tensor(self, value):
        if value.dim() != 0:
            raise Decline("fill_ with a tensor of several elements")
        return L.elementwise(self, [value], "a0", value.dtype)

    @ks.kernel("zero_", dtypes=dtypes)
    def zero_(self):
        return L.elementwise(self, [], "0", self.dtype)

    @ks.kernel("copy_", dtypes=dtypes)
    def copy_(self, src, non_blocking=False):
        """Same-device copies of any layout and dtype (torchport's core copy calls it)."""
        if src.device != self.device:
            raise Decline("a copy between devices")
        return L.elementwise(self, [src], "a0", src.dtype if src.dtype != torch.float16
                             else torch.float32)

    # ---- reductions ----
    def dims_of(x: torch.Tensor, dim: Any) -> list[int]:
        if dim is None or (isinstance(dim, list | tuple) and len(dim) == 0):
            return list(range(x.dim()))
        dims = [dim] if isinstance(dim, int) else list(dim)
        return sorted({d % max(x.dim(), 1) for d in dims}) if x.dim() else []

    def reduce(x: torch.Tensor, dim: Any, keepdim: bool, outs: Sequence[torch.Tensor],
               body: str) -> None:
        red = dims_of(x, dim)
        kept = [d for d in range(x.dim()) if d not in red]
        out_kept = []
        for o in outs:
            if keepdim and o.dim() == x.dim():
                out_kept.append([o.stride(d) for d in kept])
            else:
                out_kept.append(list(o.stride())[: len(kept)] if o.dim() else [])
        L.rows(outs, out_kept, [x], kept, red, body)

    def acc_type(dt: torch.dtype) -> str:
        if dt.is_floating_point:
            return "double" if all(runtime.fp64) else "float"
        return "long"

    @ks.out_kernel("sum.IntList_out", dtypes=dtypes)
    def sum_out(self, dim, keepdim=False, *, dtype=None, out):
        at = acc_type(out.dtype)
        reduce(self, dim, keepdim, [out],
               f"{at} acc = 0; for (long j = 0; j < m; j++) acc += ({at})IN0(j);\n  "
               + _store(out.dtype, "p0 + o0", "q0", "acc"))
        return out

    @ks.out_kernel("mean.out", dtypes=floats)
    def mean_out(self, dim, keepdim=False, *, dtype=None, out):
        at = acc_type(out.dtype)
        reduce(self, dim, keepdim, [out],
               f"{at} acc = 0; for (long j = 0; j < m; j++) acc += ({at})IN0(j);\n  "
               + _store(out.dtype, "p0 + o0", "q0", f"acc / ({at})m"))
        return out

    def extreme(name: str, cmp: str) -> None:
        @ks.out_kernel(name, dtypes=dtypes)
        def kernel(self, dim=(), keepdim=False, *, out):
            ct = _ctype(self.dtype)
            better = f"isnan(v) || v {cmp} acc" if isfloat(self.dtype) else f"v {cmp} acc"
            reduce(self, dim, keepdim, [out],
                   f"{ct} acc = IN0(0); for (long j = 1; j < m; j++) {{ {ct} v = IN0(j); "
                   f"if ({better}) acc = v; }}\n  " + _store(out.dtype, "p0 + o0", "q0", "acc"))
            return out

    extreme("amax.out", ">")
    extreme("amin.out", "<")

    def arg_extreme(name: str, cmp: str) -> None:
        @ks.out_kernel(name, dtypes=dtypes - {torch.bool})
        def kernel(self, dim=None, keepdim=False, *, out):
            x = self if dim is not None else self.reshape(-1)
            if dim is None and keepdim:
                raise Decline("argmax over all dims with keepdim")
            ct = _ctype(self.dtype)
            better = (f"!isnan(b) && (isnan(v) || v {cmp} b)" if isfloat(self.dtype)
                      else f"v {cmp} b")
            reduce(x, dim if dim is not None else 0, keepdim, [out],
                   f"{ct} b = IN0(0); long at = 0; for (long j = 1; j < m; j++) "
                   f"{{ {ct} v = IN0(j); if ({better}) {{ b = v; at = j; }} }}\n  "
                   + _store(torch.int64, "p0 + o0", "q0", "at"))
            return out

    arg_extreme("argmax.out", ">")
    arg_extreme("argmin.out", "<")

    # ---- softmax ----
    def softmax_like(name: str, log: bool) -> None:
        @ks.out_kernel(name, dtypes=floats)
        def kernel(self, dim, half_to_float, *, out):
            if half_to_float or self.dim() == 0:
                raise Decline("softmax with half_to_float or of a 0-dim tensor")
            half = self.dtype == torch.float16
            ct, at = _ctype(self.dtype), "float" if half else acc_type(self.dtype)
            d = dim % self.dim()
            kept = [k for k in range(self.dim()) if k != d]
            # float16 over the last dim: the CPU's kernel rounds the sum and its log to
            # float16 in between
            last = half and d == self.dim() - 1
            logs = "round_half(log(round_half(s)))" if last else "log(s)"
            value = f"v - mx - {logs}" if log else "exp(v - mx) / s"
            body = (f"{ct} mx = -INFINITY; for (long j = 0; j < m; j++) {{ {ct} v = IN0(j); "
                    f"if (isnan(v) || v > mx) mx = v; if (isnan(mx)) break; }}\n  "
                    f"{at} s = 0; for (long j = 0; j < m; j++) s += exp(IN0(j) - mx);\n  "
                    f"for (long j = 0; j < m; j++) {{ {ct} v = IN0(j); "
                    + _store(out.dtype, "p0 + o0", "q0 + j * w", f"({ct})({value})")
                    + " }")
            L.rows([out], [[out.stride(k) for k in kept]], [self], kept, [d], body,
                   [("long w", np.int64(out.stride(d)))])
            return out

    softmax_like("_softmax.out", False)
    softmax_like("_log_softmax.out", True)

    def softmax_backward(name: str, log: bool) -> None:
        @ks.out_kernel(name, dtypes=floats)
        def kernel(grad_output, output, dim, input_dtype, *, out=None,
                   grad_input=None):  # the two overloads name their output differently
            out = grad_input if out is None else out
            if output.dtype != grad_output.dtype or output.dim() == 0:
                raise Decline("softmax backward of mixed dtypes or a 0-dim tensor")
            ct, at = _ctype(output.dtype), acc_type(output.dtype)
            d = dim % output.dim()
            kept = [k for k in range(output.dim()) if k != d]
            total = "IN0(j)" if log else "IN0(j) * IN1(j)"
            value = "IN0(j) - exp(IN1(j)) * s" if log else "IN1(j) * (IN0(j) - s)"
            body = (f"{at} acc = 0; for (long j = 0; j < m; j++) acc += {total};\n  "
                    f"{ct} s = ({ct})acc;\n  for (long j = 0; j < m; j++) {{ "
                    + _store(out.dtype, "p0 + o0", "q0 + j * w", value) + " }")
            L.rows([out], [[out.stride(k) for k in kept]], [grad_output, output], kept, [d],
                   body, [("long w", np.int64(out.stride(d)))])
            return out

    softmax_backward("_softmax_backward_data.out", False)
    softmax_backward("_log_softmax_backward_data.out", True)

    # ---- matrix products ----
    @ks.out_kernel("mm.out", dtypes=dtypes)
    def mm(self, mat2, *, out):
        return L.gemm(out, self, mat2)

    @ks.out_kernel("bmm.out", dtypes=dtypes)
    def bmm(self, mat2, *, out):
        return L.gemm(out, self, mat2)

    @ks.out_kernel("addmm.out", dtypes=dtypes)
    def addmm(self, mat1, mat2, *, beta=1, alpha=1, out):
        return L.gemm(out, mat1, mat2, self, alpha, beta)

    @ks.out_kernel("baddbmm.out", dtypes=dtypes)
    def baddbmm(self, batch1, batch2, *, beta=1, alpha=1, out):
        return L.gemm(out, batch1, batch2, self, alpha, beta)

    # ---- indexing ----
    def check_index(index: torch.Tensor, op: str) -> None:
        if index.dtype not in (torch.int64, torch.int32) or index.device.type == "cpu":
            raise Decline(f"{op} with a {index.dtype} or CPU index")

    @ks.out_kernel("index_select.out", dtypes=dtypes)
    def index_select(self, dim, index, *, out):
        """``out[.., i, ..] = self[.., index[i], ..]``: ``self`` read through a view with
        stride 0 along ``dim``, plus the index times the dimension's stride."""
        check_index(index, "index_select")
        if out.numel() == 0:
            return out
        d = dim % max(self.dim(), 1)
        if self.dim() == 0:  # one element: index 0 only
            view, size, stride = self.expand(out.shape), 1, 0
        else:
            strides = list(self.stride())
            strides[d] = 0
            view, size, stride = self.as_strided(out.shape, strides), self.shape[d], self.stride(d)
        idx = index.reshape(-1)
        idx_view = idx.as_strided(out.shape, [idx.stride(0) if k == d else 0
                                              for k in range(out.dim())])
        return L.elementwise(out, [idx_view, view], "a1", [torch.int64, self.dtype],
                             [(torch.int64, stride)], at=[None, "QSELF + a0 * s0"],
                             index_check=(0, size, "index_select", d))

    @ks.out_kernel("gather.out", dtypes=dtypes)
    def gather(self, dim, index, *, sparse_grad=False, out):
        check_index(index, "gather")
        if out.numel() == 0:
            return out
        if self.dim() == 0 or index.dim() != self.dim():
            raise Decline("gather of a 0-dim tensor")
        d = dim % self.dim()
        strides = list(self.stride())
        strides[d] = 0
        view = self.as_strided(index.shape, strides)
        return L.elementwise(out, [index, view], "a1", [torch.int64, self.dtype],
                             [(torch.int64, self.stride(d))], at=[None, "QSELF + a0 * s0"],
                             index_check=(0, self.shape[d], "gather", d))

    def accumulate_rows(out: torch.Tensor, index: torch.Tensor, src: torch.Tensor,
                        d: int, op: str, skip: int | None = None) -> None:
        """``out[.., index[.., j, ..], ..] += src[.., j, ..]`` along ``d``: one work-item
        per position over the other dims adds in order of ``j``, as the CPU does (so the
        sums round alike); ``skip`` adds nothing, an index out of range adds nothing and
        is reported (the runtime's error word, as ``op``'s)."""
        src_v = src.as_strided(index.shape, src.stride())
        kept = [k for k in range(index.dim()) if k != d]
        at = _ctype(out.dtype)
        body = ("for (long j = 0; j < m; j++) { long t = IN0(j); if (t < 0 || t >= ext) { "
                "report_index(err, eop, edim, t, ext); continue; } "
                + ("if (t == skip) continue; " if skip is not None else "")
                + f"{at} v = ({at}){_load(out.dtype, 'p0 + o0', 'q0 + t * w')} + ({at})IN1(j); "
                + _store(out.dtype, "p0 + o0", "q0 + t * w", "v") + " }")
        err = L.index_error(out, op, d)
        extra = [("long w", np.int64(out.stride(d))), ("long ext", np.int64(out.shape[d])),
                 ("__global long* err", err[0]), ("long eop", err[1]), ("long edim", err[2])]
        if skip is not None:
            extra.append(("long skip", np.int64(skip)))
        L.rows([out], [[out.stride(k) for k in kept]], [index, src_v], kept, [d], body, extra)
        L.after_index_kernel(out)

    @ks.out_kernel("scatter_add.out", dtypes=dtypes - {torch.bool})
    def scatter_add(self, dim, index, src, *, out):
        check_index(index, "scatter_add")
        if self.dim() == 0 or index.dim() != self.dim() or src.dtype != out.dtype:
            raise Decline("scatter_add of a 0-dim tensor or mixed dtypes")
        if out.data_ptr() != self.data_ptr() or out.stride() != self.stride():
            out.copy_(self)
        if index.numel():
            accumulate_rows(out, index, src, dim % self.dim(), "scatter_add")
        return out

    @ks.out_kernel("embedding_dense_backward.out", dtypes=floats + [torch.int64, torch.int32])
    def embedding_dense_backward(grad_output, indices, num_weights, padding_idx,
                                 scale_grad_by_freq, *, out):
        check_index(indices, "embedding_dense_backward")
        if scale_grad_by_freq:
            raise Decline("embedding backward with scale_grad_by_freq")
        L.elementwise(out, [], "0", out.dtype)
        n = indices.numel()
        if n == 0 or out.numel() == 0:
            return out
        width = out.shape[1]
        grad = grad_output.reshape(n, width)
        idx = indices.reshape(n, 1).expand(n, width)
        accumulate_rows(out, idx, grad, 0, "embedding_dense_backward", padding_idx)
        return out

    @ks.out_kernel("native_dropout_backward.out", dtypes=floats + [torch.bool])
    def native_dropout_backward(grad_output, mask, scale, *, out):
        return L.elementwise(out, [grad_output, mask], "(a0 * (a1 ? 1 : 0)) * s0",
                             [grad_output.dtype, torch.bool], [(grad_output.dtype, scale)])

    # ---- normalisation and variance ----
    @ks.out_kernel("var.correction_out", dtypes=floats)
    def var_out(self, dim=None, *, correction=None, keepdim=False, out):
        variance(self, dim, correction, keepdim, [out], with_mean=False)
        return out

    @ks.out_kernel("var_mean.correction_out", dtypes=floats)
    def var_mean_out(self, dim=None, *, correction=None, keepdim=False, out0, out1):
        variance(self, dim, correction, keepdim, [out0, out1], with_mean=True)
        return out0, out1

    def variance(x: torch.Tensor, dim: Any, correction: Any, keepdim: bool,
                 outs: Sequence[torch.Tensor], with_mean: bool) -> None:
        """Two passes in the accumulation type: the mean, then the squared deviations
        over ``max(0, m - correction)`` (0 gives inf or NaN, as the CPU)."""
        at = acc_type(x.dtype)
        corr = 1 if correction is None else correction
        body = (f"{at} mu = 0; for (long j = 0; j < m; j++) mu += ({at})IN0(j); mu /= ({at})m;\n  "
                f"{at} ss = 0; for (long j = 0; j < m; j++) {{ {at} e = ({at})IN0(j) - mu; "
                f"ss += e * e; }}\n  {at} den = ({at})m - ({at})corr; if (den < 0) den = 0;\n  "
                + _store(outs[0].dtype, "p0 + o0", "q0", "ss / den")
                + ("\n  " + _store(outs[1].dtype, "p1 + o1", "q1", "mu") if with_mean else ""))
        red = dims_of(x, dim)
        kept = [d for d in range(x.dim()) if d not in red]
        out_kept = [[o.stride(d) for d in kept] if keepdim and o.dim() == x.dim()
                    else (list(o.stride())[: len(kept)] if o.dim() else []) for o in outs]
        L.rows(outs, out_kept, [x], kept, red, body,
               [(f"{at} corr", (np.float64 if at == "double" else np.float32)(corr))])

    norm_dtypes = [d for d in (torch.float32, torch.float64) if d in dtypes]

    @ks.out_kernel("native_layer_norm.out", dtypes=norm_dtypes)
    def layer_norm(input, normalized_shape, weight, bias, eps, *, out0, out1, out2):
        """Per row the mean and the variance (two passes, in the accumulation type), then
        ``(x * rstd - rstd * mean) * w + b`` as the CPU's kernel computes it."""
        n = math.prod(normalized_shape)
        rows = input.numel() // n if n else 0
        if not (out0.is_contiguous() and out1.is_contiguous() and out2.is_contiguous()):
            raise Decline("layer norm into non-contiguous outputs")
        if rows == 0:
            return out0, out1, out2
        x = input.contiguous()
        ct, at = _CL[x.dtype], acc_type(x.dtype)
        w_at = "((__global const T*)(wp + wo))[j]" if weight is not None else "(T)1"
        b_at = "((__global const T*)(bp + bo))[j]" if bias is not None else "(T)0"
        source = f"""#define T {ct}
__kernel void layer_norm(long M, long N, {at} eps, __global char* yp, ulong yo,
    __global char* mp, ulong mo, __global char* rp, ulong ro, __global char* xp, ulong xo,
    __global char* wp, ulong wo, __global char* bp, ulong bo) {{
  long i = get_global_id(0); if (i >= M) return;
  __global const T* x = (__global const T*)(xp + xo) + i * N;
  __global T* y = (__global T*)(yp + yo) + i * N;
  {at} mu = 0; for (long j = 0; j < N; j++) mu += x[j]; mu /= ({at})N;
  {at} ss = 0; for (long j = 0; j < N; j++) {{ {at} e = x[j] - mu; ss += e * e; }}
  {at} var = ss / ({at})N;
  T mean = (T)mu, rstd = (T)(1 / sqrt(var + eps));
  ((__global T*)(mp + mo))[i] = mean; ((__global T*)(rp + ro))[i] = rstd;
  T scale = rstd, shift = -rstd * mean;
  for (long j = 0; j < N; j++) y[j] = (x[j] * scale + shift) * {w_at} + {b_at};
}}
"""
        anyt = x
        w = weight.contiguous() if weight is not None else anyt
        b = bias.contiguous() if bias is not None else anyt
        eps_v = np.float64(eps) if at == "double" else np.float32(eps)
        L.raw(x, source, [rows], [np.int64(rows), np.int64(n), eps_v, out0, out1, out2, x, w, b])
        return out0, out1, out2

    @ks.kernel("native_layer_norm_backward.default", dtypes=norm_dtypes)
    def layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight, bias,
                            output_mask):
        """The CPU's formulas: per row ``dx = rstd * dy * w + b * x + c`` with
        ``b = (db * mean - ds) * rstd^3 / N``, ``c = -b * mean - db * rstd / N``
        (``ds = sum(dy * w * x)``, ``db = sum(dy * w)``); per column the sums over rows
        of ``dy * (x - mean) * rstd`` and of ``dy``."""
        n = math.prod(normalized_shape)
        m = input.numel() // n if n else 0
        x, dy = input.contiguous(), grad_out.contiguous()
        mu, rs = mean.contiguous(), rstd.contiguous()
        ct, at = _CL[x.dtype], acc_type(x.dtype)
        dx = torch.empty_like(x) if output_mask[0] else None
        dw = torch.empty_like(weight) if output_mask[1] and weight is not None else None
        db = torch.empty_like(bias) if output_mask[2] and bias is not None else None
        w = weight.contiguous() if weight is not None else x
        if dx is not None and m and n:
            w_at = "w[j]" if weight is not None else "(T)1"
            source = f"""#define T {ct}
__kernel void layer_norm_dx(long M, long N, __global char* dxp, ulong dxo,
    __global char* gp, ulong go, __global char* xp, ulong xo, __global char* mp, ulong mo,
    __global char* rp, ulong ro, __global char* wp, ulong wo) {{
  long i = get_global_id(0); if (i >= M) return;
  __global const T* x = (__global const T*)(xp + xo) + i * N;
  __global const T* g = (__global const T*)(gp + go) + i * N;
  __global const T* w = (__global const T*)(wp + wo);
  __global T* d = (__global T*)(dxp + dxo) + i * N;
  {at} ds = 0, db = 0;
  for (long j = 0; j < N; j++) {{ {at} gw = ({at})g[j] * {w_at}; ds += gw * x[j]; db += gw; }}
  {at} mean = ((__global const T*)(mp + mo))[i], a = ((__global const T*)(rp + ro))[i];
  {at} s = 1 / ({at})N;
  {at} b = (db * mean - ds) * a * a * a * s;
  {at} c = -b * mean - db * a * s;
  for (long j = 0; j < N; j++) d[j] = (T)(a * g[j] * {w_at} + b * x[j] + c);
}}
"""
            L.raw(x, source, [m], [np.int64(m), np.int64(n), dx, dy, x, mu, rs, w])
        for t, with_x in ((dw, True), (db, False)):
            if t is None:
                continue
            if m == 0:
                L.elementwise(t, [], "0", t.dtype)
                continue
            term = "g[k] * (x[k] - (T)mean[r]) * (T)rstd[r]" if with_x else "g[k]"
            source = f"""#define T {ct}
__kernel void layer_norm_dw(long M, long N, __global char* op, ulong oo,
    __global char* gp, ulong go, __global char* xp, ulong xo, __global char* mp, ulong mo,
    __global char* rp, ulong ro) {{
  long j = get_global_id(0); if (j >= N) return;
  __global const T* g = (__global const T*)(gp + go);
  __global const T* x = (__global const T*)(xp + xo);
  __global const T* mean = (__global const T*)(mp + mo);
  __global const T* rstd = (__global const T*)(rp + ro);
  {at} acc = 0;
  for (long r = 0; r < M; r++) {{ long k = r * N + j; acc += {term}; }}
  ((__global T*)(op + oo))[j] = (T)acc;
}}
"""
            L.raw(x, source, [n], [np.int64(m), np.int64(n), t, dy, x, mu, rs])
        return dx, dw, db

    # ---- dropout: a counter-based generator (Philox4x32-10) on the device ----
    @ks.out_kernel("native_dropout.out", dtypes=floats + [torch.bool])
    def native_dropout(input, p, train, *, out0, out1):
        """Element ``i`` is kept when the first word of Philox4x32-10 at counter ``(i, 0)``
        under a 64-bit key, as a 24-bit uniform in [0, 1), is below ``1 - p``; the key is
        drawn from the device's generator (``torch.ocl.manual_seed``, ``get_rng_state``
        reproduce it). ``out = (x * keep) * (1 / (1 - p))`` as the CPU computes it."""
        if out0.numel() == 0:
            return out0, out1
        if train is False or p == 0:
            L.elementwise(out0, [input], "a0", input.dtype if input.dtype != torch.float16
                          else torch.float32)
            L.elementwise(out1, [], "1", torch.bool)
            return out0, out1
        p1m = 1.0 - p
        scale = 0.0 if p1m == 0 else 1.0 / p1m
        backend = torchport.current_backend()
        gen = backend.generators[input.device.index]  # per device as torch.ocl numbers them
        key = int(torch.empty((), dtype=torch.int64).random_(generator=gen))
        L.elementwise(out1, [], "k", torch.bool,
                      [(torch.float32, p1m), (torch.int64, key & 0xFFFFFFFF),
                       (torch.int64, key >> 32)],
                      pre="uchar k = philox_uniform(i, (uint)s1, (uint)s2) < s0;")
        return L.elementwise(out0, [input, out1], "(a0 * (a1 ? 1 : 0)) * s0",
                             [input.dtype, torch.bool], [(input.dtype, scale)]), out1


    return ks
