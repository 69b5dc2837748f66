"""What the conformance run covers and what it knows: the OpInfos and dtypes of the
representative subset, ``op_db`` loaded and selected, the failures with a known cause
(``KNOWN``) and the random ops checked by their properties (``PROPERTIES``)."""

from __future__ import annotations

import re
import sys
import types
import unittest
from collections.abc import Sequence
from typing import Any

PROG = "python -m torchport.tools.conformance"
DEFAULT_DTYPES = ("float32", "float64", "int64", "bool", "bfloat16", "float16", "complex64")
GRAD_DTYPES = ("float32", "float64")

# A representative subset (OpInfo names, regex): elementwise, reductions, linear
# algebra, convolution, indexing, shape ops, losses, random and factory ops, and ops
# that reach the decomposition and fallback paths.
SUBSET = (
    r"add|mul|div|sub|abs|exp|log1p|sigmoid|tanh|clamp|where|pow|remainder|logaddexp|"
    r"hypot|atan2|lerp|nan_to_num|sum|mean|amax|argmax|std|var|prod|cumsum|logsumexp|"
    r"sort|topk|matmul|mm|bmm|addmm|linalg\.vector_norm|nn\.functional\.conv2d|"
    r"nn\.functional\.linear|softmax|log_softmax|nn\.functional\.layer_norm|"
    r"nn\.functional\.gelu|nn\.functional\.relu|nn\.functional\.hardshrink|"
    r"nn\.functional\.embedding|nn\.functional\.cross_entropy|nn\.functional\.mse_loss|"
    r"nn\.functional\.max_pool2d|nn\.functional\.pad|index_select|index_put|gather|"
    r"scatter_add|masked_fill|masked_select|nonzero|cat|stack|flip|roll|tril|"
    r"repeat|expand|permute|transpose|view|reshape|narrow|squeeze|unfold|diagonal|"
    r"special\.entr|special\.bessel_j0|kthvalue|logcumsumexp|fft\.fft|"
    r"zeros_like|full|arange|linspace|eye|rand_like|randn|bernoulli|"
    r"nn\.functional\.dropout|empty_like"
)
SUBSET_DTYPES = ("float32", "float64", "int64", "bool", "bfloat16")
SUBSET_MAX_SAMPLES = 3
FULL_MAX_SAMPLES = 5  # --full's samples per OpInfo and dtype (--max-samples overrides)

# Failures with a known cause: (regex over "<OpInfo id>/<dtype>" for forward results,
# "<OpInfo id>/<dtype>/grad" for gradients, "<OpInfo id>/error" for a crash or timeout;
# kind; reason). Kinds "limitation" (the backend does not do this) and "difference"
# (a legitimate numerical difference) turn a failure into "known": still counted and
# listed with its reason, never a pass. Kind "bug" keeps the failure a failure and
# gives its diagnosis. A known entry only ever applies to a result that failed.
KNOWN: list[tuple[str, str, str]] = [
    (r"nn\.functional\.linear_cross_entropy\.chunked.*/(bfloat16|float16)(/grad)?",
     "difference",
     "PyTorch chooses the accumulation policy per device type (_AUTO_DEFAULTS in "
     "torch/nn/modules/linear_cross_entropy_options.py: fp32 'accurate' accumulation on "
     "cpu, 'compact' on any other device), so half-precision results differ by an ULP or two"),
]


# Random OpInfos checked by their properties where their results are random: a device draws
# from its own generator (CUDA's Philox, not the CPU's mt19937), so equality with the CPU's
# draws is no test, and shapes alone prove nothing. (regex over the OpInfo id, kind: a
# ``Runner._<kind>`` method, what it checks.)
PROPERTIES: list[tuple[str, str, str]] = [
    (r"nn\.functional\.dropout", "dropout",
     "in training with 0 < p < 1: each element 0 or x/(1-p), also native_dropout's output "
     "from its mask; the keep ratio of 8192 elements within 6 standard deviations of 1-p "
     "(at the sample's p and at 0.2); a seed reproduces the mask, the generator moves on "
     "between calls, set_rng_state replays; the gradient is the output's mask over 1-p. "
     "Eval, p=0 and p=1 are deterministic and compared with the CPU"),
]


def property_kind(op: Any) -> str | None:
    """The ``PROPERTIES`` kind of an OpInfo, or ``None``."""
    return next((k for pattern, k, _ in PROPERTIES if re.fullmatch(pattern, opinfo_id(op))),
                None)


# ---- loading op_db -----------------------------------------------------------
def _stub_expecttest() -> None:
    """op_db's module imports ``expecttest`` (a PyTorch test dependency) only for a base class."""
    try:
        import expecttest  # noqa: F401
    except ImportError:
        m = types.ModuleType("expecttest")
        m.TestCase = unittest.TestCase  # type: ignore[attr-defined]
        sys.modules["expecttest"] = m


def load_op_db() -> list[Any]:
    """PyTorch's OpInfo list (imported after the device is registered)."""
    _stub_expecttest()
    import torch.backends
    frozen = torch.backends.flags_frozen()
    from torch.testing._internal.common_methods_invocations import op_db
    if not frozen:  # PyTorch's test utilities freeze cudnn flags; leave the process as it was
        torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True
    return list(op_db)


def opinfo_id(op: Any) -> str:
    return op.name + ("." + op.variant_test_name if op.variant_test_name else "")


def select(op_db: Sequence[Any], pattern: str | None) -> list[Any]:
    """OpInfos whose id (``name`` or ``name.variant``) or name fully matches ``pattern``."""
    if not pattern:
        return list(op_db)
    rx = re.compile(pattern)
    return [op for op in op_db if rx.fullmatch(opinfo_id(op)) or rx.fullmatch(op.name)]


def known_cause(key: str) -> tuple[str, str] | None:
    """(kind, reason) of a failure ``"<id>/<dtype>[/grad]"`` or ``"<id>/error"``, if known."""
    for pattern, kind, reason in KNOWN:
        if re.fullmatch(pattern, key):
            return kind, reason
    return None


def apply_known(r: dict[str, Any]) -> dict[str, Any]:
    """Mark the failures of one OpInfo result with their known cause (see ``KNOWN``)."""
    for kind in ("dtypes", "grad"):
        for dt, v in r[kind].items():
            if v["status"] != "fail":
                continue
            cause = known_cause(f"{r['id']}/{dt}" + ("/grad" if kind == "grad" else ""))
            if cause is not None:
                v["known"] = {"kind": cause[0], "reason": cause[1]}
                if cause[0] != "bug":
                    v["status"] = "known"
    if r.get("error"):
        cause = known_cause(f"{r['id']}/error")
        if cause is not None:
            r["error_known"] = {"kind": cause[0], "reason": cause[1]}
    r["status"] = _overall(r)
    return r


def _overall(r: dict[str, Any]) -> str:
    if r.get("error") and r.get("error_known", {}).get("kind", "bug") == "bug":
        return "fail"
    sts = [v["status"] for v in (*r["dtypes"].values(), *r["grad"].values())]
    if "fail" in sts:
        return "fail"
    if "known" in sts or r.get("error"):
        return "known"
    return "pass" if "pass" in sts else "skip"
