"""The state of one program being drawn: its random generator, its pool of tensors run on the
CPU, and the helpers every family of steps draws with (operands that fit, fresh tensors,
scalars, names) and :meth:`Draw.emit`, which runs a step on the CPU as it is written.

Apart from the families of steps (:mod:`.steps_memory`, :mod:`.steps_compute`,
:mod:`.steps_features`), which subclass :class:`Draw`, and from the order they are drawn in
(:mod:`.generator`): every family shares this state, and only the generator knows them all.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch

from torchport.tools.fuzz import prelude
from torchport.tools.fuzz.catalog import ALL_DTYPES, INTS, dt
from torchport.tools.fuzz.program import Step, Var


class Draw:
    """One program being drawn: its steps so far, and their tensors run on the CPU."""

    def __init__(self, seed: int, index: int, exclude: Callable[[str], bool]) -> None:
        self.rng = random.Random(f"{seed}/{index}")
        self.seed, self.number, self.exclude = seed, index, exclude
        self.rec = prelude.Recorder("cpu", "cpu")
        self.ns: dict[str, Any] = {k: getattr(prelude, k) for k in dir(prelude)
                                   if not k.startswith("__")}
        self.ns.update(dev="cpu", dev1="cpu", rec=self.rec, torch=torch)
        self.pool: list[Var] = []
        self.steps: list[Step] = []
        self.counter = 0
        self.subject: torch.dtype | None = None  # the dtype of the step's first operand

    # ---- helpers ----
    def name(self, prefix: str = "t") -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def t(self, v: Var) -> torch.Tensor:
        return self.ns[v.name]

    def pick(self, pred: Callable[[torch.Tensor], bool] = lambda t: True,
             prefer_views: bool = False) -> Var | None:
        cands = [v for v in self.pool if isinstance(self.ns.get(v.name), torch.Tensor)
                 and pred(self.ns[v.name])]
        if prefer_views and self.rng.random() < 0.6:
            views = [v for v in cands if v.base]
            cands = views or cands
        v = self.rng.choice(cands) if cands else None
        if v is not None and self.subject is None:
            self.subject = self.t(v).dtype
        return v

    def seed_(self) -> int:
        return self.rng.randrange(10**6)

    def fresh(self, shape: tuple[int, ...], dtype: torch.dtype, on: str = "dev") -> str:
        expr = f"mk({tuple(shape)!r}, {dt(dtype)}, {self.seed_()})"
        return expr if on == "cpu" else f"{expr}.to({on})"

    def dtype(self, allowed: tuple[torch.dtype, ...] = ALL_DTYPES) -> torch.dtype:
        if self.rng.random() < 0.1:  # now and then one the op may refuse: same error?
            return self.rng.choice(ALL_DTYPES)
        return self.rng.choice(allowed)

    def scalar(self, dtype: torch.dtype) -> str:
        if dtype == torch.bool:
            return self.rng.choice(["True", "False", "1"])
        if dtype in INTS:
            return self.rng.choice(["2", "3", "1", "-1" if dtype != torch.uint8 else "5"])
        if dtype.is_complex and self.rng.random() < 0.3:
            return "(1.5-2j)"
        return self.rng.choice(["2.5", "-0.5", "2", "0.0", "3"])

    def peek(self, expr: str) -> Any:
        """``expr`` evaluated on the CPU pool, or None where it raises."""
        try:
            return eval(expr, self.ns)  # noqa: S307 - our own generated text
        except Exception:  # noqa: BLE001
            return None

    def keep_with_base(self, v: Var) -> list[str]:
        names = [v.name]
        if v.base and v.base in self.ns and v.base != v.name:
            names.append(v.base)
        return names

    def promised(self, names: list[str]) -> tuple[str, ...]:
        by = {v.name: v for v in self.pool}
        return tuple(n for n in names if n in by and by[n].promised)

    # ---- running ----
    def emit(self, step: Step) -> bool:
        """Append ``step`` and run it on the CPU; whether it succeeded there."""
        k = len(self.steps)
        self.steps.append(step)
        try:
            exec(step.render(k), self.ns)  # noqa: S102 - our own generated text
        except Exception:  # noqa: BLE001 - outside the step's block: keep the program
            self.steps.pop()
            return False
        ok = self.rec.steps[-1]["error"] is None
        if ok and not step.expect:
            self.pool.extend(step.new)
        elif step.expect:  # the device raises: nothing it made exists there
            for v in step.new:
                self.ns.pop(v.name, None)
        return ok


def broadcasts(src: torch.Size | tuple[int, ...], dst: torch.Size | tuple[int, ...]) -> bool:
    """Whether ``src`` broadcasts to ``dst`` (``dst`` unchanged)."""
    try:
        return tuple(torch.broadcast_shapes(tuple(src), tuple(dst))) == tuple(dst)
    except RuntimeError:
        return False
