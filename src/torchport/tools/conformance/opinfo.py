"""Conformance of a torchport device against the CPU, over PyTorch's OpInfo database.

For every OpInfo of ``op_db`` and every sample input (per dtype) the op runs on
the CPU and on the backend's device (``--backend``, default ``sim``); results are
compared with ``torch.testing.assert_close`` (PyTorch's per-dtype tolerances),
mutated inputs too, and gradients for OpInfos that support autograd (float32/float64). Ops whose CPU result changes
with the seed (random ops) or is uninitialised memory (``empty*``) are
compared by shape, dtype and device; random ops declared in ``PROPERTIES`` (dropout) by
what their results must satisfy, as a device's generator is its own.
The path each overload took (native kernel, decomposition, CPU fallback) comes
from :mod:`torchport.ops.stats`. Failures with a known cause (``KNOWN``) are reported
as "known" with their reason, counted apart from passes and failures.

``torchport conformance`` is the same command. ``--full`` runs up to 5 samples per OpInfo and
dtype (``--max-samples``); a sample that passes the op no tensor and no device is not run.
``--upstream DIR`` runs PyTorch's own device-generic test files of a PyTorch checkout instead
(:mod:`torchport.tools.conformance.upstream`).

    python -m torchport.tools.conformance                 # the representative subset, on sim
    python -m torchport.tools.conformance --full          # every OpInfo (long)
    python -m torchport.tools.conformance --ops 'add|mul' --dtypes float32,int64 --max-samples 4
    python -m torchport.tools.conformance --strict        # TORCHPORT_SIM_STRICT=1 (device-only memory)
    python -m torchport.tools.conformance --async         # TORCHPORT_SIM_ASYNC=1 (queued kernels)
    python -m torchport.tools.conformance --backend mychip_torchport --subset --ops 'add|mm'

``--backend`` takes what ``torchport run -b`` takes: ``sim``, a ``torchport.backends``
package name, or a module path whose import registers the backend (imported in every
worker process before ``op_db``).

Writes ``reports/conformance.{json,md}`` (``reports/conformance-strict.{json,md}``
with ``--strict``, ``conformance-async`` with ``--async``; ``--out``/``--name`` change
that). The work runs
in worker processes (``--jobs``): a crash or hang of one op costs that op, not
the run. Exit status: 0 when nothing failed.

This module is the command line; the run is in ``catalog`` (what is run, what is known),
``runner`` (one OpInfo), ``workers`` (the worker processes) and ``report``. Their names are
importable from here too (the drivers in ``tests/conformance`` and ``compiled`` use them).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# the run's names, importable from here as before the split (the drivers use them)
from torchport.tools.conformance.catalog import (  # noqa: F401
    DEFAULT_DTYPES,
    FULL_MAX_SAMPLES,
    GRAD_DTYPES,
    KNOWN,
    PROG,
    PROPERTIES,
    SUBSET,
    SUBSET_DTYPES,
    SUBSET_MAX_SAMPLES,
    _overall,
    _stub_expecttest,
    apply_known,
    known_cause,
    load_op_db,
    opinfo_id,
    property_kind,
    select,
)
from torchport.tools.conformance.report import (  # noqa: F401
    _STATUSES,
    _cell,
    _md,
    _reason,
    core_overloads_by_slot,
    summarize,
    write_reports,
)
from torchport.tools.conformance.runner import (  # noqa: F401
    Runner,
    _alarm,
    _short,
    _Timeout,
    _uninitialized,
    guarded,
    load_backend,
    run_in_process,
)
from torchport.tools.conformance.upstream import DEFAULT_FILES as UPSTREAM_FILES
from torchport.tools.conformance.workers import (  # noqa: F401
    _keys,
    _read_worker,
    _run_workers,
    _worker,
    run_worker_pool,
    serve,
    worker_env,
    worker_path,
)


# ---- command line --------------------------------------------------------------------
def add_mode_arguments(p: argparse.ArgumentParser, report: str, jobs: int) -> None:
    """The options every driver of this package shares: the sim mode (``--strict``,
    ``--async``), worker processes, the report's place and name, and the worker side."""
    p.add_argument("--strict", action="store_true", help="TORCHPORT_SIM_STRICT=1 (device-only "
                   "memory)")
    p.add_argument("--async", dest="asynchronous", action="store_true",
                   help="TORCHPORT_SIM_ASYNC=1 (kernels queued on stream workers)")
    p.add_argument("--jobs", type=int, default=jobs, help="worker processes")
    p.add_argument("--out", default=str(Path.cwd() / "reports"), help="report directory "
                   "(default: reports/ in the current directory)")
    p.add_argument("--name", help=f"report file name without extension (default: {report}, "
                   f"{report}-strict with --strict, {report}-async with --async)")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-ids", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)


def report_name(a: argparse.Namespace, report: str) -> str:
    """``--name``, or the report's name for the sim mode."""
    return a.name or "-".join([report] + ["strict"] * a.strict + ["async"] * a.asynchronous)


def parse_args(argv: Sequence[str] | None = None, prog: str = PROG) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", "-b", default="sim", help="the backend under test: sim, a "
                   "torchport.backends name, or a module path (as torchport run -b)")
    p.add_argument("--full", action="store_true", help="every OpInfo of op_db")
    p.add_argument("--subset", action="store_true", help="the representative subset's dtypes "
                   "and samples (" + ",".join(SUBSET_DTYPES) + f"; {SUBSET_MAX_SAMPLES} "
                   "samples), over its OpInfos or those of --ops (the default without --ops "
                   "and --full)")
    p.add_argument("--ops", help="regular expression over OpInfo names (full match)")
    p.add_argument("--dtypes", help="comma-separated dtypes (default: "
                   + ",".join(DEFAULT_DTYPES) + ")")
    p.add_argument("--max-samples", type=int, default=None, help="samples per OpInfo and dtype "
                   f"(default: {FULL_MAX_SAMPLES}, {SUBSET_MAX_SAMPLES} with --subset); samples "
                   "that pass the op no tensor and no device are not run")
    p.add_argument("--upstream", metavar="DIR", help="instead of the OpInfos: PyTorch's own "
                   "device-generic test files from the PyTorch source checkout DIR (DIR/test/), "
                   "run on the CPU and on the device and compared test by test "
                   "(reports/upstream.{json,md})")
    p.add_argument("--upstream-files", metavar="FILES", help="comma-separated test files of "
                   "--upstream (default: those of " + ", ".join(UPSTREAM_FILES) + " it has)")
    p.add_argument("-k", dest="upstream_k", metavar="EXPR",
                   help="--upstream: pytest's -k expression selecting tests")
    p.add_argument("--upstream-timeout", type=float, default=3600.0, metavar="S",
                   help="--upstream: seconds per test file and device (--op-timeout: per test)")
    p.add_argument("--no-grad", action="store_true", help="skip the gradient checks")
    p.add_argument("--op-timeout", type=float, default=600.0, help="seconds per OpInfo")
    add_mode_arguments(p, "conformance", os.cpu_count() or 1)
    a = p.parse_args(argv)
    a.prog = prog
    a.argv = list(sys.argv[1:] if argv is None else argv)
    if a.upstream is not None:
        a.upstream_files = [f.strip() for f in (a.upstream_files or "").split(",") if f.strip()]
        a.name = a.name or "upstream"
        if a.full or a.subset or a.ops or a.dtypes or a.max_samples is not None or a.no_grad:
            p.error("--upstream runs PyTorch's test files: --full, --subset, --ops, --dtypes, "
                    "--max-samples and --no-grad are OpInfo options")
        if a.strict or a.asynchronous:
            p.error("--strict and --async are not modes of --upstream: set "
                    "TORCHPORT_SIM_STRICT=1 or TORCHPORT_SIM_ASYNC=1 instead")
        return a
    if a.upstream_files or a.upstream_k:
        p.error("--upstream-files and -k go with --upstream")
    if isinstance(a.dtypes, str):
        a.dtypes = [d.strip() for d in a.dtypes.split(",") if d.strip()]
    if a.full and a.subset:
        p.error("--full and --subset exclude each other")
    if a.backend != "sim" and (a.strict or a.asynchronous):
        p.error("--strict and --async are modes of the sim backend")
    if a.full:
        a.ops = a.ops or None
        a.dtypes = a.dtypes or list(DEFAULT_DTYPES)
        if a.max_samples is None:
            a.max_samples = FULL_MAX_SAMPLES
    elif a.subset or not a.ops and not a.worker:
        a.ops = a.ops or SUBSET
        a.dtypes = a.dtypes or list(SUBSET_DTYPES)
        if a.max_samples is None:
            a.max_samples = SUBSET_MAX_SAMPLES
    a.dtypes = a.dtypes or list(DEFAULT_DTYPES)
    a.name = report_name(a, "conformance")
    import torch
    for d in a.dtypes:
        if not isinstance(getattr(torch, d, None), torch.dtype):
            p.error(f"unknown dtype {d!r}")
    return a


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    args = parse_args(argv, prog)
    if args.worker:
        return _worker(args)
    import torch

    t0 = time.perf_counter()
    device = load_backend(args.backend)  # a backend that does not load fails here, once
    if args.upstream is not None:
        from torchport.tools.conformance import upstream

        return upstream.run(args, device)
    keys = _keys(args.ops)
    if not keys:
        print(f"no OpInfo matches {args.ops!r}", file=sys.stderr)
        return 2
    def meta(done: bool) -> dict[str, Any]:
        return {"command": prog + " " + " ".join(args.argv), "torch": torch.__version__,
            **({} if device == "sim" else {"device": device, "backend": args.backend}),
            "strict": args.strict, "asynchronous": args.asynchronous, "dtypes": args.dtypes,
            "max_samples": args.max_samples,
            "ops": args.ops if args.ops != SUBSET else "subset", "jobs": args.jobs,
            "seconds": time.perf_counter() - t0, "complete": done,
            "opinfos_selected": len(keys)}

    results = _run_workers(  # partial reports every minute, in case the run is cut short
        args, keys, lambda part: write_reports(part, Path(args.out), meta(False), args.name))
    totals = write_reports(results, Path(args.out), meta(True), args.name)
    o, f = totals["opinfos"], totals["dtypes_all"]
    print(f"OpInfos: {o['pass']} pass, {o['known']} known, {o['fail']} fail, {o['skip']} skip; "
          f"forward (OpInfo, dtype): {f['pass']} pass, {f['known']} known, {f['fail']} fail, "
          f"{f['skip']} skip; reports in {args.out}/{args.name}.{{json,md}}")
    return 1 if o["fail"] else 0


if __name__ == "__main__":
    sys.exit(main())
