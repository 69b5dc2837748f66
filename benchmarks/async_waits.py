"""Which ops make the host wait for the stream on the asynchronous sim.

CUDA's host waits for a stream only where it must: a read of device memory (``.item()``,
``.cpu()``), a data-dependent result shape (``nonzero``), a blocking copy from pageable
memory. This runs op_db's samples (the first ``--samples`` of each OpInfo, float32) on the
asynchronous sim, each op once to learn its layouts, then again counting the host's waits
(``Backend.host_sync``), and lists the ops that waited, with the path each call took (a
``fallback`` op has no sim kernel: the CPU computes it, after the stream). Run:

    TORCHPORT_SIM_ASYNC=1 .venv/bin/python benchmarks/async_waits.py [--samples 3] [--only REGEX]
"""

from __future__ import annotations

import argparse
import collections
import re
import warnings

import torch

import torchport.sim  # noqa: F401  (before op_db: device bases are computed at import)
from torchport import ops
from torchport.backend import active_backend
from torchport.tools.conformance.catalog import load_op_db, opinfo_id


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=3)
    p.add_argument("--only", default=None, help="OpInfo ids matching this regex")
    a = p.parse_args()
    backend = active_backend()
    if not backend.runtime.asynchronous:
        raise SystemExit("set TORCHPORT_SIM_ASYNC=1: the synchronous sim never waits")
    warnings.simplefilter("ignore")
    waits: collections.Counter[str] = collections.Counter()
    paths: dict[str, set[str]] = {}
    current: list[str | None] = [None]
    host_sync = backend.host_sync

    def counted(index: int) -> None:
        if current[0] is not None:
            waits[current[0]] += 1
        host_sync(index)

    backend.host_sync = counted  # type: ignore[method-assign]
    ran = failed = 0
    for info in load_op_db():
        name = opinfo_id(info)
        if a.only and not re.fullmatch(a.only, name):
            continue
        try:
            samples = list(info.sample_inputs("sim", torch.float32))[:a.samples]
            for s in samples:
                info(s.input, *s.args, **s.kwargs)
            torch.sim.synchronize()
            current[0] = name
            with ops.record() as rec:
                for s in samples:
                    info(s.input, *s.args, **s.kwargs)
            current[0] = None
            torch.sim.synchronize()
        except Exception:  # an op the sim refuses, or a sample the CPU refuses
            current[0] = None
            failed += 1
            try:
                torch.sim.synchronize()
            except Exception:
                pass
            continue
        ran += 1
        if waits[name]:
            paths[name] = {p for st in rec.ops.values() for p in (st.subpaths or st.paths)}
    backend.host_sync = host_sync  # type: ignore[method-assign]
    print(f"{len(paths)} of {ran} ops waited for the stream ({failed} raised)")
    for name in sorted(paths):
        print(f"  {name:48s} {' '.join(sorted(paths[name]))}")


if __name__ == "__main__":
    main()
