"""Shrinking a failing program, and writing it as a standalone repro script.

Delta debugging (Zeller's ddmin, on complements) removes steps while the program's first
difference keeps its class (:func:`.known.classify`: kind, step tag, error types), then
single steps are tried once more. A step whose names a later step needs cannot go: without
it both sides raise NameError and the class changes.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchport.tools.fuzz.known import classify
from torchport.tools.fuzz.program import Program
from torchport.tools.fuzz.runner import BACKENDS, Worker, device_diffs


def ddmin(n: int, fails: Callable[[list[int]], bool], max_trials: int = 300) -> list[int]:
    """The smallest list of indices of ``range(n)`` found for which ``fails`` holds
    (``fails(list(range(n)))`` is assumed)."""
    items = list(range(n))
    trials = 0
    chunks = 2
    while len(items) >= 2 and trials < max_trials:
        size = -(-len(items) // chunks)
        parts = [items[i:i + size] for i in range(0, len(items), size)]
        for part in parts:
            rest = [i for i in items if i not in part]
            trials += 1
            if rest and fails(rest):
                items, chunks = rest, max(chunks - 1, 2)
                break
        else:
            if chunks >= len(items):
                break
            chunks = min(len(items), chunks * 2)
    for i in list(items):  # one at a time, once more
        if len(items) > 1 and trials < max_trials:
            rest = [j for j in items if j != i]
            trials += 1
            if fails(rest):
                items = rest
    return items


DiffsOf = Callable[[Program], "list[dict[str, Any]] | None"]


def minimise(program: Program, target: str, diffs_of: DiffsOf,
             max_trials: int = 300) -> Program:
    """``program`` cut down to the fewest steps whose first difference (``diffs_of``: the
    differences of a program, None where the CPU run failed) is of class ``target``."""
    def fails(keep: list[int]) -> bool:
        diffs = diffs_of(program.subset(keep))
        return bool(diffs) and classify(diffs[0]) == target

    return program.subset(ddmin(len(program.steps), fails, max_trials))


def in_workers(mode: str, workers: dict[str | None, Worker]) -> DiffsOf:
    """``diffs_of`` for :func:`minimise`: the program in worker processes, in ``mode``."""
    return lambda program: device_diffs(program, mode, workers)


def repro_name(target: str, mode: str) -> str:
    """A file name for the repro of difference class ``target`` in ``mode``."""
    slug = re.sub(r"[^A-Za-z0-9]+", "_", target).strip("_").lower()
    return f"{slug[:80]}__{mode}.py"


def write_repro(program: Program, mode: str, target: str, detail: str, out: Path) -> Path:
    """Write ``program`` as a standalone script under ``out``; its path."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / repro_name(target, mode)
    detail = detail.replace("\\", "/").replace('"""', "'''")
    title = f"Fuzz repro: {target} ({mode} mode)\n\nFirst seen: {detail}"
    text = program.script(title=title, mode=mode, backend=BACKENDS.get(mode))
    if target.startswith(("crash", "hang")):  # the corpus test must not run it in-process
        text = text.replace('"""\n', '"""\n# fuzz-corpus: subprocess\n', 1)
    path.write_text(text)
    return path
