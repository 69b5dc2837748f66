"""Known open device bugs, and the differences the fuzzer tolerates.

:data:`KNOWN_OPEN` lists device bugs found and not yet fixed: a difference on a step whose
tag matches an entry, in a mode the entry names, is reported as that entry (``known-open``),
not as an unexplained difference; the fixed-seed test run generates no such steps. Each
entry names the corpus script that reproduces it (``tests/fuzz_corpus/``), which
``tests/test_fuzz_corpus.py`` expects to fail (strict xfail) in the entry's modes: when a
fix lands, that test fails and says to delete the entry, so the list only shrinks.

:data:`TOLERATED` documents what the comparison leaves out on purpose, each with PyTorch's
reason (docs/fuzzing.md has the same table).
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

ALL_MODES = ("default", "strict", "async")
DEVICE_MODES = ("strict", "async")


@dataclass(frozen=True)
class KnownOpen:
    """An open device bug: the step tags it shows on (``fnmatch`` patterns), the modes it
    fails in, the symptom, and its repros in ``tests/fuzz_corpus/`` (none: not reproduced)."""

    id: str
    tags: tuple[str, ...]
    modes: tuple[str, ...]
    symptom: str
    corpus: tuple[str, ...] = ()

    def matches(self, tag: str, mode: str) -> bool:
        return mode in self.modes and any(fnmatchcase(tag, p) for p in self.tags)


KNOWN_OPEN: tuple[KnownOpen, ...] = (
    # none open: every bug the fuzzer found has been fixed; its repro stays in the corpus
    # (tests/fuzz_corpus/) as a regression test. A new one: an entry here, its repro there.
)


def known_open(tag: str, mode: str) -> KnownOpen | None:
    """The entry explaining a difference on a step tagged ``tag`` in ``mode``, if any."""
    for entry in KNOWN_OPEN:
        if entry.matches(tag, mode):
            return entry
    return None


# Differences a backend with kernels of its own (``--backend``) shows by design, not bugs:
# (id, tag patterns of the differing step, tag patterns one of the steps before it must
# have, or () for none, why). Value differences only; sim compares bit for bit and has none.
BACKEND_EXPLAINED: tuple[tuple[str, tuple[str, ...], tuple[str, ...], str], ...] = (
    ("adam-normalises-rounding", ("module:*Norm*+Adam*",), (),
     "a normalisation layer's bias gradient under a loss of its normalised output is zero in "
     "exact arithmetic, so both sides hold rounding noise, which Adam divides by its own "
     "magnitude: the first step moves the bias by about lr either way"),
    ("own-generator-draws", ("rng:dropout*", "rng:bernoulli*"), (),
     "a backend that draws dropout masks with a generator of its own (OpenCL's Philox "
     "kernels, as CUDA's) keeps other elements than the CPU from the same seed; the "
     "conformance runner checks such draws by their properties (PROPERTIES)"),
    ("failed-op-writes", ("*",), ("index:index_add_*", "index:index_copy_*", "index:scatter*",
                                  "index:index_put*"),
     "an indexing op that raised on an out-of-range index: the CPU's kernel writes the "
     "elements before the bad index first, a device's fallback computes on a copy and "
     "writes nothing; PyTorch promises no state after a failed op (CUDA reports it later, "
     "as a device-side assert)"),
)


def backend_explained(diff: dict[str, Any], tags: list[str]) -> str | None:
    """The :data:`BACKEND_EXPLAINED` id of a value difference on step ``diff["k"]`` of a
    program whose step tags are ``tags``, if one explains it."""
    if diff.get("kind") != "value":
        return None
    before = tags[:max(diff.get("k", 0), 0)]
    for eid, where, after, _ in BACKEND_EXPLAINED:
        if any(fnmatchcase(diff["tag"], p) for p in where) and (
                not after or any(fnmatchcase(t, p) for t in before for p in after)):
            return eid
    return None


def excluder(mode: str | None = None):  # noqa: ANN201 - a predicate on tags
    """A predicate for :func:`.generator.generate`: tags of entries open in ``mode`` (any
    mode when None), so that a run with them excluded must find no difference."""
    def exclude(tag: str) -> bool:
        return any(any(fnmatchcase(tag, p) for p in e.tags)
                   and (mode is None or mode in e.modes) for e in KNOWN_OPEN)
    return exclude


# What the comparison leaves out, and why (PyTorch's reason). docs/fuzzing.md shows it.
TOLERATED: tuple[tuple[str, str], ...] = (
    ("torchport's own warnings (FallbackWarning, NativeCodeWarning, PinnedMemoryWarning)",
     "not PyTorch's: CUDA has no such warnings; every other warning must match in category "
     "and message (device names replaced)"),
    ("error messages", "only the exception class is compared: messages name devices, and "
     "CUDA's own messages differ from the CPU's"),
    ("strides of non-view results", "PyTorch promises strides only for views, `.to`/`clone`/"
     "`contiguous` (preserve_format keeps a non-overlapping dense input's strides), "
     "serialization and resize_; elementwise/reduction outputs' strides are a kernel's "
     "choice (CUDA's differ too)"),
    ("floating values of reductions, linear algebra, transcendental ops, autograd, "
     "optimizers", "compared with torch.testing.assert_close's default tolerances "
     "(equal_nan): summation order and vectorisation are the kernel's; elementwise "
     "exactly-rounded ops, integers and bool compare exactly"),
    ("out= on a CPU tensor (0-dim or not) with device inputs",
     "the CPU accepts it (all on the CPU); CUDA raises RuntimeError (out= must be on the "
     "inputs' device; only inputs may be 0-dim CPU tensors): the device must raise "
     "RuntimeError"),
    ("a CPU tensor with elements as an operand beside a device tensor",
     "CUDA raises RuntimeError (\"Expected all tensors to be on the same device\"): the device "
     "must raise RuntimeError"),
    ("one-element strides", "the stride of a size-1 or empty tensor is not meaningful "
     "(is_contiguous ignores it): compared only when the tensor has 2+ elements"),
    ("integer histc", "CUDA's kernel (SummaryOps.cu) takes integer dtypes, the CPU's is "
     "floating-only: where the CPU raises, the device computes (CUDA's values; "
     "prelude.CUDA_COMPUTES)"),
    ("nansum of float16/bfloat16 over a non-contiguous input", "the CPU kernel sums in the "
     "input's dtype there (in float32 over a contiguous one), CUDA's in float32 always: "
     "several ulps apart, past the tolerances; the sequences draw such inputs contiguous "
     "(steps_layouts.HALF_STRIDED_ACCUMULATION)"),
    ("median/nanmedian over a dimension of stride 0", "PyTorch's CPU kernel (2.13) returns "
     "values read from the wrong memory for a floating input whose reduced dimension is "
     "expanded (stride 0, size 2+), different from call to call: the CPU has no answer to "
     "compare with (the device gives the kernel a contiguous copy, "
     "ops/device_routes.py); the generator gives such operands contiguous "
     "(catalog.ZERO_STRIDE_MEDIAN)"),
    ("random numbers", "compared bit for bit: the sim generator gives a CPU generator's "
     "numbers (docs/streams-rng-amp.md; tests/test_rng.py)"),
)


def classify(diff: dict[str, Any]) -> str:
    """A difference's class: ``kind [tag] error-types``; the unit of counting and of
    minimisation."""
    err = f" {diff['error']}" if diff.get("error") else ""
    return f"{diff['kind']} [{diff['tag']}]{err}"
