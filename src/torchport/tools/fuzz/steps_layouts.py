"""The families of steps beyond dense strided tensors and single calls: sparse tensors,
quantized tensors, and sequences of calls of one op whose arguments vary.

The sequences aim at what a per-overload learnt path can get wrong: the device decides how
to serve an overload (its kernel, a decomposition, the CPU fallback, the CPU's refusal) on
the overload's first call, and a later call of the same overload with other arguments (a
dtype, a shape, a scalar's value or type, a layout, ``requires_grad``; a valid call after a
refused one) must not take a path that only fitted the first. Each call is a step of its own
(``seq:{op}``), so the first difference names the call that went wrong.

One family per method of :class:`LayoutSteps` (each returns a step, or None where nothing
fits; a sequence emits its calls itself, and the backward of those with ``requires_grad``,
and returns None); the draw order and weights are :mod:`.generator`'s.
"""

from __future__ import annotations

import torch

from torchport.tools.fuzz.catalog import FLOATS, INTS, cuda_checks_devices, dt
from torchport.tools.fuzz.draw import Draw
from torchport.tools.fuzz.program import Step

SPARSE_LAYOUTS = ("coo", "coo", "coo-uncoalesced", "csr", "csc")
# ops on a sparse tensor {s} (2-D, shape (r, c)); {d} a dense (c, 3) operand of its dtype,
# {e} a dense tensor of its shape: (name, template, exact)
SPARSE_OPS = (
    ("to_dense", "{s}.to_dense()", True), ("coalesce", "{s}.coalesce()", True),
    ("add", "{s} + {s}", True), ("sub-dense", "{e} - {s}", True), ("mul-scalar", "{s} * 2", True),
    ("mul", "{s} * {s}", True), ("div", "{s} / 2", True), ("neg", "torch.neg({s})", True),
    ("abs", "{s}.abs()", True), ("sqrt", "{s}.abs().sqrt()", False),
    ("mm", "torch.sparse.mm({s}, {d})", False), ("matmul", "{s} @ {d}", False),
    ("addmm", "torch.addmm({d}[:1], {s}, {d})", False), ("mv", "torch.mv({s}, {d}[:, 0])", False),
    ("sum", "torch.sparse.sum({s})", False), ("sum-dim", "torch.sparse.sum({s}, 0)", False),
    ("sum-all", "{s}.sum()", False), ("t", "{s}.t()", True),
    ("transpose", "{s}.transpose(0, 1)", True),
    ("index_select", "{s}.index_select(0, torch.tensor([0, 0], device=dev))", True),
    ("cat", "torch.cat([{s}, {s}])", True), ("clone", "{s}.clone()", True),
    ("softmax", "torch.sparse.softmax({s}, 1)", False),
    ("log_softmax", "torch.sparse.log_softmax({s}, 0)", False),
    ("sparse_mask", "{e}.sparse_mask({s})", True), ("values", "{s}.values()", True),
    ("indices", "{s}.indices()", True), ("crow", "{s}.crow_indices()", True),
    ("nnz", "{s}._nnz()", True), ("to-cpu", "{s}.cpu()", True),
    ("to-dtype", "{s}.to(torch.float64)", True), ("zero_", "{s}.clone().zero_()", True),
    ("mul_", "{s}.clone().mul_(3)", True), ("to_sparse_csr", "{s}.to_sparse_csr()", True),
    ("to_sparse", "{s}.to_sparse()", True), ("is_coalesced", "{s}.is_coalesced()", True),
    ("copy_", "torch.zeros_like({s}).copy_({s})", True), ("pow", "{s}.pow(2)", True),
)

QDTYPES = (torch.quint8, torch.qint8, torch.qint32)
# ops on a quantized tensor {q} (per tensor; {q2} another of the same shape and qdtype);
# (name, template, exact)
QUANT_OPS = (
    ("dequantize", "{q}.dequantize()", True), ("int_repr", "{q}.int_repr()", True),
    ("q_scale", "{q}.q_scale()", True), ("q_zero_point", "{q}.q_zero_point()", True),
    ("qscheme", "str({q}.qscheme())", True), ("clone", "{q}.clone()", True),
    ("step-slice", "{q}[::2]", True), ("t", "{q}.reshape(-1, 1).t()", True),
    ("reshape", "{q}.reshape(-1)", True), ("relu", "torch.relu({q})", True),
    ("relu_", "torch.relu_({q}.clone())", True), ("to-cpu", "{q}.cpu()", True),
    ("add", "torch.ops.quantized.add({q}, {q2}, 0.2, 3)", True),
    ("mul", "torch.ops.quantized.mul({q}, {q2}, 0.3, 1)", True),
    ("add-scalar", "torch.ops.quantized.add({q}, 1.5)", True),
    ("cat", "torch.cat([{q}, {q}])", True),
    ("equal", "torch.equal({q}, {q2})", True), ("contiguous", "{q}.reshape(-1, 1).t().contiguous()",
                                                   True),
    ("sigmoid", "torch.sigmoid({q})", True), ("hardtanh", "torch.nn.functional.hardtanh({q})",
                                              True),
    ("mean", "torch.mean({q})", True), ("topk", "torch.topk({q}.reshape(-1), 1)", True),
    ("sort", "torch.sort({q}.reshape(-1))", True),
    ("copy_", "torch.empty_like({q}).copy_({q})", True),
    ("copy_-float", "{q}.clone().copy_({q}.dequantize() * 2)", True),
    ("fill_", "{q}.clone().fill_(0.5)", True), ("max", "torch.max({q}.reshape(-1))", True),
    ("requantize", "torch.quantize_per_tensor({q}.dequantize(), 0.05, 0, {qd})", True),
    ("per-channel", "torch.quantize_per_channel({q}.dequantize().reshape(-1, 1).expand(-1, 2)"
                    ".contiguous(), torch.tensor([0.1, 0.2], dtype=torch.float64, device=dev), "
                    "torch.tensor([0, 1], device=dev), 1, {qd})", True),
    ("fake-quantize", "torch.fake_quantize_per_tensor_affine({q}.dequantize(), 0.1, 2, 0, 255)",
     True),
    ("dynamic", "torch.quantize_per_tensor_dynamic({q}.dequantize(), torch.quint8, False)",
     True),
)

# ops called several times in a row with varied arguments: (name, template, exact, dtypes).
# {x} the operand (a fresh tensor, varied per call), {y} a second operand of its shape and
# dtype, {p} the call's scalar parameter (drawn from the entry's choices), {dim} a dim of {x}
SEQ_OPS: tuple[tuple[str, str, bool, tuple[str, ...]], ...] = (
    ("pow", "torch.pow({x}, {p})", False, ("2", "3", "-0.5", "0.5", "0", "1", "-1", "2.5", "-2",
                                           "True")),
    ("pow-op", "{x} ** {p}", False, ("2", "3", "-0.5", "0.5", "0", "1", "-2")),
    ("rpow", "{p} ** {x}", False, ("2", "0.5", "-1", "1", "0")),
    ("float_power", "torch.float_power({x}, {p})", False, ("2", "0.5", "-1", "3")),
    ("clamp", "torch.clamp({x}, min={p})", True, ("0", "-1", "0.5", "None", "2")),
    ("clamp-max", "torch.clamp({x}, {p}, 1)", True, ("0", "-1", "0.5", "-2.5")),
    ("add-alpha", "torch.add({x}, {y}, alpha={p})", True, ("1", "2", "-1", "0.5", "0")),
    ("sub-alpha", "torch.sub({x}, {y}, alpha={p})", True, ("1", "2", "0.5")),
    ("div-mode", "torch.div({x}, {y}, rounding_mode={p})", True, ("None", "'floor'", "'trunc'")),
    ("div-scalar", "torch.div({x}, {p})", True, ("2", "0", "-0.5", "3")),
    ("remainder", "torch.remainder({x}, {p})", True, ("2", "-3", "1.5", "0")),
    ("fmod", "torch.fmod({x}, {p})", True, ("2", "-3", "1.5", "0")),
    ("floor_divide", "torch.floor_divide({x}, {p})", True, ("2", "-3", "1.5", "True")),
    ("round", "torch.round({x}, decimals={p})", True, ("0", "1", "2", "-1")),
    ("mul-scalar", "torch.mul({x}, {p})", True, ("2", "0.5", "True", "-1", "(1+1j)")),
    ("lerp", "torch.lerp({x}, {y}, {p})", False, ("0.5", "0", "1", "2")),
    ("addcmul", "torch.addcmul({x}, {y}, {y}, value={p})", False, ("1", "0.5", "-2", "0")),
    ("addcdiv", "torch.addcdiv({x}, {y}, {y}, value={p})", False, ("1", "0.5", "-2")),
    ("leaky_relu", "torch.nn.functional.leaky_relu({x}, {p})", True, ("0.01", "0.2", "0", "1")),
    ("elu", "torch.nn.functional.elu({x}, {p})", False, ("1.0", "0.5", "0", "2")),
    ("celu", "torch.nn.functional.celu({x}, {p})", False, ("1.0", "0.5", "2")),
    ("softplus", "torch.nn.functional.softplus({x}, {p})", False, ("1", "2", "0.5")),
    ("hardtanh", "torch.nn.functional.hardtanh({x}, -{p}, {p})", True, ("1", "0.5", "2", "0")),
    ("threshold", "torch.nn.functional.threshold({x}, {p}, -1)", True, ("0", "0.5", "-1")),
    ("logit", "torch.logit({x}, eps={p})", False, ("None", "1e-6", "0.1")),
    ("nan_to_num", "torch.nan_to_num({x}, nan={p})", True, ("0.0", "1.5", "-1")),
    ("vector_norm", "torch.linalg.vector_norm({x}, {p})", False,
     ("2", "1", "0", "3", "float('inf')", "-float('inf')", "0.5")),
    ("norm", "torch.norm({x}, {p})", False, ("2", "1", "'fro'", "3", "float('inf')")),
    ("sum-dtype", "torch.sum({x}, dtype={p})", False,
     ("None", "torch.float64", "torch.int64", "torch.float32", "torch.complex64")),
    ("cumsum-dtype", "torch.cumsum({x}, {dim}, dtype={p})", False,
     ("None", "torch.float64", "torch.int64", "torch.int32")),
    ("prod-dtype", "torch.prod({x}, dtype={p})", False, ("None", "torch.float64", "torch.int64")),
    ("softmax", "torch.softmax({x}, {dim}, dtype={p})", False,
     ("None", "torch.float64", "torch.float32")),
    ("log_softmax", "torch.log_softmax({x}, {dim})", False, ("None",)),
    ("mean-dim", "torch.mean({x}, {dim}, keepdim={p})", False, ("True", "False")),
    ("var", "torch.var({x}, correction={p})", False, ("0", "1", "2")),
    ("std-dim", "torch.std({x}, {dim}, correction={p})", False, ("0", "1")),
    ("topk", "torch.topk({x}.reshape(-1), {p})", True, ("1", "2", "0", "3")),
    ("kthvalue", "torch.kthvalue({x}.reshape(-1), {p})", True, ("1", "2", "3")),
    ("tril", "torch.tril({x}, {p})", True, ("0", "1", "-1", "5")),
    ("triu", "torch.triu({x}, {p})", True, ("0", "1", "-1")),
    ("diff", "torch.diff({x}, n={p})", True, ("1", "2", "0")),
    ("roll", "torch.roll({x}, {p})", True, ("1", "-2", "0", "7")),
    ("histc", "torch.histc({x}, bins={p})", True, ("4", "1", "10")),
    ("cummax", "torch.cummax({x}, {dim})", True, ("None",)),
    ("logcumsumexp", "torch.logcumsumexp({x}, {dim})", False, ("None",)),
    ("quantile", "torch.quantile({x}.reshape(-1), {p})", False, ("0.5", "0.0", "1.0", "0.25")),
    ("shift", "torch.bitwise_left_shift({x}, {p})", True, ("1", "3", "0", "-1", "70")),
    ("rshift", "{x} >> {p}", True, ("1", "3", "0", "63")),
    ("bitwise_and", "torch.bitwise_and({x}, {p})", True, ("1", "3", "True", "-1")),
    ("heaviside", "torch.heaviside({x}, {y})", True, ("None",)),
    ("xlogy", "torch.xlogy({x}, {p})", False, ("2", "0", "0.5")),
    ("polygamma", "torch.polygamma({p}, {x})", False, ("0", "1", "2")),
    ("special-zeta", "torch.special.zeta({x}, {p})", False, ("2", "1", "3.5")),
    ("mvlgamma", "torch.mvlgamma({x}.abs() + 2, {p})", False, ("1", "2", "3")),
    ("renorm", "torch.renorm({x}, {p}, 0, 1.0)", False, ("1", "2", "3")),
    ("cdist", "torch.cdist({x}.reshape(-1, 1), {y}.reshape(-1, 1), {p})", False,
     ("2.0", "1.0", "0.0", "3.0", "float('inf')")),
    ("pdist", "torch.nn.functional.pdist({x}.reshape(-1, 1), {p})", False, ("2", "1", "0", "3")),
    ("dropout-eval", "torch.nn.functional.dropout({x}, {p}, training=False)", True,
     ("0.5", "0.0", "1.0")),
    ("where-scalar", "torch.where({x} > 0, {x}, {p})", True, ("0", "0.5", "True", "-1")),
    ("masked_fill", "{x}.masked_fill({x} > 0, {p})", True, ("0", "2.5", "True", "-1")),
    ("fill_", "{x}.clone().fill_({p})", True, ("0", "2.5", "True", "-1", "(1+2j)")),
    ("full_like", "torch.full_like({x}, {p})", True, ("0", "2.5", "True", "-1")),
    ("isclose", "torch.isclose({x}, {y}, rtol={p})", True, ("1e-05", "0.1", "0")),
    ("eq-scalar", "torch.eq({x}, {p})", True, ("0", "0.5", "True", "-1")),
    ("sign-ops", "torch.copysign({x}, {p})", True, ("1", "-1", "-0.0", "2")),
    ("clamp-tensor", "torch.clamp({x}, {y})", True, ("None",)),
    ("maximum", "torch.maximum({x}, {y})", True, ("None",)),
    # ops the sim serves by a decomposition chosen on their first call
    ("aminmax", "torch.aminmax({x}, dim={dim}, keepdim={p})", True, ("True", "False")),
    ("aminmax-all", "torch.aminmax({x})", True, ("None",)),
    ("nansum", "torch.nansum({x}, dtype={p})", False, ("None", "torch.float64", "torch.int64")),
    ("hardshrink", "torch.nn.functional.hardshrink({x}, {p})", True, ("0.5", "0", "1.5", "-1")),
    ("logaddexp", "torch.logaddexp({x}, {y})", False, ("None",)),
    ("floor_divide-tensor", "torch.floor_divide({x}, {y})", True, ("None",)),
    ("threshold-int", "torch.nn.functional.threshold({x}, {p}, 7)", True,
     ("0", "-0.5", "1.7", "True", "float('inf')")),
)
# ops whose CPU kernel sums float16/bfloat16 in that dtype over a non-contiguous input (and
# in float32 over a contiguous one, as CUDA's and the sim's do always): their sequences
# draw such inputs contiguous (docs/fuzzing.md, known.TOLERATED)
HALF_STRIDED_ACCUMULATION = ("nansum",)
# ops whose CPU backward crashes the process on an input without elements (PyTorch's
# `_pdist_backward` CPU kernel segfaults on one; the generator runs every step on the CPU
# as it draws it): their sequences draw no backward of such a call
NO_EMPTY_BACKWARD = ("pdist",)
SEQ_DTYPES = (torch.float32, torch.float32, torch.float64, torch.float16, torch.bfloat16,
              torch.int64, torch.int32, torch.uint8, torch.int8, torch.bool, torch.complex64)
SEQ_SHAPES = ((3, 4), (4,), (), (2, 3), (1, 5), (0, 3), (2, 2, 2), (5, 1))


def cpu_operand_ok(name: str, template: str) -> bool:
    """May a sequence step of ``name`` (``op`` or ``op-variant``: :data:`SEQ_OPS`) take a
    0-dim CPU tensor as ``{x}``? Not reshaped (then it is no longer a scalar operand: CUDA
    refuses it), nor beside a device operand where CUDA's registration of the op compares
    the devices (it raises there, where the CPU computes)."""
    return ".reshape" not in template and not (
        "{y}" in template and cuda_checks_devices(name.split("-")[0]))


class LayoutSteps(Draw):
    """Steps on sparse and quantized tensors, and same-op sequences with varied arguments."""

    def _sparse_expr(self, layout: str, shape: tuple[int, int], dtype: torch.dtype) -> str:
        if layout == "coo-uncoalesced":  # duplicate indices, out of order
            r, c = shape
            idx = [[r - 1, 0, r - 1, 0], [c - 1, 0, c - 1, c - 1]]
            vals = f"mk((4,), {dt(dtype)}, {self.seed_()}).to(dev)"
            return (f"torch.sparse_coo_tensor(torch.tensor({idx!r}, device=dev), {vals}, "
                    f"{shape!r})")
        dense = (f"(mk({shape!r}, {dt(dtype)}, {self.seed_()}) * "
                 f"mk({shape!r}, torch.bool, {self.seed_()})).to(dev)")
        to = {"coo": ".to_sparse()", "csr": ".to_sparse_csr()",
              "csc": ".to_sparse(layout=torch.sparse_csc)"}[layout]
        return dense + to

    def sparse(self) -> Step | None:
        """A sparse tensor on the device (COO, uncoalesced COO, CSR, CSC) and 1-3 ops on it."""
        layout = self.rng.choice(SPARSE_LAYOUTS)
        shape = (self.rng.randint(1, 4), self.rng.randint(1, 4))
        dtype = self.rng.choice((torch.float32, torch.float32, torch.float64, torch.int64,
                                 torch.float16, torch.complex64, torch.bool))
        s, d, e = self.name("s"), self.name("d"), self.name("e")
        code = [f"{s} = {self._sparse_expr(layout, shape, dtype)}",
                f"{d} = mk(({shape[1]}, 3), {dt(dtype)}, {self.seed_()}).to(dev)",
                f"{e} = mk({shape!r}, {dt(dtype)}, {self.seed_()}).to(dev)"]
        keep, exact, ops = [s], True, []
        for _ in range(self.rng.randint(1, 3)):
            op, template, ex = self.rng.choice(SPARSE_OPS)
            n = self.name("r")
            code.append(f"{n} = {template.format(s=s, d=d, e=e)}")
            keep.append(n)
            ops.append(op)
            exact = exact and ex
        self.subject = dtype
        return Step(f"sparse:{layout}:{'+'.join(ops)}", code, keep, exact=exact)

    def quantized(self) -> Step | None:
        """A per-tensor quantized tensor on the device and 1-3 ops on it."""
        qd = self.rng.choice(QDTYPES)
        shape = self.rng.choice(((4,), (2, 3), (3, 4), (1,), (0,), (2, 2, 2)))
        scale = self.rng.choice(("0.1", "0.5", "1e-3", "2.0"))
        zp = {torch.quint8: self.rng.choice(("0", "3", "128")),
              torch.qint8: self.rng.choice(("0", "-3")), torch.qint32: "0"}[qd]
        q, q2 = self.name("q"), self.name("q")
        src = self.rng.choice(("dev", "dev", "cpu"))  # quantized on the device, or moved there
        x = f"mk({shape!r}, torch.float32, {self.seed_()})"
        if src == "dev":
            make = f"torch.quantize_per_tensor({x}.to(dev), {scale}, {zp}, {dt(qd)})"
        else:
            make = f"torch.quantize_per_tensor({x}, {scale}, {zp}, {dt(qd)}).to(dev)"
        code = [f"{q} = {make}",
                f"{q2} = torch.quantize_per_tensor(mk({shape!r}, torch.float32, "
                f"{self.seed_()}).to(dev), {scale}, {zp}, {dt(qd)})"]
        keep, ops = [q], []
        for _ in range(self.rng.randint(1, 3)):
            op, template, _ex = self.rng.choice(QUANT_OPS)
            n = self.name("r")
            code.append(f"{n} = {template.format(q=q, q2=q2, qd=dt(qd))}")
            keep.append(n)
            ops.append(op)
        self.subject = qd
        return Step(f"quant:{src}:{'+'.join(ops)}", code, keep)

    def _seq_operand(self, dtype: torch.dtype, shape: tuple[int, ...],
                     cpu0dim: bool = True, strided: bool = True) -> tuple[str, str]:
        """A fresh operand of ``dtype`` and ``shape`` in a drawn layout, and the layout;
        ``cpu0dim``: a 0-dim one may be a CPU tensor; ``strided``: a non-contiguous one."""
        base = f"mk({shape!r}, {dt(dtype)}, {self.seed_()}).to(dev)"
        kinds = ["contiguous", "contiguous", "requires_grad", "requires_grad", "transposed",
                 "step-slice", "expanded", "cpu0dim"]
        kind = self.rng.choice(kinds)
        if not strided and kind in ("transposed", "step-slice", "expanded"):
            kind = "contiguous"
        if kind == "requires_grad" and (dtype.is_floating_point or dtype.is_complex):
            return f"{base}.requires_grad_(True)", kind
        if kind == "transposed" and len(shape) >= 2:
            return f"mk({shape[::-1]!r}, {dt(dtype)}, {self.seed_()}).to(dev).mT", kind
        if kind == "step-slice" and len(shape) >= 1:
            big = (shape[0] * 2, *shape[1:])
            return f"mk({big!r}, {dt(dtype)}, {self.seed_()}).to(dev)[::2]", kind
        if kind == "expanded" and len(shape) >= 1:
            return (f"mk({shape[1:]!r}, {dt(dtype)}, {self.seed_()}).to(dev)"
                    f".expand({shape!r})"), kind
        if kind == "cpu0dim" and shape == () and cpu0dim:  # a 0-dim CPU tensor as the op's first operand
            return f"mk((), {dt(dtype)}, {self.seed_()})", kind
        return base, "contiguous"

    def sequence(self) -> Step | None:
        """2-5 calls of one op, each with other arguments (dtype, shape, layout, scalar,
        requires_grad), each its own step; the first call may be one the op refuses."""
        name, template, exact, params = self.rng.choice(SEQ_OPS)
        dtype = self.rng.choice(SEQ_DTYPES)
        shape = self.rng.choice(SEQ_SHAPES)
        tag = f"seq:{name}"
        if self.exclude(tag):
            return None
        for i in range(self.rng.randint(2, 5)):
            r = self.rng.random()
            # what changes from the previous call: the scalar (always drawn), and now and
            # then the dtype, the shape
            if i and r < 0.4:
                dtype = self.rng.choice(SEQ_DTYPES)
            elif i and r < 0.6:
                shape = self.rng.choice(SEQ_SHAPES)
            half = dtype in (torch.float16, torch.bfloat16)
            cpu_ok = cpu_operand_ok(name, template)
            x, layout = self._seq_operand(dtype, shape, cpu_ok,
                                          not (half and name in HALF_STRIDED_ACCUMULATION))
            y_dtype = dtype if self.rng.random() < 0.8 else self.rng.choice(FLOATS + INTS)
            y = f"mk({shape!r}, {dt(y_dtype)}, {self.seed_()}).to(dev)"
            p = self.rng.choice(params)
            dim = self.rng.randrange(-len(shape), len(shape)) if shape else 0
            n, code = self.name(), []
            if layout == "requires_grad":  # named, for its gradient
                leaf = self.name("x")
                code, x = [f"{leaf} = {x}"], leaf
            code.append(f"{n} = {template.format(x=x, y=y, p=p, dim=dim)}")
            where = {n: "dev"} if layout != "cpu0dim" else {}
            suffix = "@" + str(dtype).removeprefix("torch.")
            ok = self.emit(Step(f"{tag}{suffix}", code, [n], exact=exact, on=where))
            empty = any(d == 0 for d in shape)
            if ok and layout == "requires_grad" and not (empty and name in NO_EMPTY_BACKWARD):
                # and the backward of the call
                g = self.name("g")
                self.emit(Step(f"{tag}:grad{suffix}", [
                    f"r = {n} if isinstance({n}, torch.Tensor) else {n}[0]",
                    f"{g} = torch.autograd.grad(r.abs().sum(), {x})[0] if r.requires_grad "
                    f"else None"], [g], exact=False))
        return None  # every call emitted here
