"""OpenCL C generated for the backend's kernels, and its launch: the source per op, dtype
and rank (elementwise, row and GEMM generators), programs built once per source and device,
operands found through the runtime's segment table, scalar parameters declared once."""

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

import torchport
from torchport.backends.opencl.runtime import REPORT_INDEX, OpenCLRuntime, build_program
from torchport.core import settings
from torchport.ops import Decline

_CL = {torch.float32: "float", torch.float64: "double", torch.float16: "half",
       torch.int64: "long", torch.int32: "int", torch.int16: "short", torch.int8: "char",
       torch.uint8: "uchar", torch.bool: "uchar"}
_NP = {torch.float32: np.float32, torch.float64: np.float64, torch.int64: np.int64,
       torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8,
       torch.uint8: np.uint8, torch.bool: np.uint8}
FLOATS = (torch.float32, torch.float64, torch.float16)
# index kernels whose CPU counterparts raise IndexError for a bad index (embedding's too,
# and nll_loss's for a target out of range)
_LOOKUP_ERRORS = frozenset({"index_select", "embedding_dense_backward", "nll_loss_forward",
                            "nll_loss_backward"})
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
            program = build_program(self.runtime.contexts[index], head + source, _OPTIONS)
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
    if dtype == torch.bool:  # any number is a truth value (scalar_tensor(-5, dtype=bool))
        return np.uint8(bool(value))
    if not dtype.is_floating_point and isinstance(value, int):
        # an integer out of the type's range wraps, as the CPU's conversion of a scalar
        # operand does (where(c, uint8, -5) takes 251)
        bits = torch.iinfo(dtype).bits
        value &= (1 << bits) - 1
        if torch.iinfo(dtype).min < 0 and value >= 1 << (bits - 1):
            value -= 1 << bits
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
        # an elementwise call's source and layout arguments per kind of call (its
        # expression and types, each tensor's dtype, shape, strides and device)
        self.plans: dict[tuple, tuple[str, list[int], list[list[int]]]] = {}

    def _where(self, t: torch.Tensor) -> tuple[int, cl.CommandQueue]:
        """The physical index of ``t``'s device and its current stream's queue (the backend
        looked up once, not once per question as ``torchport.device_index`` and
        ``torchport.current_stream`` each do)."""
        b = torchport.current_backend()
        logical = t.get_device()
        if b is None or logical < 0 or t.device.type != b.name:
            index = torchport.device_index(t)  # raises kernel_api's error
            return index, self.runtime.queue(index, torchport.current_stream(t))
        index = b.visible[logical]
        return index, self.runtime.queue(index, b.current_stream_handle(logical))

    def _buffer(self, index: int, t: torch.Tensor) -> list[Any]:
        """``(buffer, byte offset)`` of ``t``'s first element, the kernel's two arguments."""
        if t.numel() == 0:  # owns no memory, and no work-item reads it
            if index not in self.placeholders:
                self.placeholders[index] = cl.Buffer(self.runtime.contexts[index],
                                                     cl.mem_flags.READ_WRITE, 256)
            return [self.placeholders[index], np.uint64(0)]
        buf, off = self.runtime.locate(index, t.data_ptr())
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
        tensors = [out] + [o.tensor for o in ops if o.tensor is not None]
        checked = None if index_check is None else index_check[0]
        # what the source and the layout arguments depend on; a warm call of a known kind
        # skips the broadcast strides, the coalescing and the source's key
        plan_key = (expr, computes, tuple(None if o.tensor is not None else o.dtype
                                          for o in ops),
                    tuple(dt for dt, _ in scalars), tuple(at), pre, checked,
                    tuple((t.dtype, t.shape, t.stride(), t.get_device()) for t in tensors))
        plan = self.plans.get(plan_key)
        if plan is None:
            plan = self._elementwise_plan(out, ops, tensors, expr, computes, scalars, at, pre,
                                          checked)
            if len(self.plans) >= _PLANS:
                self.plans.clear()
            self.plans[plan_key] = plan
        source, head, strides = plan
        args: list[Any] = list(head)
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

    def _elementwise_plan(self, out: torch.Tensor, ops: Sequence[Operand],
                          tensors: Sequence[torch.Tensor], expr: str,
                          computes: tuple[torch.dtype, ...],
                          scalars: Sequence[tuple[torch.dtype, Any]], at: Sequence[str | None],
                          pre: str, checked: int | None
                          ) -> tuple[str, list[int], list[list[int]]]:
        """:meth:`elementwise`'s source, leading arguments (``n`` and the sizes) and each
        tensor's strides over the coalesced dimensions."""
        shape = out.shape
        device = out.device
        strides = [list(out.stride())]
        for t in tensors[1:]:
            if t.device != device:
                raise Decline("operands on two devices")
            strides.append(_broadcast_strides(t, shape))
        sizes, strides = _coalesce(list(shape), strides)
        key = ("elementwise", expr, computes, tuple((o.dtype, o.tensor is None) for o in ops),
               out.dtype, len(sizes), tuple(dt for dt, _ in scalars), tuple(at), pre, checked)
        source = self.sources.get(key)
        if source is None:
            source = self.sources[key] = _elementwise_source(
                out.dtype, ops, computes, len(sizes), expr, [dt for dt, _ in scalars], at, pre,
                checked)
        return source, [out.numel(), *sizes], strides

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
_PLANS = 4096  # elementwise plans kept before the cache starts again


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


@dataclass(frozen=True)
class Context:
    """What every group of kernels shares: the launcher, the dtypes the device computes in,
    and PyTorch's type promotion (cached)."""

    runtime: OpenCLRuntime
    launcher: Launcher
    dtypes: frozenset[torch.dtype]
    floats: list[torch.dtype]
    promote: Callable[..., torch.dtype]
    isfloat: Callable[[torch.dtype], bool]
