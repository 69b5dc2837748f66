"""What the fuzzer draws from: the dtypes, the shapes, and the tables of ops drawn by name.

Data only, apart from the families of steps that draw from it: the tables list the ops
written with one template (``torch.{op}(x)``, ``torch.{op}(x, other)``, ``x {op} other``),
those compared exactly apart from those compared with tolerances; an op with code of its own
stays beside its code in :mod:`.steps_memory`, :mod:`.steps_compute` or
:mod:`.steps_features`. The order of each table is part of what a seed draws: reordering one
changes the programs of every seed.
"""

from __future__ import annotations

import torch

FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
INTS = (torch.int64, torch.int32, torch.int8, torch.uint8)
ALL_DTYPES = FLOATS + (torch.complex64,) + INTS + (torch.bool,)
SHAPES = [(), (), (0,), (1,), (3,), (5,), (2, 3), (3, 4), (4, 1), (1, 4), (2, 0, 3),
          (2, 3, 4), (3, 1, 2), (4, 4)]


def dt(d: torch.dtype) -> str:
    """The source text of a dtype: ``torch.float32``."""
    return str(d)



# elementwise ops of one operand: torch.{op}(x)
UNARY_EXACT = ("neg", "abs", "relu", "floor", "ceil", "round", "sign", "bitwise_not",
               "logical_not", "isnan", "square", "trunc", "frac", "sgn", "signbit",
               "nan_to_num", "isfinite", "positive", "conj_physical")
UNARY_CLOSE = ("exp", "log", "sqrt", "sin", "tanh", "sigmoid", "reciprocal", "erf", "expm1",
               "log1p", "rsqrt", "angle", "atan")
# torch.nn.functional.{op}(x); the piecewise-linear ones compare exactly
ACTIVATIONS = ("softshrink", "hardshrink", "gelu", "silu", "softplus", "elu", "leaky_relu",
               "hardtanh", "relu6", "mish")
ACTIVATIONS_EXACT = ("softshrink", "hardshrink", "hardtanh", "relu6")

# elementwise ops of two operands: torch.{op}(x, other), and Python's operators
BINARY_EXACT = ("add", "sub", "mul", "div", "remainder", "maximum", "minimum", "eq", "lt",
                "ge", "ne", "logical_and", "logical_xor", "bitwise_and", "bitwise_or",
                "bitwise_xor", "bitwise_left_shift", "bitwise_right_shift", "copysign",
                "heaviside", "fmod", "floor_divide", "fmax", "true_divide")
BINARY_CLOSE = ("logaddexp", "atan2", "pow", "hypot", "xlogy")
OPERATORS = ("+", "-", "*", "/", "//", "%", "**", "<<", ">>", "&", "|", "^", "==", "<")

# reductions: torch.{op}(x), torch.{op}(x, dim[, keepdim=...])
REDUCTIONS_EXACT = ("max", "min", "argmax", "argmin", "amax", "amin", "mode", "median", "all",
                    "any", "count_nonzero", "aminmax", "nanmedian", "sort", "topk", "histc")
REDUCTIONS_CLOSE = ("sum", "mean", "prod", "var", "std", "nansum", "cumsum", "logsumexp",
                    "cumprod", "norm")
# reductions whose CPU kernel (PyTorch 2.13's, over a dimension) returns values read from the
# wrong memory for floating inputs where the reduced dimension has stride 0 (an expanded
# tensor); the generator gives them such operands contiguous (docs/fuzzing.md; the device
# computes them right, tests/test_ops_device_routes.py)
ZERO_STRIDE_MEDIAN = ("median", "nanmedian")


def cuda_checks_devices(op: str) -> bool:
    """Does CUDA's registration of ``torch.<op>``'s tensor overload compare its operands'
    devices before the kernel (so a 0-dim CPU operand beside device tensors raises there,
    where the CPU computes)? ``torchport.ops.plan.cuda_checked_args`` reads it from
    torchgen's native_functions.yaml."""
    from torchport.ops.plan import cuda_checked_args, plan_for

    packet = getattr(torch.ops.aten, op, None)
    if packet is None:
        return False
    for name in ("Tensor", "default"):
        if name in packet.overloads():
            return bool(cuda_checked_args(plan_for(getattr(packet, name))))
    return False
