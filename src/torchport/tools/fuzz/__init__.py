"""A differential fuzzer: random programs on the CPU and on the device, compared.

The CPU is the oracle. :mod:`.generator` draws programs from a seed (a curated op table:
views, in-place writes through aliases, out=, indexing, reductions, linear algebra,
autograd, modules with optimizers, RNG, serialization, a second device, threads), each a
list of source steps; :mod:`.runner` runs each in worker processes, the CPU and each sim
mode (default, strict, async); :mod:`.prelude` records a trace per step and compares them;
:mod:`.known` says which differences are known open bugs or tolerated; :mod:`.minimise`
shrinks a failing program into a standalone repro script. ``python -m torchport.tools.fuzz``
(:mod:`.cli`) does all of it; docs/fuzzing.md describes it.

Nothing here is imported by the rest of torchport; importing this package loads no device.
"""

from torchport.tools.fuzz.generator import Program, Step, generate
from torchport.tools.fuzz.known import KNOWN_OPEN, TOLERATED, KnownOpen, known_open
from torchport.tools.fuzz.prelude import check, compare_traces

__all__ = ["KNOWN_OPEN", "TOLERATED", "KnownOpen", "Program", "Step", "check",
           "compare_traces", "generate", "known_open"]
