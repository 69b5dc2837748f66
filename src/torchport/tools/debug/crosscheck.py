"""Autocompare: run each device op again on the CPU and compare (DIPU's autocompare).

For every selected op call on the device the inputs are copied to the CPU first,
the device op runs, the same overload runs on the CPU copies, and every output
and every argument the schema says is written is compared with
``torch.testing.assert_close``'s dtype-aware tolerances; arguments the op must
not write are checked bit for bit against their values before the call (a
kernel that scribbles on its input is caught). Random ops are skipped (their
device and CPU streams differ), as are metadata-only views and allocations.
Backward ops dispatch to the device like any other op, so a training step is
checked forward and backward.

``TORCHPORT_AUTOCOMPARE=<regex list>`` (``.*`` for every op) checks the whole
process and prints the report at exit; ``with autocompare(...) as report:``
checks a block.
"""

from __future__ import annotations

import atexit
import math
import os
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from torchport.core import settings
from torchport.ops import hooks
from torchport.ops.fallback import OpMatcher
from torchport.ops.plan import plan_for
from torchport.tools.debug.compare import UNINITIALISED, TensorDiff, tensor_diff, value_diff


class AutocompareMismatchError(RuntimeError):
    """A device op's result differs from the CPU's (``raise_on_mismatch=True``)."""


@dataclass
class Mismatch:
    """One output or argument of one op call that differs from the CPU reference."""

    call: int  # index of the call among those compared by this report
    op: str  # overload name, "add.Tensor"
    path: str  # native / decomposed / fallback
    what: str  # "output 0", "argument out (written)", "argument self (must not be written)"
    kind: str  # "value", "shape", "dtype", "input modified", "scalar"
    args: str  # argument metadata: shapes, dtypes, strides, scalars
    max_abs: float
    max_rel: float
    mismatched: int
    numel: int

    def describe(self) -> str:
        """One line for logs and exception messages."""
        return (f"autocompare: {self.op} ({self.path}) {self.what}: {self.kind} mismatch, "
                f"max abs {self.max_abs:.4g}, max rel {self.max_rel:.4g}, "
                f"{self.mismatched}/{self.numel} elements; args: {self.args}")


def _arg_text(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        dt = str(v.dtype).removeprefix("torch.")
        if v.layout != torch.strided:
            return f"{dt}{list(v.shape)} {v.layout}"
        return f"{dt}{list(v.shape)} stride={tuple(v.stride())}"
    if isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v):
        return "[" + ", ".join(_arg_text(x) for x in v) + "]"
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def args_text(plan: Any, args: tuple, kwargs: dict) -> str:
    """``self=float32[4, 8] stride=(8, 1), alpha=1`` for a call."""
    names = plan.arg_names
    parts = [f"{names[i] if i < len(names) else i}={_arg_text(v)}" for i, v in enumerate(args)]
    parts += [f"{k}={_arg_text(v)}" for k, v in kwargs.items()]
    return ", ".join(parts)


class AutocompareReport:
    """What autocompare checked and what differed (also the interceptor itself)."""

    def __init__(self, ops: Iterable[str] | str | None = None, rtol: float | None = None,
                 atol: float | None = None, raise_on_mismatch: bool = False) -> None:
        self.matcher = OpMatcher(ops if ops is not None else ".*", "TORCHPORT_AUTOCOMPARE")
        self.rtol, self.atol = rtol, atol
        self.raise_on_mismatch = raise_on_mismatch
        self.mismatches: list[Mismatch] = []
        self.compared: dict[str, int] = {}  # op -> calls compared
        self.skipped: dict[tuple[str, str], int] = {}  # (op, reason) -> calls
        self._lock = threading.Lock()

    @property
    def calls(self) -> int:
        """Number of op calls compared."""
        return sum(self.compared.values())

    @property
    def ok(self) -> bool:
        return not self.mismatches

    @property
    def mismatched_ops(self) -> list[str]:
        """Overloads with at least one mismatch, in the order first seen."""
        return list(dict.fromkeys(m.op for m in self.mismatches))

    def _skip(self, name: str, reason: str) -> None:
        with self._lock:
            k = (name, reason)
            self.skipped[k] = self.skipped.get(k, 0) + 1

    # ---- the interceptor ----------------------------------------------------------
    def __call__(self, call: hooks.OpCall, run: Callable[[], Any]) -> Any:
        name = call.name
        if not self.matcher(name):
            return run()
        plan = plan_for(call.op)
        reason = None
        if plan.random:
            reason = "random op"
        elif plan.is_view:
            reason = "view (metadata only)"
        elif name.split(".", 1)[0] in UNINITIALISED:
            reason = "uninitialised or storage op"
        if reason is not None:
            self._skip(name, reason)
            return run()
        with hooks.suspended():
            try:
                cargs = tuple(_cpu_copy(a) for a in call.args)
                ckw = {k: _cpu_copy(v) for k, v in call.kwargs.items()}
            except Exception as e:
                self._skip(name, f"inputs not copyable: {type(e).__name__}")
                return run()
        result = run()
        with hooks.suspended():
            self._check(call, plan, cargs, ckw, result)
        return result

    def _check(self, call: hooks.OpCall, plan: Any, cargs: tuple, ckw: dict,
               result: Any) -> None:
        try:
            ref = call.op(*cargs, **ckw)
        except Exception as e:
            self._skip(call.name, f"CPU reference failed: {type(e).__name__}")
            return
        with self._lock:
            self.compared[call.name] = self.compared.get(call.name, 0) + 1
            index = self.calls - 1
        found: list[Mismatch] = []
        meta = args_text(plan, call.args, call.kwargs)

        def add(what: str, d: TensorDiff, kind: str | None = None) -> None:
            k = kind or (d.reason.split(" ", 1)[0] if d.reason else "value")
            found.append(Mismatch(index, call.name, call.path, what, k, meta, d.max_abs,
                                  d.max_rel, d.mismatched, d.numel))

        # outputs that are new tensors (aliased returns are checked as written arguments)
        if plan.num_returns:
            res = result if plan.num_returns > 1 else (result,)
            refs = ref if plan.num_returns > 1 else (ref,)
            for i, (r, e) in enumerate(zip(res, refs, strict=False)):
                if plan.return_alias[i] is not None:
                    continue
                for j, (x, y) in enumerate(_pairs(r, e)):
                    d = value_diff(_host(x), y, self.rtol, self.atol)
                    if not d.ok:
                        add(f"output {i}" + (f"[{j}]" if isinstance(r, (list, tuple)) else ""), d)
        # arguments: written ones match the CPU's, the others are unchanged
        names = plan.arg_names
        written = set(plan.written_args)
        write_ptrs = set()
        for n in written:
            for t in _tensors(_arg(call.args, call.kwargs, names, n)):
                if t.layout == torch.strided:
                    write_ptrs.add(t.untyped_storage().data_ptr())
        for i, n in enumerate(names):
            dev = _arg(call.args, call.kwargs, names, n, i)
            cpu = _arg(cargs, ckw, names, n, i)
            for j, (x, y) in enumerate(_pairs(dev, cpu)):
                if not isinstance(x, torch.Tensor):
                    continue
                label = n + (f"[{j}]" if isinstance(dev, (list, tuple)) else "")
                if n in written:
                    d = tensor_diff(_host(x), y, self.rtol, self.atol)
                    if not d.ok:
                        add(f"argument {label} (written)", d)
                elif x.layout == torch.strided and x.untyped_storage().data_ptr() not in write_ptrs:
                    d = tensor_diff(_host(x), y, 0.0, 0.0)
                    if not d.ok:
                        add(f"argument {label} (must not be written)", d, "input modified")
        if not found:
            return
        with self._lock:
            self.mismatches.extend(found)
        if self.raise_on_mismatch:
            raise AutocompareMismatchError(found[0].describe())

    # ---- reporting -------------------------------------------------------------------
    def table(self) -> str:
        """The mismatches as a plain-text table (rich layout)."""
        from rich import box
        from rich.table import Table
        t = Table(title="torchport autocompare mismatches", box=box.SIMPLE)
        for h in ("#", "op", "path", "what", "kind", "max abs", "max rel", "mismatched", "args"):
            t.add_column(h, justify="right" if h in ("#", "max abs", "max rel") else "left")
        for m in self.mismatches:
            t.add_row(str(m.call), m.op, m.path, m.what, m.kind, _g(m.max_abs), _g(m.max_rel),
                      f"{m.mismatched}/{m.numel}", m.args)
        return _render(t)

    def summary(self) -> str:
        """Counts, the mismatch table and the skipped ops."""
        n_ops = len(self.compared)
        skipped = sum(self.skipped.values())
        lines = [f"torchport autocompare: {self.calls} calls of {n_ops} ops compared with the "
                 f"CPU, {len(self.mismatches)} mismatches"
                 + (f" in {', '.join(self.mismatched_ops)}" if self.mismatches else "")
                 + f", {skipped} calls skipped"]
        if self.mismatches:
            lines.append(self.table())
        if self.skipped:
            from rich import box
            from rich.table import Table
            t = Table(title="skipped", box=box.SIMPLE)
            t.add_column("op")
            t.add_column("reason")
            t.add_column("calls", justify="right")
            for (op, reason), n in sorted(self.skipped.items()):
                t.add_row(op, reason, str(n))
            lines.append(_render(t))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"AutocompareReport(calls={self.calls}, mismatches={len(self.mismatches)}, "
                f"skipped={sum(self.skipped.values())})")


def _g(v: float) -> str:
    return "inf" if math.isinf(v) else f"{v:.3g}"


def _render(table: Any) -> str:
    from rich.console import Console
    c = Console(width=160, record=True, force_terminal=False, color_system=None,
                file=open(os.devnull, "w"))  # noqa: SIM115
    c.print(table)
    c.file.close()
    return c.export_text().rstrip()


def _arg(args: tuple, kwargs: dict, names: tuple, name: str, i: int | None = None) -> Any:
    if name in kwargs:
        return kwargs[name]
    if i is None:
        i = names.index(name)
    return args[i] if i < len(args) else None


def _tensors(v: Any) -> list[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [x for x in v if isinstance(x, torch.Tensor)]
    return []


def _pairs(a: Any, b: Any) -> list[tuple[Any, Any]]:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(zip(a, b, strict=False))
    return [(a, b)]


def _host(v: Any) -> Any:
    if isinstance(v, torch.Tensor) and v.device.type != "cpu":
        return v.cpu()
    return v


def _device_name() -> str:
    return torch._C._get_privateuse1_backend_name()


def _cpu_copy(v: Any) -> Any:
    """A CPU copy of an argument (device arguments -> ``cpu``)."""
    if isinstance(v, torch.Tensor):
        return v.cpu() if v.device.type != "cpu" else v.clone()
    if isinstance(v, (list, tuple)):
        return type(v)(_cpu_copy(x) for x in v)
    if isinstance(v, torch.device) and v.type == _device_name():
        return torch.device("cpu")
    if isinstance(v, str) and v.split(":")[0] == _device_name():
        return "cpu"
    return v


@contextmanager
def autocompare(ops: Iterable[str] | str | None = None, rtol: float | None = None,
                atol: float | None = None,
                raise_on_mismatch: bool = False) -> Iterator[AutocompareReport]:
    """Compare every selected device op in the block with the CPU; yields the report.

    ``ops``: regexes matched in full against overload names (default: all);
    ``rtol``/``atol`` default to ``torch.testing.assert_close``'s per dtype;
    ``raise_on_mismatch`` raises :class:`AutocompareMismatchError` at the first."""
    report = AutocompareReport(ops, rtol, atol, raise_on_mismatch)
    hooks.register(report)
    try:
        yield report
    finally:
        hooks.unregister(report)


_ENV_REPORT: AutocompareReport | None = None


def start_from_env() -> AutocompareReport | None:
    """``TORCHPORT_AUTOCOMPARE=<regex list>``: check the whole process, report at exit."""
    global _ENV_REPORT
    ops = settings.get("TORCHPORT_AUTOCOMPARE")
    if not ops:
        return None
    raise_ = settings.get("TORCHPORT_AUTOCOMPARE_RAISE")
    report = AutocompareReport(ops, raise_on_mismatch=raise_)
    hooks.register(report)
    _ENV_REPORT = report

    def at_exit() -> None:
        hooks.unregister(report)
        print(report.summary(), file=sys.stderr)

    atexit.register(at_exit)
    return report
