"""Op dumps: every device op call printed to stderr and/or saved to a directory.

Levels (as DIPU's ``DIPU_DUMP_OP_ARGS``): 1 prints each op overload and the path
it took (native kernel, decomposition, CPU fallback, view); 2 adds argument
metadata (shape, dtype, stride, device; scalars); 3 adds tensor values,
abbreviated. With a directory, each call's input tensors (before the call) and
outputs are saved (safetensors; ``torch.save`` for dtypes it cannot hold) and
described in ``manifest.jsonl``: a header line, then one JSON object per call
in call-index order (``index``, ``op``, ``path``, ``depth``, ``parent``,
``inputs``, ``outputs``, ``file``). Tensors over ``max_bytes`` keep only metadata
and summary statistics.

A CPU run of the same script is dumped with ``device="cpu"`` (a
TorchDispatchMode that records every ATen op on CPU tensors, in the same
format), so the two dumps can be compared with ``torchport compare-dumps``.

Environment: ``TORCHPORT_DUMP_OPS=0..3``, ``TORCHPORT_DUMP_DIR``,
``TORCHPORT_DUMP_FILTER`` (op regex list), ``TORCHPORT_DUMP_RANGE=start:end``,
``TORCHPORT_DUMP_MAX_BYTES``, ``TORCHPORT_DUMP_CPU=1``.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import re
import sys
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torchport.core import settings
from torchport.core.settings import parse_bytes, parse_range  # noqa: F401  (public here too)
from torchport.ops import hooks
from torchport.ops.fallback import OpMatcher
from torchport.ops.plan import plan_for
from torchport.tools.debug.compare import FORMAT, MANIFEST

_FILE_RE = re.compile(r"^\d{6}_.*\.(safetensors|pt)$")
_VALUES_SHOWN = 8


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_meta(t: torch.Tensor) -> dict[str, Any]:
    """Shape, dtype, stride, device (JSON-ready) of a tensor."""
    m: dict[str, Any] = {"type": "tensor", "shape": list(t.shape), "dtype": _dt(t.dtype),
                         "device": str(t.device)}
    if t.layout == torch.strided:
        m["stride"] = list(t.stride())
        m["offset"] = t.storage_offset()
    else:
        m["layout"] = str(t.layout).removeprefix("torch.")
    return m


def tensor_stats(c: torch.Tensor) -> dict[str, Any]:
    """Summary statistics of a CPU tensor (to compare tensors too large to save)."""
    n = c.numel()
    if n == 0 or c.layout != torch.strided or c.is_quantized:
        return {"numel": n}
    x = torch.view_as_real(c).to(torch.float64) if c.is_complex() else c.to(torch.float64)
    finite = x[x.isfinite()]
    s: dict[str, Any] = {"numel": n, "nan": int(x.isnan().sum()), "inf": int(x.isinf().sum())}
    if finite.numel():
        s.update(min=float(finite.min()), max=float(finite.max()), mean=float(finite.mean()),
                 std=float(finite.std()) if finite.numel() > 1 else 0.0,
                 sum=float(finite.sum()))
    return s


def _scalar(v: Any) -> Any:
    if isinstance(v, bool | int | str) or v is None:
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else repr(v)
    return str(v)  # dtype, device, memory_format, layout: "torch.float32", "sim:0"


def _abbrev(c: torch.Tensor) -> str:
    if c.numel() == 0:
        return "[]"
    flat = c.reshape(-1)
    n = flat.numel()
    idx = list(range(min(n, _VALUES_SHOWN)))
    tail = list(range(max(n - 2, _VALUES_SHOWN), n)) if n > _VALUES_SHOWN else []

    def f(i: int) -> str:
        v = flat[i].item()
        return f"{v:.5g}" if isinstance(v, float) else str(v)
    text = ", ".join(f(i) for i in idx)
    if tail:
        text += (", ..., " if tail[0] > len(idx) else ", ") + ", ".join(f(i) for i in tail)
    return f"[{text}]"


def _to_cpu(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy owning its memory (safetensors refuses shared or strided tensors)."""
    c = t.detach()
    c = c.to("cpu") if c.device.type != "cpu" else c.clone()
    if c.is_conj():
        c = c.resolve_conj()
    if c.is_neg():
        c = c.resolve_neg()
    return c.contiguous()


class Dumper:
    """The interceptor behind :func:`dump`: prints and saves op calls."""

    def __init__(self, dir: str | Path | None = None, level: int = 1,
                 ops: Iterable[str] | str | None = None, start: int = 0,
                 end: int | None = None, max_bytes: int | None = None,
                 device: str | None = None, stream: Any = None) -> None:
        self.level = int(level)
        self.dir = Path(dir) if dir is not None else None
        self.matcher = OpMatcher(ops, "TORCHPORT_DUMP_FILTER")
        self.start, self.end = int(start or 0), end
        self.max_bytes = max_bytes
        self.device = device or torch._C._get_privateuse1_backend_name()
        self._stream = stream
        self.count = 0  # calls seen (the next call's index)
        self.recorded = 0  # calls printed or saved
        self._lock = threading.RLock()
        self._tls = threading.local()
        self._pending: dict[int, dict | None] = {}
        self._next_write = 0
        self._manifest: Any = None
        if self.dir is not None:
            self._open()

    # ---- files ---------------------------------------------------------------
    def _open(self) -> None:
        assert self.dir is not None
        self.dir.mkdir(parents=True, exist_ok=True)
        for p in self.dir.iterdir():
            if p.name == MANIFEST or _FILE_RE.match(p.name):
                p.unlink()
        self._manifest = (self.dir / MANIFEST).open("w")
        header = {"format": FORMAT, "version": 1, "device": self.device,
                  "torch": torch.__version__, "level": self.level,
                  "filter": [p.pattern for p in self.matcher.patterns], "start": self.start,
                  "end": self.end, "max_bytes": self.max_bytes}
        self._manifest.write(json.dumps(header) + "\n")
        self._manifest.flush()

    @property
    def manifest_path(self) -> Path | None:
        return None if self.dir is None else self.dir / MANIFEST

    def close(self) -> None:
        """Write what is still pending and close the manifest."""
        with self._lock:
            if self._manifest is None:
                return
            for i in sorted(self._pending):
                e = self._pending[i]
                if e is not None:
                    self._manifest.write(json.dumps(e) + "\n")
            self._pending.clear()
            self._manifest.close()
            self._manifest = None

    def _finish(self, index: int, entry: dict | None) -> None:
        """Manifest lines go out in call-index order (nested calls finish first)."""
        if self._manifest is None:
            return
        with self._lock:
            self._pending[index] = entry
            while self._next_write in self._pending:
                e = self._pending.pop(self._next_write)
                if e is not None:
                    self._manifest.write(json.dumps(e) + "\n")
                self._next_write += 1
            self._manifest.flush()

    # ---- recording -------------------------------------------------------------
    def _out(self) -> Any:
        return self._stream if self._stream is not None else sys.stderr

    def __call__(self, call: hooks.OpCall, run: Any) -> Any:
        return self.record(call.op, call.name, call.path, call.args, call.kwargs, run,
                           call.depth, call)

    def record(self, op: Any, name: str, path: str, args: tuple, kwargs: dict, run: Any,
               depth: int = 0, call: hooks.OpCall | None = None) -> Any:
        """Run one op call (``run()``), printing/saving it when the filters select it."""
        with self._lock:
            index = self.count
            self.count += 1
        stack = getattr(self._tls, "stack", None)
        if stack is None:
            stack = self._tls.stack = []
        parent = stack[-1] if stack else None
        wanted = (self.matcher(name) and index >= self.start
                  and (self.end is None or index < self.end))
        if not wanted or (self.level <= 0 and self.dir is None):
            self._finish(index, None)
            stack.append(index)
            try:
                return run()
            finally:
                stack.pop()
        self.recorded += 1
        plan = plan_for(op)
        saved: dict[str, torch.Tensor] = {}
        with hooks.suspended():
            inputs = self._describe_args(plan, args, kwargs, saved)
            if self.level >= 1:
                self._print_call(index, name, path, depth, inputs, saved)
        stack.append(index)
        error = None
        try:
            result = run()
        except BaseException as e:
            error = f"{type(e).__name__}: {e}"
            raise
        finally:
            stack.pop()
            if error is not None:
                self._finish(index, self._entry(index, name, path, depth, parent, plan, inputs,
                                                [], saved, error, call))
        with hooks.suspended():
            res = result if isinstance(result, tuple) else (result,)
            if plan.num_returns == 0:
                res = ()
            outputs = [self._describe(f"out{i}", f"out.{i}", v, saved, plan.is_view)
                       for i, v in enumerate(res)]
            if self.level >= 2:
                out = self._out()
                pad = "  " * depth
                for m in outputs:
                    print(f"{pad}    -> {self._text(m, saved)}", file=out)
                out.flush()
            self._finish(index, self._entry(index, name, path, depth, parent, plan, inputs,
                                            outputs, saved, None, call))
        return result

    def _entry(self, index: int, name: str, path: str, depth: int, parent: int | None,
               plan: Any, inputs: list, outputs: list, saved: dict, error: str | None,
               call: hooks.OpCall | None) -> dict:
        if call is not None:
            path = call.path  # a declining kernel changes it while running
        e: dict[str, Any] = {"index": index, "op": name, "path": path, "depth": depth,
                             "parent": parent, "view": plan.is_view, "inputs": inputs,
                             "outputs": outputs, "file": None}
        if error is not None:
            e["error"] = error
        if self.dir is not None and saved:
            e["file"] = self._save(index, name, saved)
        return e

    def _save(self, index: int, name: str, saved: dict[str, torch.Tensor]) -> str:
        assert self.dir is not None
        base = f"{index:06d}_{re.sub(r'[^A-Za-z0-9_.]', '_', name)}"
        try:
            from safetensors.torch import save_file
            fname = base + ".safetensors"
            save_file(saved, str(self.dir / fname), metadata={"op": name, "index": str(index)})
        except Exception:  # dtypes safetensors cannot hold (complex, quantized): torch.save
            fname = base + ".pt"
            torch.save(saved, self.dir / fname)
        return fname

    def _describe_args(self, plan: Any, args: tuple, kwargs: dict,
                       saved: dict[str, torch.Tensor]) -> list[dict]:
        names = plan.arg_names
        out = []
        items = [(names[i] if i < len(names) else f"arg{i}", v) for i, v in enumerate(args)]
        for n, v in (*items, *kwargs.items()):
            m = self._describe(n, f"in.{n}", v, saved, plan.is_view)
            if n in plan.written_args:
                m["written"] = True
            out.append(m)
        return out

    def _describe(self, name: str, key: str, v: Any, saved: dict[str, torch.Tensor],
                  view: bool = False) -> dict:
        if isinstance(v, torch.Tensor):
            m = {"name": name, **tensor_meta(v)}
            if v.layout != torch.strided or v.device.type == "meta":
                return m
            # views alias their input: their data is not saved again
            need_data = (self.dir is not None and not view) or self.level >= 3
            if not need_data:
                return m
            nbytes = v.numel() * v.element_size()
            big = self.max_bytes is not None and nbytes > self.max_bytes
            c = _to_cpu(v)
            if self.dir is not None and not view:
                m["stats"] = tensor_stats(c)
                if big:
                    m["key"] = None
                    m["skipped"] = f"{nbytes} bytes > max_bytes {self.max_bytes}"
                else:
                    m["key"] = key
                    saved[key] = c
            if self.level >= 3:
                m["_values"] = _abbrev(c)
            return m
        if isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v):
            return {"name": name, "type": "list",
                    "items": [self._describe(f"{name}[{j}]", f"{key}.{j}", x, saved, view)
                              for j, x in enumerate(v)]}
        if isinstance(v, (list, tuple)):
            return {"name": name, "type": "value", "value": [_scalar(x) for x in v]}
        return {"name": name, "type": "value", "value": _scalar(v)}

    def _text(self, m: dict, saved: dict) -> str:
        if m["type"] == "tensor":
            s = (f"{m['name']}: tensor {m['dtype']}{m['shape']} stride={m.get('stride')} "
                 f"{m['device']}")
            vals = m.pop("_values", None)
            if self.level >= 3 and vals is not None:
                s += f" values={vals}"
            return s
        if m["type"] == "list":
            inner = "; ".join(self._text(x, saved) for x in m["items"])
            return f"{m['name']}: [{inner}]"
        return f"{m['name']}: {m['value']}"

    def _print_call(self, index: int, name: str, path: str, depth: int, inputs: list,
                    saved: dict) -> None:
        out = self._out()
        pad = "  " * depth
        print(f"[torchport dump] {pad}#{index} {name} ({path})", file=out)
        if self.level >= 2:
            for m in inputs:
                print(f"{pad}    {self._text(m, saved)}", file=out)
        else:
            _strip_values(inputs)
        out.flush()


def _strip_values(items: list[dict]) -> None:
    for m in items:
        m.pop("_values", None)
        if m.get("type") == "list":
            _strip_values(m["items"])


class CpuDumpMode(TorchDispatchMode):
    """Records every ATen op on CPU tensors with a :class:`Dumper` (the CPU reference run)."""

    def __init__(self, dumper: Dumper) -> None:
        super().__init__()
        self.dumper = dumper

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if not isinstance(func, torch._ops.OpOverload) or not _all_cpu(args, kwargs):
            return func(*args, **kwargs)
        name = plan_for(func).overload_name
        return self.dumper.record(func, name, "cpu", args, kwargs,
                                  lambda: func(*args, **kwargs), 0)


def _all_cpu(args: tuple, kwargs: dict) -> bool:
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            if v.device.type != "cpu":
                return False
        elif isinstance(v, (list, tuple)):
            if any(isinstance(x, torch.Tensor) and x.device.type != "cpu" for x in v):
                return False
        elif isinstance(v, torch.device):
            if v.type != "cpu":
                return False
        elif isinstance(v, str) and kwargs.get("device") is v and not v.startswith("cpu"):
            return False
    return True


@contextmanager
def dump(dir: str | Path | None = None, level: int | None = None,
         ops: Iterable[str] | str | None = None, start: int = 0, end: int | None = None,
         max_bytes: int | None = None, device: str | None = None) -> Iterator[Dumper]:
    """Dump the op calls made inside the block; yields the :class:`Dumper`.

    ``level`` defaults to 1 (names and paths on stderr) without ``dir`` and to 0
    (files only) with one. ``ops``: regexes matched in full against overload
    names; ``start``/``end``: call-index range; ``device="cpu"`` dumps the ATen
    ops of a CPU run instead of device ops (the reference for ``compare-dumps``)."""
    if level is None:
        level = 0 if dir is not None else 1
    cpu = device == "cpu"
    d = Dumper(dir, level, ops, start, end, max_bytes, "cpu" if cpu else None)
    try:
        if cpu:
            with CpuDumpMode(d):
                yield d
        else:
            hooks.register(d)
            try:
                yield d
            finally:
                hooks.unregister(d)
    finally:
        d.close()


_ENV_DUMPER: Dumper | None = None


def start_from_env() -> Dumper | None:
    """Start the process-wide dump the ``TORCHPORT_DUMP_*`` variables ask for."""
    global _ENV_DUMPER
    env = os.environ
    level = settings.get("TORCHPORT_DUMP_OPS")
    directory = settings.get("TORCHPORT_DUMP_DIR")
    cpu = settings.get("TORCHPORT_DUMP_CPU")
    if level <= 0 and directory is None:
        if not cpu:
            return None
        level = 1
    if directory is not None and env.get("WORLD_SIZE", "1") not in ("", "1") and "RANK" in env:
        directory = os.path.join(directory, f"rank{env['RANK']}")
    start, end = settings.get("TORCHPORT_DUMP_RANGE") or (0, None)
    d = Dumper(directory, level, settings.get("TORCHPORT_DUMP_FILTER"), start, end,
               settings.get("TORCHPORT_DUMP_MAX_BYTES"), "cpu" if cpu else None)
    if cpu:
        mode = CpuDumpMode(d)
        mode.__enter__()
    else:
        hooks.register(d)
    _ENV_DUMPER = d
    atexit.register(d.close)
    return d
