"""``torch.compile`` (inductor) for ``ocl``: the OpenCL backend's own inductor code generator.

The worked example of a vendor's own ``Scheduling`` (``torchport.graph.enable_inductor(
backend, codegen="torchport.backends.opencl.inductor:OpenCLScheduling")``, in
:mod:`torchport.backends.opencl.graph`): inductor
schedules and fuses the graph as for any SIMD device (its ``SIMDScheduling``), and this
module writes each fused kernel as OpenCL C:

* one work-item per element of the kernel's pointwise range (``xindex``); a reduction is a
  loop over the reduced range inside the work-item (``r0_index``), so each output element is
  reduced in index order by one work-item: no atomics, no tree;
* inductor's index expressions (strides, broadcasting, views) are printed as C over the
  buffers' elements: every input is read where it lies, strided;
* the program inductor generates calls :class:`OpenCLProgram` objects with its tensors;
  each call finds ``(cl.Buffer, byte offset)`` of every tensor with the runtime's
  ``locate`` and enqueues the kernel on the current stream's queue of the tensors'
  device: ordered with the eager ops queued on that stream, and nothing runs on the host.

Extern kernels (``mm``, convolution, ...) stay device ops through torchport's op layer.
What this generator cannot write (an op, a dtype, a reduction kind) raises
:class:`OpenCLCodegenError` when the graph is compiled, naming it and the ways out.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyopencl as cl
import sympy
import torch
from torch._inductor import ir
from torch._inductor.codegen.common import (
    CSE,
    CSEVariable,
    DeferredLine,
    IndentedBuffer,
    OpOverrides,
)
from torch._inductor.codegen.simd import SIMDKernel, SIMDScheduling
from torch._inductor.ops_handler import OpsHandler
from torch._inductor.virtualized import V
from torch.utils._sympy.printers import ExprPrinter

import torchport
from torchport.backends.opencl.runtime import REPORT_INDEX

__all__ = ["OpenCLCodegenError", "OpenCLKernel", "OpenCLProgram", "OpenCLScheduling"]

# element dtype -> the C type a buffer holds; half is read and written as float
_STORED = {torch.float32: "float", torch.float16: "half", torch.int64: "long",
           torch.int32: "int", torch.int16: "short", torch.int8: "char",
           torch.uint8: "uchar", torch.bool: "uchar"}
# value dtype -> the C type a kernel variable of it has (half computes in float)
_VALUE = {torch.float32: "float", torch.float16: "float", torch.int64: "long",
          torch.int32: "int", torch.int16: "short", torch.int8: "char",
          torch.uint8: "uchar", torch.bool: "bool"}
_NP = {torch.float32: np.float32, torch.int64: np.int64, torch.int32: np.int32,
       torch.int16: np.int16, torch.int8: np.int8, torch.uint8: np.uint8, torch.bool: np.uint8}
_REDUCTIONS = frozenset({"sum", "prod", "max", "min", "argmax", "argmin", "any", "xor_sum",
                         "welford_reduce", "welford_combine"})
_HELPERS = """#pragma OPENCL FP_CONTRACT OFF
inline float tp_round_half(float v) {
  ushort h; vstore_half_rte(v, 0, (__private half*)&h); return vload_half(0, (__private const half*)&h);
}
inline long tp_floordiv(long a, long b) { long q = a / b; return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q; }
inline long tp_mod(long a, long b) { long r = a % b; return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r; }
"""
_OPTIONS = ["-cl-fp32-correctly-rounded-divide-sqrt"]  # IEEE division and sqrt, as the CPU


class OpenCLCodegenError(RuntimeError):
    """Something in a graph on ``ocl`` the OpenCL code generator does not write."""


def _unsupported(what: str, dtype: torch.dtype | None = None) -> OpenCLCodegenError:
    on = f" on {dtype}" if dtype is not None else ""
    return OpenCLCodegenError(
        f"torch.compile on ocl: the OpenCL code generator does not support {what}{on}; "
        f"compile with backend='aot_eager' (the graph runs op by op on the device) or register "
        f"a graph compiler of your own (torchport.graph.register_graph_compiler)")


def _dtype_of(*values: Any) -> torch.dtype | None:
    for v in values:
        if isinstance(v, CSEVariable) and v.dtype is not None:
            return v.dtype
    return None


def _value_type(dtype: torch.dtype | None, what: str) -> str:
    if dtype not in _VALUE:
        raise _unsupported(what, dtype)
    return _VALUE[dtype]


def _isfloat(v: Any) -> bool:
    dt = _dtype_of(v)
    return dt is None or dt.is_floating_point


# ---- the program's side: built kernels, enqueued on the current stream ----

class OpenCLProgram:
    """One generated kernel as the compiled program calls it: built per device on first
    use, enqueued with ``(buffer, offset)`` of each tensor on the current stream."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.checks = "report_index(" in source  # reads indices from tensors: checks them
        self.kernels: dict[int, cl.Kernel] = {}
        self.lock = threading.Lock()  # a kernel object's arguments are set, then enqueued
        self.kernel(0)  # built when the program loads: a build error is a compile error

    @staticmethod
    def runtime() -> Any:
        b = torchport.current_backend()
        if b is None or b.name != "ocl":
            raise RuntimeError("an OpenCL compiled kernel needs the ocl backend registered")
        return b.runtime

    def kernel(self, index: int) -> cl.Kernel:
        k = self.kernels.get(index)
        if k is None:
            rt = self.runtime()
            head = _HELPERS + (REPORT_INDEX if self.checks else "")
            if rt.fp64[index]:
                head = "#pragma OPENCL EXTENSION cl_khr_fp64 : enable\n" + head
            program = cl.Program(rt.contexts[index], head + self.source).build(_OPTIONS)
            k = self.kernels[index] = program.all_kernels()[0]
        return k

    _placeholders: dict[int, cl.Buffer] = {}

    @classmethod
    def placeholder(cls, rt: Any, index: int) -> cl.Buffer:
        """A small buffer standing for an empty tensor's (which has no memory)."""
        buf = cls._placeholders.get(index)
        if buf is None:
            buf = cls._placeholders[index] = cl.Buffer(rt.contexts[index],
                                                      cl.mem_flags.READ_WRITE, 256)
        return buf

    def __call__(self, xnumel: int, rnumel: int, *args: Any) -> None:
        if xnumel == 0:
            return
        tensors = [a for a in args if isinstance(a, torch.Tensor) and a.device.type != "cpu"]
        index = torchport.device_index(tensors[0])
        rt = self.runtime()
        flat: list[Any] = [np.int64(xnumel), np.int64(rnumel)]
        for a in args:
            if isinstance(a, torch.Tensor) and a.device.type == "cpu" and a.dim() == 0:
                flat.append(_NP[a.dtype](a.item()))  # read now: the program's order
            elif isinstance(a, torch.Tensor):
                if a.device.type != "ocl" or torchport.device_index(a) != index:
                    raise RuntimeError(f"ocl compiled kernel: a tensor on {a.device}; the "
                                       f"kernel's tensors are on {tensors[0].device}")
                if a.numel() == 0:  # owns no memory, and no work-item reads it
                    buf, off = self.placeholder(rt, index), 0
                else:
                    buf, off = rt.locate(index, torchport.device_address(a))
                flat += [buf, np.uint64(off)]
            else:
                flat.append(np.int64(a))
        k = self.kernel(index)
        stream = torchport.current_stream(tensors[0])
        if self.checks:
            word, code = rt.error_word(index, stream, "index (compiled kernel)", lookup=True)
            flat += [word, np.int64(code)]
        queue = rt.queue(index, stream)
        with self.lock:
            k(queue, (int(xnumel),), None, *flat)


# ---- the code generator ----

def _on_host(name: str) -> bool:
    """Whether buffer ``name`` of the graph is a CPU tensor (a scalar the graph reads)."""
    buf = V.graph.try_get_buffer(name)
    device = buf.get_device() if buf is not None else None
    return device is not None and device.type == "cpu"


class OpenCLPrinter(ExprPrinter):
    """Index expressions as OpenCL C over ``long``."""

    def _print_Integer(self, expr: sympy.Expr) -> str:
        return f"{int(expr)}L"

    def _print_FloorDiv(self, expr: sympy.Expr) -> str:
        x, div = expr.args
        return f"tp_floordiv({self._print(x)}, {self._print(div)})"

    def _print_CleanDiv(self, expr: sympy.Expr) -> str:
        x, div = expr.args
        return f"(({self._print(x)}) / ({self._print(div)}))"

    def _print_ModularIndexing(self, expr: sympy.Expr) -> str:
        x, div, mod = (self._print(a) for a in expr.args)
        if div != "1L":
            x = f"tp_floordiv({x}, {div})"
        return f"tp_mod({x}, {mod})"

    def _print_PythonMod(self, expr: sympy.Expr) -> str:
        x, div = (self._print(a) for a in expr.args)
        return f"tp_mod({x}, {div})"

    def _print_Min(self, expr: sympy.Expr) -> str:
        out = self._print(expr.args[0])
        for a in expr.args[1:]:
            out = f"min((long)({out}), (long)({self._print(a)}))"
        return out

    def _print_Max(self, expr: sympy.Expr) -> str:
        out = self._print(expr.args[0])
        for a in expr.args[1:]:
            out = f"max((long)({out}), (long)({self._print(a)}))"
        return out

    def _print_Where(self, expr: sympy.Expr) -> str:
        c, a, b = (self._print(x) for x in expr.args)
        return f"(({c}) ? ({a}) : ({b}))"

    def _print_Pow(self, expr: sympy.Expr) -> str:
        base, exp = expr.args
        if exp.is_Integer and int(exp) >= 0:
            return "(" + "*".join([f"({self._print(base)})"] * int(exp) or ["1L"]) + ")"
        raise _unsupported(f"the index expression {expr}")

    _print_PowByNatural = _print_Pow

    def _print_Abs(self, expr: sympy.Expr) -> str:
        return f"labs({self._print(expr.args[0])})"

    def emptyPrinter(self, expr: Any) -> str:  # noqa: N802 (sympy's name)
        raise _unsupported(f"the index expression {expr} ({type(expr).__name__})")


_printer = OpenCLPrinter()


def _cexpr(expr: sympy.Expr) -> str:
    return _printer.doprint(expr)


def _constant(value: Any, dtype: torch.dtype) -> str:
    if dtype.is_floating_point:
        if dtype not in (torch.float32, torch.float16):
            raise _unsupported("a constant", dtype)
        v = float(value)
        if math.isnan(v):
            return "NAN"
        if math.isinf(v):
            return "INFINITY" if v > 0 else "(-INFINITY)"
        v = float(np.float32(v)) if dtype == torch.float32 else float(np.float16(v))
        return f"{v.hex()}f"
    if dtype == torch.bool:
        return "true" if value else "false"
    _value_type(dtype, "a constant")
    v = int(value)
    return f"({v}L)" if v != -(1 << 63) else "(-9223372036854775807L - 1)"


class OpenCLOverrides(OpOverrides):
    """Inductor's pointwise ops as OpenCL C expressions; an op not defined here raises
    :class:`OpenCLCodegenError` at compile time (see the end of this class)."""

    @staticmethod
    def constant(value: Any, dtype: torch.dtype) -> str:
        return _constant(value, dtype)

    @staticmethod
    def index_expr(expr: sympy.Expr, dtype: torch.dtype) -> str:
        k = V.kernel
        text = k.index_to_str(k.prepare_indexing(expr))
        return f"(({_value_type(dtype, 'index_expr')})({text}))"

    @staticmethod
    def value_expr(expr: sympy.Expr, dtype: torch.dtype) -> str:
        return OpenCLOverrides.index_expr(expr, dtype)

    @staticmethod
    def to_dtype(x: Any, dtype: torch.dtype, src_dtype: torch.dtype | None = None,
                 use_compute_types: bool = True) -> str:
        if dtype == torch.bool:
            return f"(({x}) != 0)"
        if dtype == torch.float16:
            return f"tp_round_half((float)({x}))"
        return f"(({_value_type(dtype, 'a conversion')})({x}))"

    # arithmetic
    @staticmethod
    def abs(x: Any) -> str:
        return f"fabs({x})" if _isfloat(x) else f"(({x}) < 0 ? -({x}) : ({x}))"

    @staticmethod
    def floordiv(a: Any, b: Any) -> str:
        if _isfloat(a) or _isfloat(b):
            raise _unsupported("floordiv", _dtype_of(a, b))
        return f"tp_floordiv({a}, {b})"

    @staticmethod
    def remainder(a: Any, b: Any) -> str:
        if _isfloat(a) or _isfloat(b):
            raise _unsupported("remainder", _dtype_of(a, b))
        return f"tp_mod({a}, {b})"

    @staticmethod
    def sign(x: Any) -> str:
        return f"((({x}) > 0) - (({x}) < 0))" if not _isfloat(x) else f"(({x}) != ({x}) ? ({x}) : (float)((({x}) > 0) - (({x}) < 0)))"

    # comparisons and logic
    @staticmethod
    def bitwise_not(x: Any) -> str:
        return f"(!({x}))" if _dtype_of(x) == torch.bool else f"(~({x}))"

    @staticmethod
    def identity(x: Any) -> Any:
        return x

    @staticmethod
    def floor_to_int(x: Any, dtype: torch.dtype) -> str:
        return f"(({_value_type(dtype, 'floor_to_int')})floor({x}))"

    @staticmethod
    def ceil_to_int(x: Any, dtype: torch.dtype) -> str:
        return f"(({_value_type(dtype, 'ceil_to_int')})ceil({x}))"

    @staticmethod
    def trunc_to_int(x: Any, dtype: torch.dtype) -> str:
        return f"(({_value_type(dtype, 'trunc_to_int')})({x}))"

    @staticmethod
    def pow(a: Any, b: Any) -> str:
        if not (_isfloat(a) and _isfloat(b)):
            raise _unsupported("pow", _dtype_of(a, b))
        return f"pow({a}, {b})"

    @staticmethod
    def masked(mask: Any, body: Callable[[], Any], other: Any) -> Any:
        """``body()`` where ``mask``, else ``other`` (padding, concatenation): the loads of
        ``body`` read only where the mask holds, the rest computes everywhere."""
        k = V.kernel
        prior = k.load_mask
        k.load_mask = str(mask) if prior is None else f"({prior}) && ({mask})"
        try:
            result = body()
        finally:
            k.load_mask = prior
        dtype = _dtype_of(result)
        if dtype is None:
            raise _unsupported("a masked value of unknown dtype")
        return V.ops.where(mask, result, V.ops.constant(other, dtype))


# inductor's ops that are one C expression of their operands ({0}, {1}, ...)
_EXPRESSIONS = {
    "add": "(({0}) + ({1}))",
    "sub": "(({0}) - ({1}))",
    "mul": "(({0}) * ({1}))",
    "truediv": "(({0}) / ({1}))",
    "div": "(({0}) / ({1}))",
    "neg": "(-({0}))",
    "square": "(({0}) * ({0}))",
    "reciprocal": "(1.0f / ({0}))",
    "truncdiv": "(({0}) / ({1}))",
    "mod": "(({0}) % ({1}))",
    "maximum": "((({0}) != ({0}) || ({0}) > ({1})) ? ({0}) : ({1}))",  # NaN wins, as torch.maximum
    "minimum": "((({0}) != ({0}) || ({0}) < ({1})) ? ({0}) : ({1}))",
    "relu": "(({0}) < 0 ? 0 : ({0}))",  # NaN stays NaN
    "where": "(({0}) ? ({1}) : ({2}))",
    "eq": "(({0}) == ({1}))",
    "ne": "(({0}) != ({1}))",
    "lt": "(({0}) < ({1}))",
    "le": "(({0}) <= ({1}))",
    "gt": "(({0}) > ({1}))",
    "ge": "(({0}) >= ({1}))",
    "logical_and": "(({0}) && ({1}))",
    "logical_or": "(({0}) || ({1}))",
    "logical_not": "(!({0}))",
    "logical_xor": "((!({0})) != (!({1})))",
    "bitwise_and": "(({0}) & ({1}))",
    "bitwise_or": "(({0}) | ({1}))",
    "bitwise_xor": "(({0}) ^ ({1}))",
    "and_": "(({0}) & ({1}))",
    "or_": "(({0}) | ({1}))",
    "xor": "(({0}) ^ ({1}))",
    "fmod": "fmod({0}, {1})",
    "atan2": "atan2({0}, {1})",
    "copysign": "copysign({0}, {1})",
    "isnan": "(({0}) != ({0}))",
    "isinf": "(isinf({0}) != 0)",
    "signbit": "(signbit({0}) != 0)",
    "sigmoid": "(1.0f / (1.0f + exp(-({0}))))",
    "rsqrt": "(1.0f / sqrt({0}))",
    "round": "rint({0})",  # half to even, as torch.round
}


def _expression(name: str, template: str) -> Callable[..., str]:
    def op(*args: Any) -> str:
        return template.format(*args)

    op.__name__ = name
    return staticmethod(op)  # type: ignore[return-value]


for _name, _template in _EXPRESSIONS.items():
    setattr(OpenCLOverrides, _name, _expression(_name, _template))


def _float_function(name: str, c: str) -> Callable[[Any], str]:
    def op(x: Any) -> str:
        if not _isfloat(x):
            raise _unsupported(name, _dtype_of(x))
        return f"{c}({x})"

    op.__name__ = name
    return staticmethod(op)  # type: ignore[return-value]


for _name, _c in [("exp", "exp"), ("exp2", "exp2"), ("expm1", "expm1"), ("log", "log"),
                  ("log2", "log2"), ("log10", "log10"), ("log1p", "log1p"), ("sqrt", "sqrt"),
                  ("sin", "sin"), ("cos", "cos"), ("tan", "tan"), ("tanh", "tanh"),
                  ("sinh", "sinh"), ("cosh", "cosh"), ("asin", "asin"), ("acos", "acos"),
                  ("atan", "atan"), ("asinh", "asinh"), ("acosh", "acosh"),
                  ("atanh", "atanh"), ("lgamma", "lgamma"), ("erf", "erf"), ("erfc", "erfc"), ("floor", "floor"),
                  ("ceil", "ceil"), ("trunc", "trunc")]:
    setattr(OpenCLOverrides, _name, _float_function(_name, _c))


def _refuse(name: str) -> Callable[..., str]:
    def op(*args: Any, **kwargs: Any) -> str:
        dt = _dtype_of(*args)
        if dt is None:
            dt = next((a for a in [*args, *kwargs.values()] if isinstance(a, torch.dtype)), None)
        raise _unsupported(f"the op {name!r}", dt)

    return staticmethod(op)  # type: ignore[return-value]


# every other op of inductor's op set: a compile-time error, never a kernel of another
# language's syntax inherited from OpOverrides
_KERNEL_METHODS = {"load", "store", "reduction", "store_reduction", "indirect_indexing",
                   "check_bounds", "scan", "sort", "bucketize", "output", "placeholder"}
for _name in dir(OpsHandler):
    if (not _name.startswith("_") and _name not in _KERNEL_METHODS
            and _name not in OpenCLOverrides.__dict__):
        setattr(OpenCLOverrides, _name, _refuse(_name))


class _TypedCSE(CSE):
    """Inductor's CSE writing ``<C type> tmpN = expr;``: the declaration's type is the new
    variable's dtype (OpenCL C has no ``auto``)."""

    _next_prefix = ""

    @property  # type: ignore[override]
    def prefix(self) -> str:
        return self._next_prefix

    @prefix.setter
    def prefix(self, value: str) -> None:
        pass

    def newvar(self, *args: Any, **kwargs: Any) -> Any:
        var = super().newvar(*args, **kwargs)
        self._next_prefix = _value_type(var.dtype, "a value") + " "
        kernel = V.kernel
        if isinstance(kernel, OpenCLKernel) and not kernel.inside_reduction:
            kernel.outside_loop_vars.add(var)
        return var


class OpenCLKernel(SIMDKernel):
    """A fused kernel as OpenCL C: one work-item per ``xindex``, reductions as a loop over
    ``r0_index`` in the work-item."""

    overrides = OpenCLOverrides  # type: ignore[assignment]
    kexpr = staticmethod(_cexpr)  # type: ignore[assignment]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cse = _TypedCSE(suffix=";")
        self.outside_loop_vars: set[Any] = set()
        self.pre_loop = IndentedBuffer()
        self.post_loop = IndentedBuffer()
        self.loop_indexing = IndentedBuffer()
        self.buffer_dtypes: dict[str, torch.dtype] = {}
        self.load_mask: str | None = None  # inside ops.masked: where loads may read

    def should_use_persistent_reduction(self) -> bool:
        return False  # the reduction is a loop in the work-item

    def want_no_x_dim(self) -> bool:
        return False

    def dtype_to_str(self, dtype: torch.dtype) -> str:
        return _value_type(dtype, "a value")

    def get_index_dtype_as_torch_dtype(self) -> torch.dtype:
        return torch.int64  # indices are computed in long

    def codegen_iteration_ranges_entry(self, entry: Any) -> None:
        line = f"long {entry.name} = {_cexpr(entry.expr)};"
        (self.loop_indexing if entry.root.is_loop else self.body).writeline(line)

    def check_bounds(self, expr: sympy.Expr, size: sympy.Expr, lower: bool,
                     upper: bool) -> None:
        """An index read from a tensor (gather, embedding, cross entropy's target): out of
        range, the work-item reads and writes nothing and records it in the device's error
        word, raised at the next synchronisation (as the eager index kernels do)."""
        if not (lower or upper):
            return
        at = self.index_to_str(self.prepare_indexing(expr))
        extent = self.index_to_str(self.prepare_indexing(size))
        bad = []
        if lower:
            bad.append(f"({at}) < 0")
        if upper:
            bad.append(f"({at}) >= ({extent})")
        test = " || ".join(bad)
        if self.load_mask is not None:  # an index only read where the mask holds
            test = f"({self.load_mask}) && ({test})"
        self.compute.writeline(f"if ({test}) {{ report_index(tp_err, tp_eop, 0, "
                               f"{at}, {extent}); return; }}")

    def _pointer(self, name: str, output: bool) -> tuple[str, torch.dtype]:
        dtype = V.graph.get_dtype(name)
        if dtype not in _STORED:
            raise _unsupported(f"a buffer ({name})", dtype)
        var = self.args.output(name) if output else self.args.input(name)
        self.buffer_dtypes[var] = dtype
        return var, dtype

    def load(self, name: str, index: sympy.Expr) -> CSEVariable:
        var, dtype = self._pointer(name, False)
        at = self.index_to_str(self.prepare_indexing(index))
        if dtype == torch.float16:
            line = f"vload_half({at}, {var})"
        elif dtype == torch.bool:
            line = f"({var}[{at}] != 0)"
        else:
            line = f"{var}[{at}]"
        # an index computed in the kernel, or a mask: after the code computing it
        where = self.compute if self.is_indirect_indexing(index) else self.loads
        if self.load_mask is not None:
            line, where = f"(({self.load_mask}) ? {line} : 0)", self.compute
        return self.cse.generate(where, line, dtype=dtype)

    def store(self, name: str, index: sympy.Expr, value: CSEVariable,
              mode: Any = None) -> None:
        if mode is not None:
            raise _unsupported(f"a store with mode {mode!r}", V.graph.get_dtype(name))
        var, dtype = self._pointer(name, True)
        at = self.index_to_str(self.prepare_indexing(index))
        # a buffer only this kernel uses is removed after codegen: its store goes too
        self.stores.writeline(DeferredLine(name, self._store_line(var, dtype, at, value)))

    @staticmethod
    def _store_line(var: str, dtype: torch.dtype, at: str, value: Any) -> str:
        if dtype == torch.float16:
            return f"vstore_half_rte((float)({value}), {at}, {var});"
        if dtype == torch.bool:
            return f"{var}[{at}] = ({value}) != 0;"
        return f"{var}[{at}] = ({_STORED[dtype]})({value});"

    def store_reduction(self, name: str, index: sympy.Expr, value: CSEVariable) -> None:
        prior, self.inside_reduction = self.inside_reduction, False
        try:
            var, dtype = self._pointer(name, True)
            at = self.index_to_str(self.prepare_indexing(index))
        finally:
            self.inside_reduction = prior
        self.post_loop.writeline(DeferredLine(name, self._store_line(var, dtype, at, value)))

    def reduction(self, dtype: torch.dtype, src_dtype: torch.dtype, reduction_type: str,
                  value: Any) -> Any:
        if reduction_type not in _REDUCTIONS:
            raise _unsupported(f"the reduction {reduction_type!r}", src_dtype)
        key = (src_dtype, reduction_type, value)
        if key in self.cse.reduction_cache:
            return self.cse.reduction_cache[key]
        ct = _value_type(dtype, f"the reduction {reduction_type!r}")
        _value_type(src_dtype, f"the reduction {reduction_type!r}")
        if reduction_type.startswith("welford"):
            if not dtype.is_floating_point:
                raise _unsupported(f"the reduction {reduction_type!r}", dtype)
            accs = tuple(self._accumulator(dtype) for _ in range(3))
            self.cse.reduction_cache[key] = accs
            self._welford(ct, reduction_type, value, *accs)
            return accs
        acc = self._accumulator(dtype)
        v = str(value)
        if reduction_type in ("argmax", "argmin"):
            best = f"{acc}_value"
            start = "max" if reduction_type == "argmax" else "min"
            init = _constant(ir.Reduction.default_value(start, src_dtype), src_dtype)
            self.pre_loop.writeline(f"{_value_type(src_dtype, 'argmax')} {best} = {init};")
            self.pre_loop.writeline(f"long {acc} = 0;")
            cmp = ">" if reduction_type == "argmax" else "<"
            r = self.range_trees[-1].index_sym()
            self.compute.writeline(
                f"if (!({best} != {best}) && (({v}) != ({v}) || ({v}) {cmp} {best})) "
                f"{{ {best} = {v}; {acc} = {r}; }}")
        else:
            init = ir.Reduction.default_accumulator(reduction_type, dtype)
            self.pre_loop.writeline(f"{ct} {acc} = {_constant(init, dtype)};")
            update = {
                "sum": f"{acc} = {acc} + ({v});",
                "xor_sum": f"{acc} = {acc} ^ ({v});",
                "prod": f"{acc} = {acc} * ({v});",
                "any": f"{acc} = {acc} || ({v});",
                "max": f"if (({v}) != ({v}) || ({v}) > {acc}) {acc} = {v};",
                "min": f"if (({v}) != ({v}) || ({v}) < {acc}) {acc} = {v};",
            }[reduction_type]
            self.compute.writeline(update)
        self.cse.reduction_cache[key] = acc
        return acc

    def _accumulator(self, dtype: torch.dtype) -> Any:
        """A variable declared before the reduction loop (kept in scope after it)."""
        prior, self.inside_reduction = self.inside_reduction, False
        acc = self.cse.newvar(dtype=dtype)
        self.inside_reduction = prior
        self.outside_loop_vars.add(acc)
        return acc

    def _welford(self, ct: str, kind: str, value: Any, mean: Any, m2: Any,
                 weight: Any) -> None:
        """Welford's running mean and sum of squared deviations, in index order
        (``welford_combine``: merging partial ``(mean, m2, weight)`` of a split reduction)."""
        for acc in (mean, m2, weight):
            self.pre_loop.writeline(f"{ct} {acc} = 0;")
        if kind == "welford_reduce":
            self.compute.writeline(
                f"{{ {weight} += 1; {ct} d = ({value}) - {mean}; {mean} += d / {weight}; "
                f"{m2} += d * (({value}) - {mean}); }}")
            return
        vmean, vm2, vweight = value
        self.compute.writeline(
            f"{{ {ct} w = {weight} + ({vweight}); {ct} d = ({vmean}) - {mean}; "
            f"{ct} f = w == 0 ? 0 : ({vweight}) / w; {mean} += d * f; "
            f"{m2} += ({vm2}) + d * d * {weight} * f; {weight} = w; }}")

    def scan(self, *args: Any, **kwargs: Any) -> Any:
        raise _unsupported("scans (cumsum, cumprod, ...)")

    def sort(self, *args: Any, **kwargs: Any) -> Any:
        raise _unsupported("sort")

    def bucketize(self, *args: Any, **kwargs: Any) -> Any:
        raise _unsupported("bucketize")

    def codegen_body(self) -> None:
        """Move the pending code into the body: as it is, or, inside a reduction, as a loop
        over the reduced range (accumulators before it, the reductions' stores after)."""
        if not (self.loads or self.compute or self.stores or self.pre_loop or self.post_loop
                or self.loop_indexing):
            return
        if self.inside_reduction and self.features.is_reduction():
            tree = self.range_trees[-1]
            r = tree.index_sym()
            self.body.splice(self.pre_loop)
            self.body.writeline(f"for (long {r} = 0; {r} < {tree.prefix}numel; {r}++) {{")
            with self.body.indent():
                self.body.splice(self.loop_indexing)
                self.body.splice(self.loads)
                self.body.splice(self.compute)
                self.body.splice(self.stores)
            self.body.writeline("}")
            self.body.splice(self.post_loop)
            # what the loop defined is out of scope after it
            self.cse.invalidate(self.outside_loop_vars)
            tree.cache_clear()
        else:
            self.body.splice(self.loads)
            self.body.splice(self.compute)
            self.body.splice(self.stores)
        for buf in (self.loads, self.compute, self.stores, self.pre_loop, self.post_loop,
                    self.loop_indexing):
            buf.clear()

    def codegen_kernel(self, name: str | None = None) -> str:
        self.codegen_body()
        arg_defs, call_args, _, arg_types = self.args.python_argdefs()
        params = ["long xnumel", "long r0_numel"]
        prologue = []
        for arg, outer, typ in zip(arg_defs, call_args, arg_types, strict=True):
            arg = getattr(arg, "name", str(arg))
            if isinstance(typ, torch.dtype) and _on_host(outer):
                # a CPU scalar the graph reads (an optimizer's step): its value at the launch
                if typ == torch.float16 or typ not in _STORED:
                    raise _unsupported(f"a CPU scalar input ({outer})", typ)
                params.append(f"{_STORED[typ]} {arg}_value")
                prologue.append(f"{_STORED[typ]} {arg}[1] = {{{arg}_value}};")
            elif isinstance(typ, torch.dtype):
                params += [f"__global char* {arg}_base", f"ulong {arg}_offset"]
                prologue.append(f"__global {_STORED[typ]}* {arg} = "
                                f"(__global {_STORED[typ]}*)({arg}_base + {arg}_offset);")
            else:
                params.append(f"long {arg}")
        if "report_index(" in self.body.getvalue():
            params += ["__global long* tp_err", "long tp_eop"]  # OpenCLProgram adds them
        code = IndentedBuffer()
        code.writeline(f"__kernel void tp_kernel({', '.join(params)}) {{")
        with code.indent():
            code.writelines(prologue)
            x = self.range_trees[0]
            code.writeline(f"long {x.index_sym()} = get_global_id(0);")
            code.writeline(f"if ({x.index_sym()} >= xnumel) return;")
            code.splice(self.body)
        code.writeline("}")
        return code.getvalue()

    def call_kernel(self, name: str, node: Any = None, deallocate_ws: bool = True) -> None:
        wrapper = V.graph.wrapper_code
        _, call_args, _, _ = self.args.python_argdefs()
        numels = [self.numels.get("x", sympy.S.One), self.numels.get("r0_", sympy.S.One)]
        sizes = [wrapper.codegen_python_sizevar(V.graph.sizevars.simplify(n)) for n in numels]
        args = [wrapper.codegen_python_sizevar(a) if isinstance(a, sympy.Expr) else str(a)
                for a in call_args]
        wrapper.generate_kernel_call(name, [*sizes, *args],
                                     device=V.graph.get_current_device_or_throw(),
                                     triton=False)


class OpenCLScheduling(SIMDScheduling):
    """Inductor's SIMD scheduling (fusion, node order, reduction loops) with OpenCL C
    kernels (:class:`OpenCLKernel`): the ``ocl`` device's own code generator."""

    kernel_type = OpenCLKernel  # type: ignore[assignment]

    @classmethod
    def get_backend_features(cls, device: torch.device) -> Any:
        from torch.utils._ordered_set import OrderedSet

        return OrderedSet()

    @classmethod
    def get_tiling_and_scores(cls, node_schedule: Any, numel: sympy.Expr,
                              reduction_numel: sympy.Expr = sympy.S.One,
                              coalesce_analysis: Any = None) -> tuple[Any, Any]:
        # one flat pointwise range and one reduction range: a work-item per element
        return cls.create_tiling([numel], [reduction_numel]), None

    def define_kernel(self, src_code: str, node_schedule: Sequence[Any], kernel: Any) -> str:
        wrapper = V.graph.wrapper_code
        if src_code in wrapper.src_to_kernel:
            return wrapper.src_to_kernel[src_code]
        name = f"ocl_kernel_{wrapper.next_kernel_suffix()}"
        wrapper.src_to_kernel[src_code] = name
        wrapper.add_import_once("from torchport.backends.opencl.inductor import OpenCLProgram")
        body = IndentedBuffer()
        body.writeline("OpenCLProgram('''")
        body.splice(src_code, strip=True)
        body.writeline("''')")
        wrapper.define_kernel(name, body.getvalue(), None, gpu=False)
        return name




