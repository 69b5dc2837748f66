"""Op statistics: which overloads ran, on which path, with which dtypes, for how long.

``with torchport.ops.record() as rec:`` collects, per ATen overload, the number of
calls, the path each call took (``native`` kernel, ``decomposed`` into native
ops, CPU ``fallback``, metadata-only ``view``) and, for native kernels, the sub-path
inside the kernel (``native:out``, ``native:trial``, ``native:cpu-result``,
``native:general``...: :mod:`torchport.ops.hostkernels` lists them; ``native:kernel``
for a kernel with none; ``native:torchport`` for the kernels torchport registers itself
for every backend -- allocation, copies, ``resize_``, ``set_``, its device routes --, so
that a vendor tells its own kernels from torchport's machinery), the dtypes seen and the
host time spent. ``record(composites=True)`` also lists, on the ``composite`` path, the
ops called on the device that PyTorch computes by a generic composite kernel
(CompositeExplicitAutograd and the like: ``native_layer_norm`` without a device kernel),
which never reach the backend under their own name (their pieces do, on their own rows). ``TORCHPORT_OP_STATS=1`` records the whole process and prints the
table at exit. Knowing which ops fall back is the first step of porting a
model; the host time says where the per-op overhead goes.

When nothing records, the kernels check a single boolean (``ENABLED``) and pay
nothing else. Host time of an op includes the ops it calls (a decomposition's
inner ops are also counted on their own rows).
"""

from __future__ import annotations

import atexit
import json
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from torchport.core import settings
from torchport.ops.switch import Registry

PATHS = ("native", "decomposed", "fallback", "view", "composite")

# Overloads that torchport's own kernels serve on every backend (filled by the registry):
# their native calls are recorded on the sub-path ``torchport``.
OWN: set[str] = set()

ENABLED = False  # read by the op layer: any recorder active?
_RECORDERS: Registry[Recorder] = Registry()
_LOCK = threading.Lock()  # guards the recorders' tables


def _sync(active: bool) -> None:
    global ENABLED
    ENABLED = active


_RECORDERS.on_change(_sync)  # first listener: later ones see ENABLED already updated


@dataclass
class OpStat:
    """What one overload did while recording."""

    calls: int = 0
    paths: dict[str, int] = field(default_factory=dict)
    dtypes: set[str] = field(default_factory=set)
    host_time_s: float = 0.0
    declined: int = 0  # calls where a kernel raised Decline
    subpaths: dict[str, int] = field(default_factory=dict)  # "native:out" -> calls

    def to_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "paths": dict(self.paths),
                "subpaths": dict(self.subpaths), "dtypes": sorted(self.dtypes),
                "host_time_s": self.host_time_s, "declined": self.declined}


class Recorder:
    """Accumulates :class:`OpStat` per overload name (``"add.Tensor"``); with
    ``composites`` also the ops PyTorch's composite kernels compute on the device."""

    def __init__(self, composites: bool = False) -> None:
        self.ops: dict[str, OpStat] = {}
        self.composites = composites
        self._watch: Any = None

    def __enter__(self) -> Recorder:
        _start(self)
        if self.composites:
            self._watch = _composite_watch(self)
            self._watch.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._watch is not None:
            self._watch.__exit__(None, None, None)
            self._watch = None
        _stop(self)

    def add(self, name: str, path: str, dtypes: Iterable[torch.dtype], seconds: float,
            sub: str | None = None) -> None:
        s = self.ops.get(name)
        if s is None:
            s = self.ops[name] = OpStat()
        s.calls += 1
        s.paths[path] = s.paths.get(path, 0) + 1
        if sub is not None:
            key = f"{path}:{sub}"
            s.subpaths[key] = s.subpaths.get(key, 0) + 1
        for d in dtypes:
            s.dtypes.add(str(d).removeprefix("torch."))
        s.host_time_s += seconds

    def path_of(self, name: str) -> str | None:
        """The path an overload took most often (``None`` if it never ran)."""
        s = self.ops.get(name)
        if s is None or not s.paths:
            return None
        return max(s.paths.items(), key=lambda kv: kv[1])[0]

    def subpaths_of(self, name: str) -> dict[str, int]:
        """Calls of an overload per sub-path (``{"native:out": 9, "native:trial": 1}``)."""
        s = self.ops.get(name)
        return dict(s.subpaths) if s is not None else {}

    def totals(self) -> dict[str, int]:
        """Calls per path, over all overloads."""
        out = dict.fromkeys(PATHS, 0)
        for s in self.ops.values():
            for p, n in s.paths.items():
                out[p] = out.get(p, 0) + n
        return out

    def rows(self) -> list[tuple[str, OpStat]]:
        """Overloads sorted by host time, then calls (most expensive first)."""
        return sorted(self.ops.items(), key=lambda kv: (-kv[1].host_time_s, -kv[1].calls, kv[0]))

    def table(self) -> str:
        """A plain-text table of :meth:`rows` (rich's layout when available)."""
        header = ("overload", "calls", "paths", "dtypes", "host ms")
        body = [(name, str(s.calls), _paths_text(s),
                 ",".join(sorted(s.dtypes)), f"{s.host_time_s * 1e3:.3f}")
                for name, s in self.rows()]
        try:
            from rich import box
            from rich.console import Console
            from rich.table import Table
        except ImportError:  # pragma: no cover - rich is a dependency
            widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
            lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in [header, *body]]
            return "\n".join(lines)
        t = Table(title="torchport op statistics", box=box.SIMPLE)
        for i, h in enumerate(header):
            t.add_column(h, justify="right" if i in (1, 4) else "left")
        for r in body:
            t.add_row(*r)
        console = Console(width=140, record=True, force_terminal=False, color_system=None,
                          file=_NullFile())
        console.print(t)
        return console.export_text().rstrip()

    def to_json(self) -> str:
        """The statistics as JSON: ``{"ops": {name: {...}}, "totals": {...}}``."""
        return json.dumps({"ops": {n: s.to_dict() for n, s in self.rows()},
                           "totals": self.totals()}, indent=1)


def _paths_text(s: OpStat) -> str:
    """``native:10 (out:9 trial:1) fallback:2``: calls per path, sub-paths in brackets."""
    parts = []
    for p, n in sorted(s.paths.items()):
        subs = sorted((k.split(":", 1)[1], v) for k, v in s.subpaths.items()
                      if k.split(":", 1)[0] == p)
        inner = f" ({' '.join(f'{k}:{v}' for k, v in subs)})" if subs else ""
        parts.append(f"{p}:{n}{inner}")
    return " ".join(parts)


class _NullFile:
    def write(self, s: str) -> int:
        return len(s)

    def flush(self) -> None:
        pass


def record(composites: bool = False) -> Recorder:
    """A recorder to use as a context manager: ``with record() as rec: ...``.

    ``composites=True`` also records the device's calls of ops that PyTorch's composite
    kernels compute (path ``composite``): a Python dispatch mode sees every op while the
    block runs, which costs time, and ``torch.compile`` runs eagerly under it."""
    return Recorder(composites)


def add(name: str, path: str, args: tuple, kwargs: dict, seconds: float,
        sub: str | None = None) -> None:
    """Record one call in every active recorder (only called when ``ENABLED``)."""
    if path == "native" and name in OWN:
        sub = "torchport"
    dtypes = _dtypes(args, kwargs)
    with _LOCK:
        for r in _RECORDERS.members:
            r.add(name, path, dtypes, seconds, sub)


# ---- sub-paths: which branch of a native kernel a call took ---------------------------
# A kernel built with ``trace`` (used only while recording) notes its branch here; the
# caller (``fallback``'s native path) clears the note before the call and reads it
# after, restoring the caller's own, so an op called inside another keeps its own note.
_NOTE = threading.local()


def note_subpath(name: str) -> None:
    """Say which sub-path the kernel now running took (``"out"``, ``"trial"``...)."""
    _NOTE.sub = name


def swap_subpath(sub: str | None) -> str | None:
    """Set the current note to ``sub``; return the one it replaces."""
    prev = getattr(_NOTE, "sub", None)
    _NOTE.sub = sub
    return prev


def noted(fn: Callable[..., Any], sub: str, on: bool) -> Callable[..., Any]:
    """``fn``, noting ``sub`` when it returns (``on``), else ``fn`` itself: kernels built
    without ``trace`` pay nothing."""
    if not on:
        return fn

    def call(*args: Any, **kwargs: Any) -> Any:
        r = fn(*args, **kwargs)
        _NOTE.sub = sub
        return r
    return call


def traced(kernel: Callable[..., Any], default: str, on: bool) -> Callable[..., Any]:
    """``kernel``, noting ``default`` when it returns without having noted a sub-path
    (``on``), else ``kernel`` itself."""
    if not on:
        return kernel

    def call(*args: Any, **kwargs: Any) -> Any:
        r = kernel(*args, **kwargs)
        if getattr(_NOTE, "sub", None) is None:
            _NOTE.sub = default
        return r
    return call


def add_decline(name: str) -> None:
    """Count a kernel's :class:`~torchport.ops.Decline` for ``name``."""
    with _LOCK:
        for r in _RECORDERS.members:
            s = r.ops.get(name)
            if s is None:
                s = r.ops[name] = OpStat()
            s.declined += 1


def _dtypes(args: tuple, kwargs: dict) -> list[torch.dtype]:
    seen: list[torch.dtype] = []
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            if v.dtype not in seen:
                seen.append(v.dtype)
        elif isinstance(v, (list, tuple)):
            for x in v:
                if isinstance(x, torch.Tensor) and x.dtype not in seen:
                    seen.append(x.dtype)
    return seen


# ---- composites: ops PyTorch computes above the backend --------------------------------
_COMPOSITE_KEYS = ("CompositeExplicitAutogradNonFunctional", "CompositeExplicitAutograd",
                   "CompositeImplicitAutograd")


def computed_by_composite(op: torch._ops.OpOverload) -> bool:
    """Does the device's dispatch entry of ``op`` hold one of PyTorch's composite kernels?
    The dispatcher prefers a kernel registered for the device's key; without one, a
    composite kernel serves before the backend's fallback."""
    s = op._schema
    name = s.name + ("." + s.overload_name if s.overload_name else "")
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    try:
        return not has(name, "PrivateUse1") and any(has(name, k) for k in _COMPOSITE_KEYS)
    except RuntimeError:  # not a dispatcher op
        return False


def _composite_watch(rec: Recorder) -> Any:
    """A dispatch mode recording into ``rec`` the calls on the device of ops a composite
    kernel computes. It sees the ops the autograd layer passes down (an op decomposed
    there, ``layer_norm``, shows as its pieces); the calls it makes are not seen again."""
    import time

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    device = torch._C._get_privateuse1_backend_name()
    known: dict[Any, bool] = {}

    def on_device(args: tuple, kwargs: dict) -> bool:
        for x in tree_flatten((args, kwargs))[0]:
            if isinstance(x, torch.Tensor):
                if x.device.type == device and x.layout == torch.strided:
                    return True
            elif isinstance(x, torch.device) and x.type == device:
                return True
        return False

    class CompositeWatch(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                               kwargs: dict | None = None) -> Any:
            kwargs = kwargs or {}
            composite = known.get(func)
            if composite is None:
                composite = known[func] = computed_by_composite(func)
            if not composite or not on_device(args, kwargs):
                return func(*args, **kwargs)
            t0 = time.perf_counter()
            r = func(*args, **kwargs)
            seconds = time.perf_counter() - t0
            name = func._schema.name.split("::")[-1] + (
                "." + func._schema.overload_name if func._schema.overload_name else "")
            with _LOCK:
                rec.add(name, "composite", _dtypes(args, kwargs), seconds)
            return r

    return CompositeWatch()


def _start(r: Recorder) -> None:
    _RECORDERS.add(r)


def _stop(r: Recorder) -> None:
    _RECORDERS.remove(r)


def on_change(fn: Callable[[], None]) -> None:
    """Call ``fn`` whenever recording starts or stops (the kernels cache the flag)."""
    _RECORDERS.on_change(lambda active: fn())


def _process_recorder() -> None:
    """``TORCHPORT_OP_STATS=1``: record the whole process, print the table at exit."""
    if not settings.get("TORCHPORT_OP_STATS"):
        return
    rec = Recorder()
    _start(rec)

    def report() -> None:
        _stop(rec)
        if rec.ops:
            print(rec.table(), file=sys.stderr)

    atexit.register(report)


_process_recorder()
