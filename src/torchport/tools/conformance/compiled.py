"""``torch.compile`` on the device against ``torch.compile`` on the CPU, over PyTorch's OpInfos.

The eager run (:mod:`torchport.tools.conformance.opinfo`) checks torchport's op layer; this one
checks what inductor's generated programs compute on the device
(:mod:`torchport.graph.inductor`). For every OpInfo of ``op_db`` and each of its first
samples, ``torch.compile(lambda *a, **k: op(*a, **k), fullgraph=False, dynamic=False)``
runs once on CPU inputs and once on the same inputs on the device, and the two results
(and the inputs the op mutated) are classified:

* **equal**: bit for bit (NaN positions and signed zeros included), same dtype and shape,
  the result on the device. The device compiles the same C++ as the CPU
  (:mod:`torchport.graph.cpu_checks`), so this is the expected class;
* **close**: within ``torch.testing.assert_close``'s default tolerances, not bit for bit:
  a value computed by a different route, e.g. an extern kernel (``mm``, a fallback between
  graphs) the device's op layer runs, or an inductor decision taken by ``device.type``
  that chooses among numerically different forms;
* **both-error**: both raise the same exception type (the op rejects the sample);
* **MISMATCH**: different beyond tolerance, a different dtype, shape, device or
  structure, or one side raises and the other does not (or they raise different types).
  Each mismatch with a known cause is listed in ``compiled_report.KNOWN`` with its diagnosis; an
  undiagnosed one fails the run.

Random ops (the eager CPU result changes with the seed) and ``empty*`` are skipped.
Every OpInfo starts from ``torch._dynamo.reset()``; one compiled function per OpInfo
serves its samples on both devices (``dynamic=False``: one graph per sample and device).

    python -m torchport.tools.conformance.compiled                    # op_db, float32, 2 samples
    python -m torchport.tools.conformance.compiled --ops 'add|mm' --max-samples 4 --dtypes float32,int64
    python -m torchport.tools.conformance.compiled --budget 1500      # stop starting OpInfos after 25 min

Writes ``reports/compiled-opinfo.md`` (``--out``) and the same name with ``.json``. The
work runs in worker processes (``--jobs``): a crash or hang costs one OpInfo. Set
``TORCHINDUCTOR_CACHE_DIR`` to keep the compiled kernels of a run for the next. Exit
status: 0 when no mismatch is undiagnosed.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from torchport.tools.conformance.compiled_report import (
    _RANK,
    CLASSES,
    classify,
    write_report,
)
from torchport.tools.conformance.opinfo import (
    Runner,
    _short,
    _Timeout,
    _uninitialized,
    guarded,
    load_backend,
    load_op_db,
    opinfo_id,
    run_worker_pool,
    select,
    serve,
    worker_env,
)

PROG = "python -m torchport.tools.conformance.compiled"
DEFAULT_DTYPES = ("float32",)
DEFAULT_MAX_SAMPLES = 2
DEFAULT_OUT = "reports/compiled-opinfo.md"

# ---- comparing results -----------------------------------------------------------------
def _root_error(e: BaseException) -> BaseException:
    """The exception an op raised, out of dynamo's and inductor's wrappers."""
    seen = 0
    while seen < 5:
        inner = getattr(e, "inner_exception", None) or getattr(e, "real_exc", None)
        if not isinstance(inner, BaseException):
            return e
        e, seen = inner, seen + 1
    return e


def _bits_equal(a: Any, b: Any) -> bool:
    """Bit for bit, but any NaN equals any NaN (their payloads are not the op's result)."""
    import torch

    a, b = a.resolve_conj().resolve_neg(), b.resolve_conj().resolve_neg()
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    if not a.is_floating_point():
        return bool(torch.equal(a, b))
    an, bn = torch.isnan(a), torch.isnan(b)
    if not torch.equal(an, bn):
        return False
    a, b = a.masked_fill(an, 0), b.masked_fill(bn, 0)
    return bool(torch.equal(a, b)) and bool(torch.equal(torch.signbit(a), torch.signbit(b)))


def _error_size(d: Any, r: Any) -> tuple[float, float, int]:
    """(max absolute error, max relative error, elements that differ) of two CPU tensors of
    one shape and dtype; NaN against a number counts as an infinite error."""
    import torch

    d, r = d.resolve_conj().resolve_neg(), r.resolve_conj().resolve_neg()
    if d.is_complex():
        d, r = torch.view_as_real(d), torch.view_as_real(r)
    d, r = d.double(), r.double()
    nan_d, nan_r = torch.isnan(d), torch.isnan(r)
    same = (d == r) | (nan_d & nan_r)
    diff = (d - r).abs().masked_fill(same, 0).nan_to_num(nan=math.inf)
    rel = (diff / r.abs()).masked_fill(same, 0).nan_to_num(nan=math.inf)
    if diff.numel() == 0:
        return 0.0, 0.0, 0
    return float(diff.max()), float(rel.max()), int((~same).sum())


class Comparison:
    """The class of one sample's results and the size of its worst difference."""

    def __init__(self) -> None:
        self.cls = "equal"
        self.detail: str | None = None
        self.abs_err = 0.0
        self.rel_err = 0.0

    def worse(self, cls: str, detail: str | None = None) -> None:
        if _RANK[cls] > _RANK[self.cls]:
            self.cls, self.detail = cls, detail
        elif cls == self.cls and detail and not self.detail:
            self.detail = detail


# Dynamo skips torchport's own frames (torchport.graph.dynamo_device), so the lambda a user
# writes in a script is made from code that is not in a torchport file.
_USER_CODE = compile("def make(fn):\n    return lambda *a, **k: fn(*a, **k)\n",
                     "<compiled-opinfo>", "exec")


def _user_lambda(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``lambda *a, **k: fn(*a, **k)``, as user code (dynamo traces it)."""
    namespace: dict[str, Any] = {}
    exec(_USER_CODE, namespace)
    return namespace["make"](fn)


class CompiledRunner(Runner):
    """Runs OpInfos compiled on the CPU and compiled on the device (in this process)."""

    def __init__(self, device: str = "sim", max_samples: int | None = DEFAULT_MAX_SAMPLES,
                 op_timeout: float = 240.0) -> None:
        super().__init__(device, max_samples=max_samples, grad=False, op_timeout=op_timeout)
        from torch._dynamo.utils import counters

        self.counters = counters

    def _settings(self) -> contextlib.ExitStack:
        """The compiler's settings while an OpInfo runs."""
        from torch._dynamo import config as dynamo_config
        from torch._functorch import config as functorch_config
        from torch._inductor import config as inductor_config

        stack = contextlib.ExitStack()
        # one OpInfo's graphs: two devices x its samples; more would fall back to eager
        # silently (recompile limit), so say so loudly instead
        stack.enter_context(dynamo_config.patch(recompile_limit=64,
                                                fail_on_recompile_limit_hit=True))
        # no compile worker pool; every graph compiled by the code under test, never loaded
        # from an earlier run's graph caches (the C++ kernel cache, keyed by the kernels'
        # source, stays on)
        stack.enter_context(inductor_config.patch(compile_threads=1, fx_graph_cache=False))
        stack.enter_context(functorch_config.patch(enable_autograd_cache=False))
        return stack

    def _graphs(self) -> int:
        return self.counters["stats"]["unique_graphs"]

    def _compare(self, cmp: Comparison, dev: Any, ref: Any, what: str,
                 same_device: bool = False, check_device: bool = True) -> None:
        torch = self.torch
        d_leaves, d_spec = self.pytree.tree_flatten(dev)
        r_leaves, r_spec = self.pytree.tree_flatten(ref)
        if d_spec != r_spec:
            cmp.worse("MISMATCH", f"{what}: structure {d_spec} vs {r_spec}")
            return
        for i, (d, r) in enumerate(zip(d_leaves, r_leaves, strict=True)):
            label = f"{what}[{i}]" if len(r_leaves) > 1 else what
            if not isinstance(r, torch.Tensor):
                if isinstance(d, torch.Tensor):
                    cmp.worse("MISMATCH", f"{label}: a tensor where the CPU gives {r!r}")
                elif not (d == r or isinstance(d, float) and isinstance(r, float)
                          and math.isnan(d) and math.isnan(r)):
                    close = isinstance(d, float | int) and isinstance(r, float | int) \
                        and math.isclose(d, r, rel_tol=1.3e-6, abs_tol=1e-5)
                    cmp.worse("close" if close else "MISMATCH", f"{label}: {d!r} vs {r!r}")
                continue
            if not isinstance(d, torch.Tensor):
                cmp.worse("MISMATCH", f"{label}: {type(d).__name__} where the CPU gives a tensor")
                continue
            want = self.device if r.device.type == "cpu" and not same_device \
                else r.device.type
            if check_device and d.device.type != want:
                cmp.worse("MISMATCH", f"{label}: on {d.device}, expected {want}")
                continue
            if d.dtype != r.dtype or d.shape != r.shape:
                cmp.worse("MISMATCH", f"{label}: {d.dtype}{list(d.shape)} vs "
                          f"{r.dtype}{list(r.shape)}")
                continue
            if r.layout != torch.strided:
                continue  # compared as the eager run does not: strided outputs only
            dc = d.cpu()
            if d.numel() > 1 and d.stride() != r.stride():
                cmp.worse("MISMATCH", f"{label}: strides {d.stride()} vs {r.stride()}")
            if _bits_equal(dc, r):
                continue
            a, rel, n = _error_size(dc, r)
            cmp.abs_err, cmp.rel_err = max(cmp.abs_err, a), max(cmp.rel_err, rel)
            try:
                torch.testing.assert_close(dc, r, equal_nan=True, check_stride=False)
            except AssertionError:
                cmp.worse("MISMATCH", f"{label}: {n}/{r.numel()} elements differ, max abs "
                          f"{a:.3g}, max rel {rel:.3g}")
            else:
                cmp.worse("close", f"{label}: {n}/{r.numel()} elements differ, max abs "
                          f"{a:.3g}, max rel {rel:.3g}")

    def _depends_on_rng(self, op: Any, bundle: tuple) -> bool:
        """Whether the eager CPU result changes with the seed (or without it)."""
        torch = self.torch
        outs = []
        for seed in (1234, 4321):
            torch.manual_seed(seed)
            try:
                outs.append(self._call(op, self._clone_cpu(bundle)))
            except Exception:
                return False  # the compiled runs show what happens
        cmp = Comparison()
        self._compare(cmp, outs[1], outs[0], "output", same_device=True)
        return cmp.cls != "equal"

    def compiled(self, op: Any) -> Callable[..., Any]:
        """The function compiled for one OpInfo (its samples, both devices)."""
        return self.torch.compile(_user_lambda(op.op), fullgraph=False, dynamic=False)

    def run_compiled_sample(self, op: Any, sample: Any, fn: Callable[..., Any],
                            keep_cpu: frozenset[int] = frozenset()) -> dict[str, Any]:
        """One sample: ``{"class", "detail", "abs", "rel", "graphs"}`` (``graphs``: the
        graphs inductor compiled for the device's run)."""
        torch = self.torch
        bundle = (sample.input, tuple(sample.args), dict(sample.kwargs))
        if _uninitialized(op):
            return {"class": "skip", "detail": "uninitialized memory (empty*)"}
        if self._depends_on_rng(op, bundle):
            return {"class": "skip", "detail": "random op: the result depends on the RNG"}

        def call(b: tuple) -> tuple[Any, BaseException | None]:
            inp, args, kwargs = b
            torch.manual_seed(1234)
            try:
                return fn(inp, *args, **kwargs), None
            except _Timeout:
                raise
            except Exception as e:
                return None, e

        torch._dynamo.reset()  # so that the device's run compiles its own graphs (counted)
        cpu_in = self._clone_cpu(bundle)
        ref, cpu_err = call(cpu_in)
        dev_in = self._to_dev(bundle, keep_cpu=keep_cpu)
        before = self._graphs()
        out, dev_err = call(dev_in)
        graphs = self._graphs() - before
        res: dict[str, Any] = {"graphs": graphs}
        if cpu_err is not None or dev_err is not None:
            if cpu_err is None or dev_err is None:
                which, e = ("CPU", cpu_err) if dev_err is None else (self.device, dev_err)
                return {**res, "class": "MISMATCH",
                        "detail": f"only the {which} raises: {_short(_root_error(e))}"}
            a, b = _root_error(cpu_err), _root_error(dev_err)
            if type(a) is not type(b):
                return {**res, "class": "MISMATCH", "detail": f"the CPU raises {_short(a)}; "
                        f"{self.device} raises {_short(b)}"}
            return {**res, "class": "both-error", "detail": _short(a)}
        cmp = Comparison()
        try:
            self._compare(cmp, out, ref, "output")
            self._compare(cmp, self._tensors(dev_in), self._tensors(cpu_in), "input",
                          check_device=False)  # where the sample put them
        except _Timeout:
            raise
        except Exception as e:  # a comparison that cannot be made is a finding too
            cmp.worse("MISMATCH", f"comparing: {_short(e)}")
        res.update({"class": cmp.cls, "detail": cmp.detail})
        if cmp.cls in ("close", "MISMATCH"):
            res.update({"abs": cmp.abs_err, "rel": cmp.rel_err})
        return res

    def run_compiled_opinfo(self, op: Any, dtypes: Sequence[str]) -> dict[str, Any]:
        """Results of one OpInfo for the asked dtypes: per dtype, its samples' results."""
        torch = self.torch
        t0 = time.perf_counter()
        torch._dynamo.reset()
        self.counters.clear()
        out: dict[str, Any] = {"id": opinfo_id(op), "name": op.name, "dtypes": {}}
        supported = op.supported_dtypes("cpu")
        settings = self._settings()
        try:
            with guarded(out, self.op_timeout, self.tops):
                fn = self.compiled(op)
                for name in dtypes:
                    dt = getattr(torch, name)
                    if dt not in supported:
                        out["dtypes"][name] = {"skip": "dtype not supported by the op on CPU"}
                        continue
                    try:
                        samples = self._samples(op, dt, False)
                    except Exception as e:
                        out["dtypes"][name] = {"skip": f"no samples ({_short(e)})"}
                        continue
                    if not samples:
                        out["dtypes"][name] = {"skip": "no samples"}
                        continue
                    entry: dict[str, Any] = {"samples": []}
                    out["dtypes"][name] = entry
                    for s, keep in samples:
                        entry["samples"].append(self.run_compiled_sample(op, s, fn, keep))
        finally:
            settings.close()
            torch._dynamo.reset()
        out["seconds"] = round(time.perf_counter() - t0, 3)
        return classify(out)


def run_in_process(pattern: str | None, dtypes: Sequence[str] = DEFAULT_DTYPES,
                   max_samples: int | None = DEFAULT_MAX_SAMPLES, op_timeout: float = 240.0,
                   backend: str = "sim") -> list[dict[str, Any]]:
    """Run the selected OpInfos compiled on CPU and on ``backend`` here."""
    runner = CompiledRunner(load_backend(backend), max_samples=max_samples,
                            op_timeout=op_timeout)
    return [runner.run_compiled_opinfo(op, dtypes) for op in select(load_op_db(), pattern)]


# ---- workers and command line ------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", "-b", default="sim", help="the backend under test (as "
                   "torchport run -b)")
    p.add_argument("--ops", help="regular expression over OpInfo names (full match; "
                   "default: every OpInfo)")
    p.add_argument("--dtypes", default=",".join(DEFAULT_DTYPES), help="comma-separated dtypes")
    p.add_argument("--max-samples", type=int, default=DEFAULT_MAX_SAMPLES,
                   help="samples per OpInfo and dtype")
    p.add_argument("--op-timeout", type=float, default=240.0, help="seconds per OpInfo")
    p.add_argument("--budget", type=float, default=0.0, help="wall seconds after which no "
                   "OpInfo starts (reported as not run); 0: no limit")
    p.add_argument("--out", default=DEFAULT_OUT, help="the markdown report (and .json beside)")
    p.add_argument("--strict", action="store_true", help="TORCHPORT_SIM_STRICT=1")
    p.add_argument("--async", dest="asynchronous", action="store_true",
                   help="TORCHPORT_SIM_ASYNC=1")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-ids", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.dtypes = [d.strip() for d in a.dtypes.split(",") if d.strip()]
    if a.backend != "sim" and (a.strict or a.asynchronous):
        p.error("--strict and --async are modes of the sim backend")
    import torch
    for d in a.dtypes:
        if not isinstance(getattr(torch, d, None), torch.dtype):
            p.error(f"unknown dtype {d!r}")
    return a


def _worker(args: argparse.Namespace) -> int:
    device = load_backend(args.backend)  # before op_db: device bases are computed at import
    runner = CompiledRunner(device, max_samples=args.max_samples, op_timeout=args.op_timeout)

    def run(op: Any) -> dict[str, Any]:
        if args.deadline and time.time() > args.deadline:
            return {"id": opinfo_id(op), "name": op.name, "dtypes": {}, "not_run": True,
                    "class": "skip"}
        return runner.run_compiled_opinfo(op, args.dtypes)

    return serve(args, run)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return _worker(args)
    import torch

    t0 = time.perf_counter()
    device = load_backend(args.backend)
    keys = [f"{i}:{opinfo_id(op)}" for i, op in enumerate(select(load_op_db(), args.ops))]
    if not keys:
        print(f"no OpInfo matches {args.ops!r}", file=sys.stderr)
        return 2
    deadline = time.time() + args.budget if args.budget else 0.0
    mode = "TORCHPORT_SIM_STRICT=1 (device-only memory)" if args.strict else \
        "default (host-addressable)"
    if args.asynchronous:
        mode += ", TORCHPORT_SIM_ASYNC=1 (kernels queued on stream workers)"

    def meta(done: bool) -> dict[str, Any]:
        return {"command": PROG + " " + " ".join(sys.argv[1:] if argv is None else argv),
                "torch": torch.__version__, "device": device, "mode": mode,
                "dtypes": args.dtypes, "max_samples": args.max_samples, "ops": args.ops,
                "budget": args.budget, "jobs": args.jobs, "complete": done,
                "seconds": time.perf_counter() - t0, "opinfos_selected": len(keys)}

    def command(ids: Path, out: Path) -> list[str]:
        cmd = [sys.executable, "-m", "torchport.tools.conformance.compiled", "--worker",
               "--backend", args.backend, "--worker-ids", str(ids), "--worker-out", str(out),
               "--dtypes", ",".join(args.dtypes), "--op-timeout", str(args.op_timeout),
               "--max-samples", str(args.max_samples), "--deadline", str(deadline)]
        return cmd + (["--ops", args.ops] if args.ops else [])

    def died(key: str, why: str) -> dict[str, Any]:
        oid = key.split(":", 1)[1]
        return classify({"id": oid, "name": oid, "dtypes": {}, "key": key, "error": why})

    report = Path(args.out)
    results = run_worker_pool(
        keys, args.jobs, command, died, worker_env(args), label="OpInfos", quiet=args.quiet,
        progress=lambda part: write_report(part, report, meta(False)))
    tot = write_report(results, report, meta(True))
    o = tot["opinfos"]
    print("OpInfos: " + ", ".join(f"{o[c]} {c}" for c in CLASSES)
          + f"; not run: {tot['not_run']}; mismatches: {tot['mismatches']} "
          f"({tot['undiagnosed']} undiagnosed); report: {report}")
    return 1 if tot["undiagnosed"] else 0


if __name__ == "__main__":
    sys.exit(main())
