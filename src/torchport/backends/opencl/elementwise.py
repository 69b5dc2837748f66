"""The elementwise kernels: binary, ternary, logical, power and division ops, unary ops,
fills and copies, and dropout (a Philox counter-based generator on the device)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND as PROMOTE

import torchport
from torchport.backends.opencl.codegen import Context, _ctype, _operand
from torchport.ops import Decline, KernelSet


def register(ks: KernelSet, k: Context) -> None:
    """Declare the elementwise kernels on ``ks``."""
    runtime, L, dtypes = k.runtime, k.launcher, k.dtypes
    floats, promote, isfloat = k.floats, k.promote, k.isfloat

    # ---- binary ----
    def binary(name: str, expr: Callable[[torch.dtype], str],
               kind: PROMOTE = PROMOTE.DEFAULT) -> None:
        @ks.out_kernel(name, dtypes=dtypes)
        def kernel(self, other, *, out, alpha=1):
            ct = promote(kind, self, other)
            if name == "sub.out" and ct == torch.bool:
                raise Decline("bool subtraction: the CPU's error")
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
            if not isinstance(args[1], torch.Tensor) and args[1] == 0 and out.numel():
                # the CPU's check of a host divisor, in its kernel: an empty result has none
                raise RuntimeError("ZeroDivisionError")
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
    unary("abs.out", lambda ct: "fabs(a0)" if isfloat(ct) else "(a0 < 0 ? -a0 : a0)",
          only=tuple(dtypes - {torch.bool}))  # the CPU's and CUDA's abs refuse bool
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
        if not fits(value, ct):
            raise Decline("a fill value out of the dtype's range: the CPU's error")
        return L.elementwise(self, [], "s0", ct, [(ct, value)])

    def fits(value: Any, dtype: torch.dtype) -> bool:
        """Does ``value`` convert to ``dtype`` without overflow (the CPU's checked
        conversion of a fill value)?"""
        if dtype == torch.bool:
            return not isinstance(value, complex)
        if isinstance(value, complex):
            return False
        if dtype.is_floating_point:
            v = float(value)
            return math.isnan(v) or math.isinf(v) or abs(v) <= torch.finfo(dtype).max
        info = torch.iinfo(dtype)
        if isinstance(value, float) and not math.isfinite(value):
            return False
        return info.min <= value <= info.max

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
        if src.dtype == self.dtype and src.is_contiguous() and self.is_contiguous():
            raise Decline("one span of bytes: the runtime's buffer copy serves it")
        return L.elementwise(self, [src], "a0", src.dtype if src.dtype != torch.float16
                             else torch.float32)

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
        keep(out1, p1m)
        return L.elementwise(out0, [input, out1], "(a0 * (a1 ? 1 : 0)) * s0",
                             [input.dtype, torch.bool], [(input.dtype, scale)]), out1

    def keep(out: torch.Tensor, p: float) -> torch.Tensor:
        """``out[i] = 1`` where the first word of Philox4x32-10 at counter ``(i, 0)`` under a
        key drawn from the device's generator, as a 24-bit uniform, is below ``p``; else 0."""
        gen = torchport.current_backend().generators[out.device.index]  # as torch.ocl numbers them
        key = int(torch.empty((), dtype=torch.int64).random_(generator=gen))
        return L.elementwise(out, [], "k", out.dtype,
                             [(torch.float32, p), (torch.int64, key & 0xFFFFFFFF),
                              (torch.int64, key >> 32)],
                             pre="uchar k = philox_uniform(i, (uint)s1, (uint)s2) < s0;")

    @ks.kernel("bernoulli_.float", dtypes=floats)
    def bernoulli_(self, p=0.5, *, generator=None):
        """The draws of :func:`native_dropout`'s mask: in-place dropout
        (``F.dropout(x, inplace=True)``, PyTorch's ``bernoulli_`` then ``mul_``) keeps the
        elements the functional one keeps, from the same generator state."""
        if generator is not None:
            raise Decline("bernoulli_ with a generator argument: the fallback draws from it")
        if not 0 <= p <= 1:
            raise Decline("a probability out of [0, 1]: the CPU's error")
        return keep(self, p) if self.numel() else self
