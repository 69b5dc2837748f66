"""Layout sweep: op_db's samples made strided, the sim against the CPU on the same layouts.

A kernel can take another path for a non-contiguous input than for a contiguous one (the
CPU's ``native_batch_norm.out`` leaves its saved statistics unwritten for a strided
input), so every sample runs again with its tensors

- ``transposed``: the same values in reversed dimension order in memory (column-major),
- ``strided``: every other element of a buffer twice as wide (``[..., ::2]``),
- ``offset``: at a storage offset in a larger buffer,
- ``expanded``: the first element of the last dimension broadcast over it (stride 0,
  overlapping memory: other values, the same layout on both sides),

made alike on the CPU and on ``sim`` (the first ``--max-samples`` samples per OpInfo and
dtype that hold a tensor of two or more elements). Results and the inputs the op wrote are compared
bit for bit where every overload the sample reached ran the CPU's own kernel on the
device (the ``native`` and ``view`` paths), and with ``torch.testing.assert_close``
(PyTorch's per-dtype tolerances) where a decomposition or the fallback computed it;
random ops by shape and dtype only; an input the op wrote although several of its
elements share memory (running statistics expanded) by shape and dtype only, since the
value left there is whichever thread wrote last, on the CPU as on CUDA.

    python -m tests.conformance.layouts                    # every OpInfo, float32
    python -m tests.conformance.layouts --ops 'nn.functional.batch_norm|sum'
    python -m tests.conformance.layouts --strict --async --dtypes float32,int64

Writes ``reports/layouts.md`` (``layouts-strict.md``, ``layouts-async.md`` in those
modes; ``--name`` changes it). Exit status 0 when nothing failed (``KNOWN`` differences
are listed with their reason, never counted as passes).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from torchport.tools.conformance.opinfo import (
    Runner,
    _short,
    _uninitialized,
    add_mode_arguments,
    guarded,
    load_op_db,
    opinfo_id,
    report_name,
    run_worker_pool,
    select,
    serve,
    worker_env,
)

ROOT = Path(__file__).resolve().parents[2]  # workers run -m tests.conformance.<driver>

VARIANTS = ("transposed", "strided", "offset", "expanded")
DEFAULT_DTYPES = ("float32",)
DEFAULT_MAX_SAMPLES = 2

# Differences with a known cause: (regex over "<OpInfo id>/<dtype>/<variant>", kind,
# reason). Kinds "limitation" (the backend does not do this) and "cpu" (the CPU's own
# result is not a function of the inputs) make a failure "known": listed with the reason,
# counted apart, never a pass. Kind "bug" keeps it a failure and gives its diagnosis.
KNOWN: list[tuple[str, str, str]] = [
    (r"masked\.median/.*/expanded", "cpu",
     "the CPU's nanmedian.dim_values returns uninitialised memory for an overlapping "
     "(stride-0) input: torch.nanmedian(torch.randn(1).expand(5), 0).values is not the "
     "value; the sim's result is"),
]


# ---- layouts -------------------------------------------------------------------
def relayout(t: Any, variant: str) -> Any:
    """``t`` (a tensor of any device) in the layout ``variant`` names; other values as
    they are. Made with ordinary ops, so that the CPU and the device get the same layout."""
    import torch
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.ndim == 0 \
            or t.numel() < 2 or t.is_conj() or t.is_neg() \
            or variant == "transposed" and t.ndim < 2 \
            or variant == "expanded" and t.shape[-1] < 2:
        return t  # the same object: nothing to change
    t = t.detach()
    if variant == "transposed":
        order = list(range(t.ndim))[::-1]
        return t.permute(order).contiguous().permute(order)
    if variant == "strided":
        base = t.new_zeros((*t.shape[:-1], 2 * t.shape[-1]))
        view = base[..., ::2]
        view.copy_(t)
        return view
    if variant == "offset":
        base = t.new_zeros(t.numel() + 3)
        view = base[3:].view(t.shape)
        view.copy_(t)
        return view
    if variant == "expanded":
        return t[..., :1].clone().expand(t.shape)
    raise ValueError(f"unknown layout variant {variant!r}; expected one of {VARIANTS}")


def _layout(t: Any) -> tuple:
    return (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype)


def _bits_equal(a: Any, b: Any) -> bool:
    """Same structure, and tensors with the same shape, dtype and bytes (NaN-aware)."""
    import torch
    from torch.utils import _pytree
    la, sa = _pytree.tree_flatten(a)
    lb, sb = _pytree.tree_flatten(b)
    if sa != sb or len(la) != len(lb):
        return False
    for x, y in zip(la, lb, strict=True):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if not isinstance(x, torch.Tensor):
            if x != y and not (x != x and y != y):  # NaN numbers
                return False
            continue
        if x.shape != y.shape or x.dtype != y.dtype or x.layout != y.layout:
            return False
        if x.layout != torch.strided:  # a sparse result: its values, by their dense form
            x, y = x.to_dense(), y.to_dense()
        if x.numel() and not torch.equal(_raw(x), _raw(y)):
            return False
    return True


def _raw(t: Any) -> Any:
    """The bytes of ``t``'s elements in order (NaN payloads and signed zeros included)."""
    import torch
    flat = torch.empty(t.numel(), dtype=t.dtype)  # (a size-1 dimension keeps any stride)
    flat.view(t.shape).copy_(t.resolve_conj().resolve_neg())
    return flat.view(torch.uint8)


def known_cause(key: str) -> tuple[str, str] | None:
    """(kind, reason) of a failure ``"<id>/<dtype>/<variant>"``, if known."""
    for pattern, kind, reason in KNOWN:
        if re.fullmatch(pattern, key):
            return kind, reason
    return None


class LayoutRunner(Runner):
    """:class:`Runner`'s conversions and samples, each sample in every layout variant."""

    def run_variant(self, op: Any, sample: Any, keep: frozenset[int], variant: str,
                    random: bool | None = None) -> tuple[str, str | None]:
        """(status, message): pass / tolerance / fail / skip for one sample in one layout.
        ``random``: whether the op's CPU result changes with the seed, if known."""
        torch, pytree = self.torch, self.pytree
        bundle = (sample.input, tuple(sample.args), dict(sample.kwargs))
        leaves, spec = pytree.tree_flatten(self._clone_cpu(bundle))
        cpu_in = pytree.tree_unflatten(
            [x if i in keep else relayout(x, variant) for i, x in enumerate(leaves)], spec)
        if _bits_equal_layouts(pytree.tree_flatten(cpu_in)[0], leaves):
            return "skip", "no tensor changes layout"
        dev_leaves = pytree.tree_flatten(self._to_dev(bundle, keep_cpu=keep))[0]
        dev_in = pytree.tree_unflatten(
            [x if i in keep else relayout(x, variant) for i, x in enumerate(dev_leaves)], spec)
        for c, d in zip(pytree.tree_flatten(cpu_in)[0], pytree.tree_flatten(dev_in)[0],
                        strict=True):
            if isinstance(c, torch.Tensor) and c.layout == torch.strided \
                    and _layout(c) != _layout(d):
                raise AssertionError(f"harness: layouts differ {_layout(c)} vs {_layout(d)}")
        cpu_leaves = pytree.tree_flatten(cpu_in)[0]
        overlapping = {i: x.clone() for i, x in enumerate(cpu_leaves)
                       if isinstance(x, torch.Tensor) and x.layout == torch.strided
                       and torch._debug_has_internal_overlap(x) == 1}
        torch.manual_seed(1234)
        try:
            ref = self._call(op, cpu_in)
        except Exception as e:
            return "skip", f"the CPU raises ({_short(e)})"
        # An op writing into memory that several elements share (running statistics
        # expanded to stride 0) leaves whichever thread wrote last, on the CPU as on CUDA:
        # such inputs are compared by shape and dtype, the results and others by value.
        racy = {i for i, before in overlapping.items()
                if not torch.equal(_raw(before), _raw(cpu_leaves[i]))}
        if random is None:
            random = self._random(op, sample)
            if random is None:
                return "skip", "the CPU raises on a copy of the sample"
        with self.tops.record() as rec:
            try:
                out = self._call(op, dev_in)
            except Exception as e:
                return "fail", f"sim raises {_short(e)}"
        try:
            self._check_devices(out, ref)
            if random:
                self._check_meta(out, ref)
                return "pass", None
            got = self._to_cpu(out)
            mutated, expected = self._written(dev_in, racy), self._written(cpu_in, racy)
            if _bits_equal(got, ref) and _bits_equal(mutated, expected):
                return "pass", None
            paths = sorted({p for n in rec.ops for p in rec.ops[n].paths})
            own = set(paths) <= {"native", "view"}
            torch.testing.assert_close(got, ref, equal_nan=True)
            torch.testing.assert_close(mutated, expected, equal_nan=True)
        except Exception as e:
            return "fail", _short(e)
        if own:
            return "fail", ("bits differ from the CPU although every overload ran the CPU's "
                            "own kernel (within tolerance)")
        return "tolerance", "within PyTorch's tolerances, computed by " + ", ".join(
            f"{n} ({'/'.join(sorted(rec.ops[n].paths))})" for n in sorted(rec.ops)
            if set(rec.ops[n].paths) - {"native", "view"})

    def _written(self, bundle: Any, racy: set[int]) -> list[Any]:
        """The tensors of ``bundle`` on the CPU to compare after the call: those at the
        leaf positions ``racy`` by shape and dtype only (zeros of their shape in their place)."""
        torch = self.torch
        leaves = self.pytree.tree_flatten(self._to_cpu(bundle))[0]
        return [torch.zeros((), dtype=x.dtype).expand(x.shape) if i in racy else x
                for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]

    def _samples(self, op: Any, dtype: Any, requires_grad: bool
                 ) -> list[tuple[Any, frozenset[int]]]:
        """The first ``max_samples`` samples that have a tensor to lay out otherwise (op_db
        often starts with scalars), from the first ``8 * max_samples``; each with the
        leaves the OpInfo keeps on the CPU."""
        self.torch.manual_seed(0)
        limit = None if self.max_samples is None else 8 * self.max_samples
        pool = []
        for i, s in enumerate(op.sample_inputs("cpu", dtype, requires_grad=requires_grad)):
            if limit is not None and i >= limit:
                break
            pool.append(s)
        both = list(zip(pool, self._cpu_leaves(op, dtype, requires_grad, pool), strict=True))
        useful = [(s, k) for s, k in both if self._has_layout(s, k)]
        return (useful or both)[:self.max_samples]

    def _has_layout(self, sample: Any, keep: frozenset[int]) -> bool:
        leaves = self.pytree.tree_flatten(
            (sample.input, tuple(sample.args), dict(sample.kwargs)))[0]
        return any(i not in keep and isinstance(x, self.torch.Tensor)
                   and x.layout == self.torch.strided and x.ndim and x.numel() > 1
                   for i, x in enumerate(leaves))

    def _random(self, op: Any, sample: Any) -> bool | None:
        """Does the op's CPU result on ``sample`` change with the seed (``None``: the CPU
        raises; each layout then finds out for itself)?"""
        bundle = (sample.input, tuple(sample.args), dict(sample.kwargs))
        if _uninitialized(op):
            return True
        try:
            self.torch.manual_seed(1234)
            ref = self._call(op, self._clone_cpu(bundle))
            return not self._same_with_seed(op, bundle, ref)
        except Exception:  # a sample depending on its storage (as_strided's offsets)
            return None

    def run_layouts(self, op: Any, dtypes: Sequence[str],
                    variants: Sequence[str] = VARIANTS) -> dict[str, Any]:
        """Per (dtype, variant) counts of one OpInfo, with every failure's message."""
        torch = self.torch
        t0 = time.perf_counter()
        out: dict[str, Any] = {"id": opinfo_id(op), "cells": {}, "failures": [],
                               "tolerances": [], "known": [], "skip_reasons": []}
        supported = op.supported_dtypes("cpu")
        with guarded(out, self.op_timeout, self.tops, trace=None):
            for name in dtypes:
                if getattr(torch, name) not in supported:
                    out["skip_reasons"].append(f"{name} not supported by the op on the CPU")
                    continue
                try:
                    samples = self._samples(op, getattr(torch, name), False)
                except Exception as e:
                    out["cells"][name] = {"skip_reason": f"no samples ({_short(e)})"}
                    continue
                randoms = [self._random(op, s) for s, _ in samples]
                for variant in variants:
                    c = out["cells"].setdefault(f"{name}/{variant}", dict.fromkeys(
                        ("pass", "tolerance", "fail", "known", "skip"), 0))
                    for (s, keep), random in zip(samples, randoms, strict=True):
                        st, msg = self.run_variant(op, s, keep, variant, random)
                        if st == "skip" and msg not in out["skip_reasons"] \
                                and len(out["skip_reasons"]) < 3:
                            out["skip_reasons"].append(msg)
                        key = f"{out['id']}/{name}/{variant}"
                        cause = known_cause(key) if st == "fail" else None
                        if cause is not None and cause[0] != "bug":
                            st = "known"
                            out["known"].append((key, f"{cause[0]}: {cause[1]}", msg))
                        elif st == "fail":
                            out["failures"].append(
                                (key, msg if cause is None else f"{msg} -- bug: {cause[1]}"))
                        elif st == "tolerance" and (key, msg) not in out["tolerances"]:
                            out["tolerances"].append((key, msg))
                        c[st] += 1
        cells = [v for v in out["cells"].values() if "pass" in v]
        out["status"] = ("fail" if out["failures"] or out.get("error") else
                         "known" if out["known"] else
                         "pass" if any(v["pass"] + v["tolerance"] for v in cells) else "skip")
        out["seconds"] = round(time.perf_counter() - t0, 3)
        return out


def _bits_equal_layouts(a: list, b: list) -> bool:
    """Did relayout leave every tensor as it was (nothing to test in this variant)?"""
    import torch
    return all(x is y or not isinstance(x, torch.Tensor) for x, y in zip(a, b, strict=True))


def run_in_process(pattern: str | None, dtypes: Sequence[str] = DEFAULT_DTYPES,
                   max_samples: int | None = DEFAULT_MAX_SAMPLES,
                   op_timeout: float = 120.0) -> list[dict[str, Any]]:
    """The sweep over the selected OpInfos here (the device registered in this process)."""
    import torchport.sim  # noqa: F401

    runner = LayoutRunner(max_samples=max_samples, grad=False, op_timeout=op_timeout)
    return [runner.run_layouts(op, dtypes) for op in select(load_op_db(), pattern)]


# ---- workers: a crash or hang of one OpInfo costs that OpInfo ----------------------------
def _worker(args: argparse.Namespace) -> int:
    import torchport.sim  # noqa: F401  (before op_db: device bases are computed at import)

    runner = LayoutRunner(max_samples=args.max_samples, grad=False, op_timeout=args.op_timeout)
    return serve(args, lambda op: runner.run_layouts(op, args.dtypes))


def _run_workers(args: argparse.Namespace, keys: list[str],
                 progress: Callable[[list[dict[str, Any]]], None]) -> list[dict[str, Any]]:
    env = worker_env(args)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))

    def command(ids: Path, out: Path) -> list[str]:
        cmd = [sys.executable, "-m", "tests.conformance.layouts", "--worker",
               "--worker-ids", str(ids), "--worker-out", str(out),
               "--dtypes", ",".join(args.dtypes), "--op-timeout", str(args.op_timeout),
               "--max-samples", str(args.max_samples)]
        return cmd + (["--ops", args.ops] if args.ops else [])

    def died(key: str, why: str) -> dict[str, Any]:
        return {"id": key.split(":", 1)[1], "key": key, "cells": {}, "failures": [],
                "tolerances": [], "known": [], "status": "fail", "error": why}

    return run_worker_pool(keys, args.jobs, command, died, env, label="OpInfos",
                           quiet=args.quiet, progress=progress, cwd=ROOT)


# ---- report ----------------------------------------------------------------------------
def write_report(results: list[dict[str, Any]], path: Path, meta: dict[str, Any]) -> dict:
    """The markdown report: totals, every failure and known difference, tolerances, and a
    row per OpInfo with its sample counts."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tot = dict.fromkeys(("pass", "tolerance", "fail", "known", "skip"), 0)
    status = dict.fromkeys(("pass", "known", "fail", "skip"), 0)
    for r in results:
        status[r["status"]] += 1
        for c in r["cells"].values():
            for k in tot:
                tot[k] += c.get(k, 0)
    mode = "strict (TORCHPORT_SIM_STRICT=1)" if meta["strict"] else "default"
    if meta["asynchronous"]:
        mode += ", asynchronous (TORCHPORT_SIM_ASYNC=1)"
    lines = ["# torchport layout sweep: op_db samples in strided layouts, sim vs CPU", "",
             f"Command: `{meta['command']}`  ",
             f"PyTorch {meta['torch']}, sim mode: {mode}, dtypes: {', '.join(meta['dtypes'])}, "
             f"variants: {', '.join(VARIANTS)}, max samples per OpInfo and dtype: "
             f"{meta['max_samples']}, OpInfos: {len(results)} of {meta['selected']}, "
             f"wall time: {meta['seconds']:.0f}s"
             + ("" if meta["complete"] else " -- PARTIAL"), "",
             "Every sample's tensors are made transposed (column-major), `[..., ::2]`, at a "
             "storage offset, and expanded (stride 0), alike on the CPU and on `sim`. "
             "Results and written inputs are compared bit for bit where every overload ran "
             "the CPU's own kernel (`native`/`view` paths); **tolerance** = not the same "
             "bits, within `assert_close`'s tolerances, computed by a decomposition or the "
             "fallback (named); random ops by shape and dtype. A sample whose CPU call "
             "raises in a layout (an op refusing overlapping memory) is skipped.", "",
             "## Totals", "",
             f"OpInfos: {status['pass']} pass, {status['known']} known, {status['fail']} fail, "
             f"{status['skip']} skip.  ",
             f"Samples (per dtype and variant): {tot['pass']} pass, {tot['tolerance']} within "
             f"tolerance, {tot['fail']} fail, {tot['known']} known, {tot['skip']} skip.", "",
             "## Failures", ""]
    fails = [(k, m) for r in results for k, m in r["failures"]] + \
        [(r["id"], r["error"]) for r in results if r.get("error")]
    lines += ["None."] if not fails else \
        ["| OpInfo/dtype/variant | difference |", "|---|---|"] + \
        [f"| {k} | {_md(m or '')} |" for k, m in fails]
    lines += ["", "## Known differences", ""]
    knowns = [x for r in results for x in r["known"]]
    lines += ["None."] if not knowns else \
        ["| OpInfo/dtype/variant | reason | difference |", "|---|---|---|"] + \
        [f"| {k} | {_md(why)} | {_md(m or '')} |" for k, why, m in knowns]
    lines += ["", "## Within tolerance (not the CPU's bits)", ""]
    tols = [x for r in results for x in r["tolerances"]]
    lines += ["None."] if not tols else \
        ["| OpInfo/dtype/variant | reason |", "|---|---|"] + \
        [f"| {k} | {_md(m or '')} |" for k, m in tols]
    lines += ["", "## Per OpInfo", "",
              "Cells: pass/tolerance/fail/skip samples per dtype and variant (fail includes "
              "known).", "",
              "| OpInfo | status | " + " | ".join(VARIANTS) + " | skip reasons |",
              "|---|---|" + "---|" * len(VARIANTS) + "---|"]
    for r in results:
        cells = []
        for v in VARIANTS:
            cs = [c for k, c in r["cells"].items() if k.endswith("/" + v)]
            cells.append(" ".join(f"{c['pass']}/{c['tolerance']}/{c['fail'] + c['known']}/"
                                  f"{c['skip']}" for c in cs) or "-")
        lines.append(f"| {r['id']} | {r['status']} | " + " | ".join(cells) + " | "
                     + _md("; ".join(r.get("skip_reasons", [])), 200) + " |")
    path.write_text("\n".join(lines) + "\n")
    return status


def _md(text: str, limit: int = 300) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:limit]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tests.conformance.layouts", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", help="regular expression over OpInfo names (full match); "
                   "default: every OpInfo")
    p.add_argument("--dtypes", default=",".join(DEFAULT_DTYPES), help="comma-separated dtypes")
    p.add_argument("--max-samples", type=int, default=DEFAULT_MAX_SAMPLES,
                   help="samples per OpInfo and dtype")
    p.add_argument("--op-timeout", type=float, default=120.0, help="seconds per OpInfo")
    add_mode_arguments(p, "layouts", 1)
    a = p.parse_args(argv)
    a.dtypes = [d.strip() for d in a.dtypes.split(",") if d.strip()]
    a.name = report_name(a, "layouts")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return _worker(args)
    import torch

    t0 = time.perf_counter()
    keys = [f"{i}:{opinfo_id(op)}" for i, op in enumerate(select(load_op_db(), args.ops))]
    if not keys:
        print(f"no OpInfo matches {args.ops!r}", file=sys.stderr)
        return 2
    path = Path(args.out) / f"{args.name}.md"

    def meta(done: bool) -> dict[str, Any]:
        return {"command": "python -m tests.conformance.layouts " + " ".join(
            sys.argv[1:] if argv is None else argv), "torch": torch.__version__,
            "strict": args.strict, "asynchronous": args.asynchronous, "dtypes": args.dtypes,
            "max_samples": args.max_samples, "selected": len(keys),
            "seconds": time.perf_counter() - t0, "complete": done}

    results = _run_workers(args, keys, lambda part: write_report(part, path, meta(False)))
    status = write_report(results, path, meta(True))
    print(f"OpInfos: {status['pass']} pass, {status['known']} known, {status['fail']} fail, "
          f"{status['skip']} skip; report in {path}")
    return 1 if status["fail"] else 0


if __name__ == "__main__":
    sys.exit(main())
