"""What a fuzz program needs at run time, and the comparison of two runs.

This module's source is copied verbatim into every repro script, and the fuzz workers import
it: the fuzzer and a repro record and compare with the same code, so a repro fails exactly
when the fuzzer's difference persists. Standard library and torch only (no torchport: the
CPU reference run must not load the device).

A program is a function ``program(dev, dev1, rec)``: a list of steps, each a block under
``with rec.step(k, tag, ...):`` that ends with ``rec.keep(name=value, ...)``. Run once with
``dev = dev1 = "cpu"`` and once with ``"sim"``/``"sim:1"``, it yields two traces;
:func:`compare_traces` lists their differences.
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from fnmatch import fnmatchcase
from typing import Any

import torch

# ---- building inputs --------------------------------------------------------------------


def mk(shape: tuple[int, ...], dtype: torch.dtype, seed: int,
       special: bool = False) -> torch.Tensor:
    """A CPU tensor drawn from ``seed``: the same bits in every run and every process.
    ``special`` puts nan, inf and -0.0 in the first elements of a floating tensor."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype == torch.uint8:
        return torch.randint(0, 16, shape, generator=g).to(dtype)
    if dtype in (torch.int8, torch.int16, torch.int32, torch.int64):
        return torch.randint(-9, 10, shape, generator=g).to(dtype)
    if dtype.is_complex:
        x = torch.randn(shape, generator=g, dtype=torch.complex64).to(dtype)
    else:
        x = (torch.randn(shape, generator=g) * 2).to(dtype)
    if special and x.numel():
        flat = x.view(-1)
        for i, v in enumerate((math.nan, math.inf, -0.0)[:x.numel()]):
            flat[i] = v
    return x


def in_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` on a new thread; its result, or its exception raised here."""
    box: dict[str, Any] = {}

    def body() -> None:
        try:
            box["r"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["e"] = e

    th = threading.Thread(target=body)
    th.start()
    th.join()
    if "e" in box:
        raise box["e"]
    return box.get("r")


# ---- recording a run --------------------------------------------------------------------


def snapshot(v: Any) -> dict[str, Any]:
    """What a run remembers of a value: a tensor's dtype, shape, strides, device and values
    (a CPU copy), a sequence's items, a plain Python value itself."""
    if isinstance(v, torch.Tensor) and v.layout != torch.strided:
        # sparse: no strides; its layout and its values as a dense CPU tensor
        t = v.detach()
        return {"t": "T", "dtype": str(t.dtype), "shape": tuple(t.shape), "stride": (),
                "layout": str(t.layout), "device": str(t.device),
                "requires_grad": v.requires_grad, "values": t.cpu().to_dense()}
    if isinstance(v, torch.Tensor) and v.is_quantized:
        # quantized: its quantization parameters, and its integer representation as values
        # (read on its device: PyTorch's ``.cpu()`` of a non-dense quantized tensor makes its
        # copy with ``empty_like(self)``, on the source's device)
        t = v.detach()
        if t.qscheme() in (torch.per_tensor_affine, torch.per_tensor_symmetric):
            q: Any = (str(t.qscheme()), t.q_scale(), t.q_zero_point())
        else:
            q = (str(t.qscheme()), t.q_per_channel_scales().cpu().tolist(),
                 t.q_per_channel_zero_points().cpu().tolist(), t.q_per_channel_axis())
        return {"t": "T", "dtype": str(t.dtype), "shape": tuple(t.shape),
                "stride": tuple(t.stride()), "quantizer": q, "device": str(t.device),
                "requires_grad": v.requires_grad, "values": t.int_repr().cpu()}
    if isinstance(v, torch.Tensor):
        t = v.detach()
        values = t.cpu().resolve_conj().resolve_neg().clone()
        if values.dtype == torch.complex32:  # its storage does not unpickle: exactly widened
            values = values.to(torch.complex64)
        return {"t": "T", "dtype": str(t.dtype), "shape": tuple(t.shape),
                "stride": tuple(t.stride()), "device": str(t.device),
                "requires_grad": v.requires_grad, "values": values}
    if isinstance(v, (tuple, list)) and not isinstance(v, torch.Size):
        return {"t": "S", "items": [snapshot(x) for x in v]}
    if v is None or isinstance(v, (bool, int, float, complex, str)):
        return {"t": "P", "v": v}
    if isinstance(v, (torch.Size, torch.dtype)):
        return {"t": "P", "v": str(v)}
    return {"t": "P", "v": type(v).__name__}


def _full_name(device: str) -> str:
    """``"sim"`` -> ``"sim:0"`` (the current device), as a tensor's ``.device`` reads."""
    d = torch.device(device)
    if d.type == "cpu" or d.index is not None:
        return str(d)
    return f"{d.type}:{getattr(torch, d.type).current_device()}"


def error_of(e: BaseException) -> tuple[str, str, tuple[str, ...]]:
    """An exception as a run remembers it: class name, first line, and the names of its
    classes (a RuntimeError subclass is caught by ``except RuntimeError`` too)."""
    names = tuple(c.__name__ for c in type(e).__mro__)
    return type(e).__name__, (str(e).strip().splitlines() or [""])[0], names


class Recorder:
    """Collects a program's trace: per step, the kept values or the exception, and the
    warnings raised (category and message)."""

    announce = False

    def __init__(self, dev: str, dev1: str) -> None:
        self.devices = {"dev": _full_name(dev), "dev1": _full_name(dev1)}
        self.steps: list[dict[str, Any]] = []
        self._current: dict[str, Any] | None = None

    @contextlib.contextmanager
    def step(self, k: int, tag: str, exact: bool = True, strides: tuple[str, ...] = (),
             expect: str | None = None, on: dict[str, str] | None = None) -> Iterator[None]:
        """One step: ``exact`` compares floating values bit for bit (else with
        ``assert_close``'s tolerances), ``strides`` names the kept values whose strides
        PyTorch promises, ``expect`` is the exception CUDA raises where the CPU does not,
        ``on`` the role ("dev", "dev1", "cpu") of kept tensors' devices."""
        entry: dict[str, Any] = {"k": k, "tag": tag, "exact": exact, "strides": tuple(strides),
                                 "expect": expect, "on": dict(on or {}), "error": None,
                                 "values": {}, "warnings": []}
        self.steps.append(entry)
        self._current = entry
        if self.announce:  # a worker that dies leaves the step it was in in its log
            print(f"[fuzz step {k} {tag}]", file=sys.stderr, flush=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                yield
                self.synchronize()
            except Exception as e:  # noqa: BLE001 - the step's outcome
                entry["error"] = error_of(e)
        entry["warnings"] = sorted({(c.category.__module__ + "." + c.category.__qualname__,
                                     str(c.message).split("\n")[0]) for c in caught})
        self._current = None

    def synchronize(self) -> None:
        """Wait for the devices' queued work, so that an asynchronous kernel's error is
        raised in its own step (as ``torch.cuda.synchronize()`` after each step would)."""
        for name in sorted(set(self.devices.values())):
            kind = torch.device(name).type
            if kind != "cpu":
                getattr(torch, kind).synchronize(name)

    def keep(self, **values: Any) -> None:
        """Record the step's results (their values are copied to the CPU now: on an
        asynchronous device this synchronises, so a kernel's error lands on its step)."""
        assert self._current is not None, "keep() outside a step"
        for name, v in values.items():
            self._current["values"][name] = snapshot(v)

    def trace(self) -> dict[str, Any]:
        return {"devices": self.devices, "steps": self.steps}


# ---- comparing two runs -----------------------------------------------------------------

# Warning categories defined by torchport itself are not compared: PyTorch on CUDA has no
# such warnings (FallbackWarning: an op ran on the CPU fallback; NativeCodeWarning: no C++
# library; PinnedMemoryWarning). Everything else must match in category and message.
IGNORED_WARNING_MODULES = ("torchport",)


def _warnings_of(step: dict[str, Any], devices: dict[str, str]) -> list[tuple[str, str]]:
    out = []
    for cat, msg in step["warnings"]:
        if cat.startswith(IGNORED_WARNING_MODULES):
            continue
        for name in sorted(set(devices.values()), key=len, reverse=True):
            msg = msg.replace(name, "<dev>")
        out.append((cat, msg.replace("cpu", "<dev>")))
    return sorted(set(out))


def _close(a: torch.Tensor, b: torch.Tensor, exact: bool) -> str | None:
    """None when ``a`` (device) matches ``b`` (CPU), else the mismatch in one line."""
    try:
        if exact:
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, check_dtype=False)
        else:
            torch.testing.assert_close(a, b, equal_nan=True, check_dtype=False)
    except AssertionError as e:
        lines = [s.strip() for s in str(e).splitlines() if s.strip()]
        return "; ".join(lines[:3])
    return None


def _same_float(a: float, b: float, exact: bool) -> bool:
    """Python floats as ``assert_close`` compares tensors: NaN equals NaN; within its
    float32 tolerances unless ``exact``."""
    if a != a or b != b:
        return a != a and b != b
    return a == b if exact else math.isclose(a, b, rel_tol=1.3e-6, abs_tol=1e-5)


def _compare_value(path: str, c: dict[str, Any], d: dict[str, Any], step: dict[str, Any],
                   top: str, role: str | None, devices: dict[str, str],
                   out: list[tuple[str, str]]) -> None:
    if c["t"] != d["t"]:
        out.append(("structure", f"{path}: cpu {c['t']} vs device {d['t']}"))
        return
    if c["t"] == "S":
        if len(c["items"]) != len(d["items"]):
            out.append(("structure", f"{path}: {len(c['items'])} items vs {len(d['items'])}"))
            return
        for i, (ci, di) in enumerate(zip(c["items"], d["items"], strict=True)):
            _compare_value(f"{path}[{i}]", ci, di, step, top, role, devices, out)
        return
    if c["t"] == "P":
        cv, dv = c["v"], d["v"]
        if isinstance(cv, complex) and isinstance(dv, complex):
            same = all(_same_float(x, y, step["exact"])
                       for x, y in ((cv.real, dv.real), (cv.imag, dv.imag)))
        elif isinstance(cv, float) and isinstance(dv, float):
            same = _same_float(cv, dv, step["exact"])
        else:
            same = cv == dv and type(cv) is type(dv)
        if not same:
            out.append(("value", f"{path}: cpu {cv!r} vs device {dv!r}"))
        return
    if c["dtype"] != d["dtype"]:
        out.append(("dtype", f"{path}: cpu {c['dtype']} vs device {d['dtype']}"))
        return
    if c["shape"] != d["shape"]:
        out.append(("shape", f"{path}: cpu {c['shape']} vs device {d['shape']}"))
        return
    for key in ("layout", "quantizer"):  # sparse and quantized tensors
        if c.get(key) != d.get(key):
            out.append((key, f"{path}: cpu {c.get(key)} vs device {d.get(key)}"))
            return
    if top in step["strides"] and c["stride"] != d["stride"] and math.prod(c["shape"]) > 1:
        out.append(("stride", f"{path}: cpu {c['stride']} vs device {d['stride']}"))
    if c["requires_grad"] != d["requires_grad"]:
        out.append(("autograd", f"{path}: requires_grad cpu {c['requires_grad']} "
                                f"vs device {d['requires_grad']}"))
    if role is not None and role in devices and d["device"] != devices[role]:
        out.append(("device", f"{path}: on {d['device']}, expected {devices[role]}"))
    why = _close(d["values"], c["values"], step["exact"])
    if why:
        out.append(("value", f"{path}: {why}"))


def compare_step(c: dict[str, Any], d: dict[str, Any],
                 devices: dict[str, str]) -> list[tuple[str, str]]:
    """The differences of one step, as (kind, detail); the CPU run ``c`` is the oracle."""
    out: list[tuple[str, str]] = []
    ce, de = c["error"], d["error"]
    if c["expect"]:  # CUDA raises where the CPU accepts: the device must raise too
        allowed = {c["expect"]} | ({ce[0]} if ce else set())
        if de is None:
            why = f"cpu {ce[0]}: {ce[1]}" if ce else f"CUDA raises {c['expect']}"
            out.append(("device-accepts", f"{why}; the device returned"))
        elif not allowed & set(de[2]):
            out.append(("error-type", f"expected {' or '.join(sorted(allowed))}; "
                                      f"device {de[0]}: {de[1]}"))
        return out
    if ce and de:
        # the CPU's class or a subclass; or a kernel's error reported asynchronously: CUDA
        # raises a RuntimeError at the next synchronising call (torchport's names the
        # kernel's exception, "...: IndexError: index out of range")
        asynchronous = "RuntimeError" in de[2] and f"{ce[0]}: " in de[1]
        if ce[0] not in de[2] and not asynchronous:
            out.append(("error-type", f"cpu {ce[0]}: {ce[1]} | device {de[0]}: {de[1]}"))
        return out
    if ce:
        out.append(("device-accepts", f"cpu {ce[0]}: {ce[1]}"))
        return out
    if de:
        out.append(("device-raises", f"{de[0]}: {de[1]}"))
        return out
    if sorted(c["values"]) != sorted(d["values"]):
        out.append(("structure", f"kept {sorted(c['values'])} vs {sorted(d['values'])}"))
        return out
    for name in c["values"]:
        _compare_value(name, c["values"][name], d["values"][name], c, name,
                       c["on"].get(name), devices, out)
    cw, dw = _warnings_of(c, devices), _warnings_of(d, devices)
    if cw != dw:
        out.append(("warnings", f"cpu {cw} vs device {dw}"))
    return out


# Steps CUDA computes where the CPU raises: the device must compute too (its values are
# CUDA's, with no CPU result to compare). Integer histc: CUDA's kernel (SummaryOps.cu) takes
# integer dtypes, the CPU's is floating-only.
CUDA_COMPUTES = ("reduce:histc*@*int*", "seq:histc@*int*")


def compare_traces(cpu: dict[str, Any], dev: dict[str, Any], tolerant: bool = False
                   ) -> list[dict[str, Any]]:
    """Every difference between a CPU trace and a device trace, first first: dicts of
    ``k`` (step), ``tag``, ``kind``, ``detail`` and ``error`` (the error types involved,
    part of the difference's class). ``tolerant``: every step's floating values compare
    within ``assert_close``'s default tolerances for their dtype, not bit for bit (a
    backend whose own kernels and decompositions round otherwise than the CPU's)."""
    diffs: list[dict[str, Any]] = []
    by_k = {s["k"]: s for s in dev["steps"]}
    for c in cpu["steps"]:
        if tolerant:
            c = {**c, "exact": False}
        d = by_k.get(c["k"])
        if d is None:
            diffs.append({"k": c["k"], "tag": c["tag"], "kind": "missing",
                          "detail": "the device run ended before this step", "error": ""})
            break
        for kind, detail in compare_step(c, d, dev["devices"]):
            if kind == "device-accepts" and any(fnmatchcase(c["tag"], p) for p in CUDA_COMPUTES):
                continue
            errs = "/".join(e[0] for e in (c["error"], d["error"]) if e)
            diffs.append({"k": c["k"], "tag": c["tag"], "kind": kind, "detail": detail,
                          "error": errs})
    for d in dev["steps"]:
        if d["k"] not in {c["k"] for c in cpu["steps"]}:
            diffs.append({"k": d["k"], "tag": d["tag"], "kind": "device-raises",
                          "detail": str(d["error"]), "error": (d["error"] or ("",))[0]})
    return diffs


def run(program: Callable[..., None], dev: str, dev1: str) -> dict[str, Any]:
    """Run ``program`` on ``dev``; its trace. A device run ends with a synchronisation,
    recorded as a last step (an asynchronous kernel's error, reported late)."""
    rec = Recorder(dev, dev1)
    program(dev, dev1, rec)
    if torch.device(dev).type != "cpu":
        mod = getattr(torch, torch.device(dev).type)
        try:
            mod.synchronize()
        except Exception as e:  # noqa: BLE001 - recorded
            rec.steps.append({"k": 10**6, "tag": "synchronize", "exact": True, "strides": (),
                              "expect": None, "on": {}, "values": {}, "warnings": [],
                              "error": error_of(e)})
    return rec.trace()


def check(program: Callable[..., None], device: str = "sim", tolerant: bool = False
          ) -> list[dict[str, Any]]:
    """Run ``program`` on the CPU and on ``device``; their differences (a repro's test;
    ``tolerant`` as :func:`compare_traces`)."""
    cpu = run(program, "cpu", "cpu")
    dev = run(program, device, f"{device}:1")
    return compare_traces(cpu, dev, tolerant)
