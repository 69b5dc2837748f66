"""One fused ``ocl`` kernel as OpenCL C: :class:`OpenCLKernel`, inductor's ``SIMDKernel`` with
one work-item per element of the pointwise range and a reduction as a loop inside it.

Apart from the C expressions it writes (:mod:`.inductor_exprs`) and from the scheduling that
makes it (:mod:`.inductor`): this module owns a kernel's structure -- its parameters, loads
and stores, bounds checks, accumulators and the reduction loop -- and the line of the
compiled program that calls it.
"""

from __future__ import annotations

from typing import Any

import sympy
import torch
from torch._inductor import ir
from torch._inductor.codegen.common import (
    CSE,
    CSEVariable,
    DeferredLine,
    IndentedBuffer,
)
from torch._inductor.codegen.simd import SIMDKernel
from torch._inductor.virtualized import V

from torchport.backends.opencl.inductor_exprs import (
    _STORED,
    OpenCLOverrides,
    _cexpr,
    _constant,
    _unsupported,
    _value_type,
)

_REDUCTIONS = frozenset({"sum", "prod", "max", "min", "argmax", "argmin", "any", "xor_sum",
                         "welford_reduce", "welford_combine"})


def _on_host(name: str) -> bool:
    """Whether buffer ``name`` of the graph is a CPU tensor (a scalar the graph reads)."""
    buf = V.graph.try_get_buffer(name)
    device = buf.get_device() if buf is not None else None
    return device is not None and device.type == "cpu"


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
