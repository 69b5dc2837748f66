"""Model-level comparison: which module's output first differs from the CPU's?

:func:`compare_modules` runs one forward (and a backward of the sum of the
outputs) of a device model and of a CPU copy of it, records every submodule's
output with forward hooks and every parameter's gradient, and reports the
differences in execution order, so the first divergent module is where to look
(a bad kernel shows up there; everything after it inherits the error). Put the
model in ``eval()`` mode first when it has dropout: random ops do not draw the
same numbers on two devices.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from torchport.tools.debug.compare import TensorDiff, tensor_diff


@dataclass
class ModuleRow:
    """One module output (or parameter gradient) compared."""

    name: str  # module path ("0", "encoder.layer.1"), "(model)" for the whole model
    kind: str  # "output", "output[i]" or "grad"
    call: int  # forward-hook order (outputs), or parameter order (grads)
    diff: TensorDiff

    @property
    def divergent(self) -> bool:
        return not self.diff.ok


@dataclass
class ModuleComparison:
    """The result of :func:`compare_modules`; rows in execution order."""

    rows: list[ModuleRow] = field(default_factory=list)

    @property
    def first_divergent(self) -> ModuleRow | None:
        """The first module whose forward output differs (else the first gradient that does)."""
        out = next((r for r in self.rows if r.kind != "grad" and r.divergent), None)
        return out or next((r for r in self.rows if r.divergent), None)

    @property
    def divergent(self) -> list[ModuleRow]:
        return [r for r in self.rows if r.divergent]

    @property
    def ok(self) -> bool:
        return not self.divergent

    def summary(self) -> str:
        """The first divergent module, then every row (divergent ones marked)."""
        from rich.console import Console
        from rich.table import Table
        first = self.first_divergent
        head = ("no module differs from the CPU" if first is None else
                f"first divergent module: {first.name} ({first.kind}): {first.diff.short()}")
        t = Table(title="device vs CPU, per module")
        for h in ("#", "module", "kind", "status", "max abs", "max rel", "cosine"):
            t.add_column(h)
        ordered = ([first] if first else []) + [r for r in self.rows if r is not first]
        for r in ordered:
            d = r.diff
            t.add_row(str(r.call), r.name, r.kind, "DIVERGED" if r.divergent else "ok",
                      f"{d.max_abs:.3g}", f"{d.max_rel:.3g}",
                      "-" if d.cosine is None else f"{d.cosine:.6f}",
                      style="red" if r.divergent else None)
        c = Console(width=140, record=True, force_terminal=False, color_system=None,
                    file=_Null())
        c.print(t)
        return head + "\n" + c.export_text().rstrip()


class _Null:
    def write(self, s: str) -> int:
        return len(s)

    def flush(self) -> None:
        pass


def _tensors(v: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(v)
    return [x for x in leaves if isinstance(x, torch.Tensor)]


def _record(model: nn.Module, store: list[tuple[str, list[torch.Tensor]]]) -> list[Any]:
    handles = []
    for name, mod in model.named_modules():
        def hook(m: nn.Module, inp: Any, out: Any, name: str = name or "(model)") -> None:
            store.append((name, [t.detach().cpu().clone() for t in _tensors(out)]))
        handles.append(mod.register_forward_hook(hook))
    return handles


def _device_of(model: nn.Module, inputs: Any) -> torch.device:
    for p in model.parameters():
        return p.device
    for t in _tensors(inputs):
        return t.device
    return torch.device(torch._C._get_privateuse1_backend_name())


def compare_modules(model: nn.Module, inputs: Any, backward: bool = True,
                    rtol: float | None = None, atol: float | None = None) -> ModuleComparison:
    """Compare each submodule's output (and each parameter's gradient) with a CPU copy.

    ``inputs``: a tensor, a tuple of positional arguments or a dict of keyword
    arguments (moved to the model's device, and to the CPU for the copy). The
    model's own ``.grad`` fields are not touched (gradients come from
    ``torch.autograd.grad``)."""
    device = _device_of(model, inputs)
    cpu_model = copy.deepcopy(model).to("cpu")

    def move(v: Any, d: torch.device | str) -> Any:
        return tree_map(lambda x: x.detach().to(d) if isinstance(x, torch.Tensor) else x, v)

    dev_in, cpu_in = move(inputs, device), move(inputs, "cpu")
    runs = []
    for m, inp in ((model, dev_in), (cpu_model, cpu_in)):
        store: list[tuple[str, list[torch.Tensor]]] = []
        handles = _record(m, store)
        try:
            if isinstance(inp, dict):
                out = m(**inp)
            elif isinstance(inp, (tuple, list)):
                out = m(*inp)
            else:
                out = m(inp)
        finally:
            for h in handles:
                h.remove()
        grads: list[tuple[str, torch.Tensor | None]] = []
        if backward:
            named = [(n, p) for n, p in m.named_parameters() if p.requires_grad]
            outs = [t for t in _tensors(out) if t.requires_grad and
                    (t.is_floating_point() or t.is_complex())]
            if named and outs:
                loss = sum(t.sum().real if t.is_complex() else t.sum() for t in outs)
                gs = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
                grads = [(n, None if g is None else g.detach().cpu()) for (n, _), g in
                         zip(named, gs, strict=True)]
        runs.append((store, grads))
    (dev_store, dev_grads), (cpu_store, cpu_grads) = runs
    result = ModuleComparison()
    for i, ((name, dts), (_, cts)) in enumerate(zip(dev_store, cpu_store, strict=False)):
        for j, (x, y) in enumerate(zip(dts, cts, strict=False)):
            kind = "output" if len(dts) == 1 else f"output[{j}]"
            result.rows.append(ModuleRow(name, kind, i, tensor_diff(x, y, rtol, atol)))
    for i, ((name, g), (_, cg)) in enumerate(zip(dev_grads, cpu_grads, strict=False)):
        if g is None or cg is None:
            continue
        result.rows.append(ModuleRow(name, "grad", i, tensor_diff(g, cg, rtol, atol)))
    return result
