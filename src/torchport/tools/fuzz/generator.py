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

import random
from collections.abc import Callable

import torch

from torchport.tools.fuzz.catalog import ALL_DTYPES, FLOATS, INTS, SHAPES, dt
from torchport.tools.fuzz.program import Program, Step, Var
from torchport.tools.fuzz.steps_compute import ComputeSteps
from torchport.tools.fuzz.steps_features import FeatureSteps
from torchport.tools.fuzz.steps_layouts import LayoutSteps
from torchport.tools.fuzz.steps_memory import MemorySteps

__all__ = ["ALL_DTYPES", "FLOATS", "INTS", "SHAPES", "Program", "Step", "Var", "dt", "generate"]


# Ops whose result's layout follows the input's memory format, by input rank: (name, call
# of {x} (channels {c}) giving two results, exact). ``max_pool1d`` by its general path, as
# every device but the CPU (whose no-grad fast path is contiguous) computes it.
_F = "torch.nn.functional"
LAYOUT_FOLLOWING = {
    3: (("max_pool1d", _F + ".max_pool1d_with_indices({x}, 2)", True),
        ("avg_pool1d", _F + ".avg_pool1d({x}, 2), None", True),
        ("adaptive_max_pool1d", _F + ".adaptive_max_pool1d({x}, 4, True)", True),
        ("adaptive_avg_pool1d", _F + ".adaptive_avg_pool1d({x}, 4), None", True),
        ("upsample_nearest1d", _F + ".interpolate({x}, scale_factor=2), None", True),
        ("upsample_linear1d", _F + ".interpolate({x}, scale_factor=2, mode='linear'), None",
         False),
        ("reflection_pad1d", _F + ".pad({x}, (1, 2), mode='reflect'), None", True)),
    4: (("max_pool2d", _F + ".max_pool2d({x}, 2, return_indices=True)", True),
        ("avg_pool2d", _F + ".avg_pool2d({x}, 3, 2, 1), None", True),
        ("adaptive_max_pool2d", _F + ".adaptive_max_pool2d({x}, 4, True)", True),
        ("adaptive_avg_pool2d", _F + ".adaptive_avg_pool2d({x}, 4), None", True),
        ("upsample_nearest2d", _F + ".interpolate({x}, scale_factor=2), None", True),
        ("upsample_bilinear2d", _F + ".interpolate({x}, scale_factor=2, mode='bilinear'), None",
         False),
        ("conv2d", _F + ".conv2d({x}, torch.ones(2, {c}, 2, 2, dtype={x}.dtype, device=dev)), None",
         False),
        ("batch_norm", _F + ".batch_norm({x}, None, None, training=True), None", False)),
    5: (("max_pool3d", _F + ".max_pool3d({x}, 2, return_indices=True)", True),
        ("avg_pool3d", _F + ".avg_pool3d({x}, 2), None", True),
        ("adaptive_avg_pool3d", _F + ".adaptive_avg_pool3d({x}, 3), None", True),
        ("upsample_trilinear3d",
         _F + ".interpolate({x}, scale_factor=2, mode='trilinear'), None", False)),
}


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
        self.layout_following_steps()
        self.final()
        return Program(self.seed, self.number, self.steps)

    def layout_following_steps(self) -> None:
        """Up to two :meth:`layout_following` steps, drawn from a random stream of their
        own: the other families' draws stay those of the same seed without them."""
        rng = random.Random(f"{self.seed}/{self.number}/layout-following")
        for _ in range(rng.choice([0, 1, 1, 2])):
            step = self.layout_following(rng)
            if not self.exclude(step.tag):
                self.emit(step)

    def layout_following(self, rng: random.Random) -> Step:
        """An op whose result's layout follows its input's memory format (pooling,
        upsampling, convolution, normalisation) on a transposed, channels-last or otherwise
        permuted input: strides compared, as PyTorch promises them."""
        nd = rng.choice([3, 4, 5])
        shape = {3: (3, 5, 6), 4: (2, 3, 6, 6), 5: (2, 3, 4, 4, 4)}[nd]
        op, template, exact = rng.choice(LAYOUT_FOLLOWING[nd])
        perm = [0, *rng.sample(range(1, nd), nd - 1)]
        if rng.random() < 0.3:  # now and then batch and channels swapped too
            perm[0], perm[1] = perm[1], perm[0]
        inverse = [perm.index(i) for i in range(nd)]
        x, r, i = self.name("x"), self.name(), self.name()
        dtype = rng.choice(FLOATS)
        made = f"mk({tuple(shape[p] for p in perm)!r}, {dt(dtype)}, {rng.randrange(10**6)})"
        code = [f"{x} = {made}.to(dev).permute({inverse})",
                f"{r}, {i} = " + template.format(x=x, c=shape[1])]
        return Step(f"layout-follow:{op}@{str(dtype).removeprefix('torch.')}", code, [r, i],
                    exact=exact, strides=(r, i))

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
