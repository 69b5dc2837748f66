"""Random programs from a seed: a curated op table over a pool of tensors.

A program is a list of :class:`Step`\\ s, each a few lines of Python source under
``with rec.step(...)`` (see :mod:`.prelude`), so it prints as a standalone script. The
generator runs each step on the CPU as it writes it (the CPU is the oracle anyway): the pool
then holds real tensors, so later steps pick operands whose shapes and dtypes fit, and a step
that raised on the CPU adds nothing to the pool (it stays in the program: the device must
raise the same). Everything is drawn from ``random.Random(f"{seed}/{index}")``: one seed and
index, one program, in every process.

The pieces: the program model (:mod:`.program`), what is drawn from (:mod:`.catalog`), the
drawing state (:mod:`.draw`) and the families of steps (:mod:`.steps_memory`,
:mod:`.steps_compute`, :mod:`.steps_features`); this module draws the families in their
order and weights, and keeps the names the rest of the fuzzer imports.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from torchport.tools.fuzz.catalog import ALL_DTYPES, FLOATS, INTS, SHAPES, dt
from torchport.tools.fuzz.program import Program, Step, Var
from torchport.tools.fuzz.steps_compute import ComputeSteps
from torchport.tools.fuzz.steps_features import FeatureSteps
from torchport.tools.fuzz.steps_layouts import LayoutSteps
from torchport.tools.fuzz.steps_memory import MemorySteps

__all__ = ["ALL_DTYPES", "FLOATS", "INTS", "SHAPES", "Program", "Step", "Var", "dt", "generate"]


class _Gen(MemorySteps, ComputeSteps, FeatureSteps, LayoutSteps):
    """Builds one program, running each step on the CPU as it goes."""

    def build(self) -> Program:
        for _ in range(self.rng.randint(2, 4)):
            self.emit(self.create())
        kinds = [(self.create, 1.5), (self.view, 3), (self.inplace, 3), (self.unary, 3),
                 (self.binary, 4), (self.out, 2), (self.index, 3), (self.reduce, 3),
                 (self.linalg, 1.5), (self.autograd, 1.5), (self.module, 0.6),
                 (self.random, 1), (self.serialize, 0.7), (self.device1, 0.8),
                 (self.thread, 0.8), (self.resize, 0.7), (self.join, 1), (self.item, 1),
                 (self.copy, 1.2), (self.sparse, 0.8), (self.quantized, 0.8),
                 (self.sequence, 2)]
        fns, weights = zip(*kinds, strict=True)
        target, tries = self.rng.randint(5, 20), 0
        while len(self.steps) < target + 4 and tries < 200:
            tries += 1
            self.subject = None
            step = self.rng.choices(fns, weights)[0]()
            if step is not None and self.subject is not None and "@" not in step.tag:
                step.tag += "@" + str(self.subject).removeprefix("torch.")
            if step is None or self.exclude(step.tag):
                continue
            self.emit(step)
        self.final()
        return Program(self.seed, self.number, self.steps)

    def final(self) -> None:
        """Every pool tensor at the end: views and bases written through each other."""
        live = [v for v in self.pool if isinstance(self.ns.get(v.name), torch.Tensor)]
        if live:
            names = [v.name for v in live]
            self.emit(Step("final", [], names, exact=False, strides=self.promised(names)))


def generate(seed: int, index: int, exclude: Callable[[str], bool] = lambda tag: False
             ) -> Program:
    """Program ``index`` of ``seed``; steps whose tag ``exclude`` accepts are not drawn."""
    return _Gen(seed, index, exclude).build()
