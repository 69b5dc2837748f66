"""OpenCL C for the values of ``ocl``'s inductor kernels: the C types of dtypes, constants,
index expressions (:class:`OpenCLPrinter`) and inductor's pointwise ops
(:class:`OpenCLOverrides`), and :class:`OpenCLCodegenError` for what has none.

Apart from the kernel (:mod:`.inductor_kernel`), which places these expressions in a work-item
(loads, stores, reduction loops): this module is the language's vocabulary, one C expression
per op, and the list of ops the generator refuses.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import sympy
import torch
from torch._inductor.codegen.common import CSEVariable, OpOverrides
from torch._inductor.ops_handler import OpsHandler
from torch._inductor.virtualized import V
from torch.utils._sympy.printers import ExprPrinter

# element dtype -> the C type a buffer holds; half is read and written as float
_STORED = {torch.float32: "float", torch.float16: "half", torch.int64: "long",
           torch.int32: "int", torch.int16: "short", torch.int8: "char",
           torch.uint8: "uchar", torch.bool: "uchar"}
# value dtype -> the C type a kernel variable of it has (half computes in float)
_VALUE = {torch.float32: "float", torch.float16: "float", torch.int64: "long",
          torch.int32: "int", torch.int16: "short", torch.int8: "char",
          torch.uint8: "uchar", torch.bool: "bool"}


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
