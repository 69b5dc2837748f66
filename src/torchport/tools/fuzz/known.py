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
    # from the list of bugs known when the fuzzer was written; the fuzzer reproduces these
    KnownOpen("copysign-scalar", ("copysign:scalar@*",), ALL_MODES,
              "torch.copysign(t, 2.0) raises RuntimeError on sim (a Python number as other)",
              ("copysign_scalar.py",)),
    KnownOpen("shift-scalar", ("shift:scalar@*",), ALL_MODES,
              "bitwise_left_shift(t, 1), 1 << t, t >> 2 raise RuntimeError on sim (a Python "
              "number operand); where the CPU raises NotImplementedError (float) sim raises "
              "RuntimeError", ("shift_scalar.py",)),
    KnownOpen("index_fill-negative", ("index_fill:negative@*",), ALL_MODES,
              "t.index_fill_(dim, negative index, v) raises IndexError on sim (the CPU wraps "
              "it)", ("index_fill_negative.py",)),
    KnownOpen("copy-pyscalar", ("copy:pyscalar@*",), DEVICE_MODES,
              "t.copy_(python number) raises AttributeError 'int' object has no attribute "
              "'device' in device-only memory and with async streams",
              ("copy_pyscalar.py",)),
    KnownOpen("out-cpu0dim", ("out:cpu0dim@*",), ALL_MODES,
              "a 0-dim CPU tensor as out= with device inputs is accepted on sim (CUDA raises "
              "RuntimeError); in default mode the write can crash the process (SIGSEGV)",
              ("out_cpu0dim.py", "out_cpu0dim_crash.py")),
    KnownOpen("histc-int", ("reduce:histc*@*int*",), ALL_MODES,
              "torch.histc on integer tensors: the CPU raises (NotImplementedError; uint8: "
              "RuntimeError), sim returns a value", ("histc_int.py",)),
    KnownOpen("hardshrink-complex", ("unary:hardshrink@complex*",), ALL_MODES,
              "hardshrink on complex: the CPU raises NotImplementedError, sim returns a value",
              ("hardshrink_complex.py",)),
    KnownOpen("nansum-complex", ("reduce:nansum*@complex*",), ALL_MODES,
              "nansum on complex: the CPU raises RuntimeError, sim returns a value",
              ("nansum_complex.py",)),
    KnownOpen("batchnorm-async", ("module:BatchNorm2d+*",), ("async",),
              "BatchNorm2d training (SGD with or without momentum, Adam) raises "
              "AttributeError 'NoneType' object has no attribute 'shape' with async streams",
              ("batchnorm_async.py",)),
    # found by the fuzzer
    KnownOpen("hardshrink-int", ("unary:hardshrink@*int*",), ALL_MODES,
              "hardshrink on integer tensors: the CPU (and CUDA) raise NotImplementedError "
              "('hardshrink_cpu' not implemented for 'Long'), sim returns a value",
              ("hardshrink_int.py",)),
    KnownOpen("logaddexp-int", ("logaddexp:*@*int*", "logaddexp:*@bool"), ALL_MODES,
              "logaddexp on integer tensors: the CPU (and CUDA) raise NotImplementedError, "
              "sim returns a value (bool: raises RuntimeError)", ("logaddexp_int.py",)),
    # known, not reproduced by the fuzzer at this commit (no corpus script: the tags keep
    # them out of the fixed-seed run until a repro shows they are fixed or still open)
    KnownOpen("logaddexp-cpu0dim", ("logaddexp:cpu0dim@*",), ALL_MODES,
              "torch.logaddexp(t, 0-dim CPU tensor) raises on sim (CUDA accepts CPU scalars)"),
    KnownOpen("heaviside-cpu0dim", ("heaviside:cpu0dim@*",), ALL_MODES,
              "torch.heaviside(t, 0-dim CPU tensor) raises on sim (CUDA accepts CPU scalars)"),
    KnownOpen("mode-1d", ("mode:1d-lastdim@*",), ALL_MODES,
              "torch.mode of a 1-d tensor over dim=-1 differs on sim"),
    KnownOpen("to-dtype-expanded", ("to-dtype:expanded@*",), DEVICE_MODES,
              ".to(dtype) of an expanded tensor: contiguous strides, not the CPU's"),
    KnownOpen("resize", ("resize@*",), DEVICE_MODES,
              "resize_ gives other shapes/strides than the CPU's"),
    KnownOpen("softshrink-one", ("softshrink:one-element@*",), ALL_MODES,
              "softshrink of a one-element tensor differs on sim"),
    KnownOpen("rshift-half", ("shift:*@float16",), ALL_MODES,
              ">> on Half: the CPU raises, sim raises another type or returns a value"),
    KnownOpen("del-at-exit", (), ALL_MODES,
              "device ops in __del__ at interpreter exit fail (not generated: a program "
              "never exits its worker)"),
)


def known_open(tag: str, mode: str) -> KnownOpen | None:
    """The entry explaining a difference on a step tagged ``tag`` in ``mode``, if any."""
    for entry in KNOWN_OPEN:
        if entry.matches(tag, mode):
            return entry
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
    ("random numbers", "compared bit for bit: the sim generator gives a CPU generator's "
     "numbers (docs/streams-rng-amp.md; tests/test_rng.py)"),
)


def classify(diff: dict[str, Any]) -> str:
    """A difference's class: ``kind [tag] error-types``; the unit of counting and of
    minimisation."""
    err = f" {diff['error']}" if diff.get("error") else ""
    return f"{diff['kind']} [{diff['tag']}]{err}"
