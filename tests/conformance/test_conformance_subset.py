"""A representative subset of the OpInfo conformance run (sim vs CPU), in the default suite.

The full run is ``make conformance`` (``python -m torchport.tools.conformance --full``). The
memory modes' stages (device-only memory, asynchronous streams) run one sample fewer per op
and dtype and leave out float64: the modes change where bytes live and when kernels run, which
int64 covers for 8-byte elements, not the arithmetic, which the default stage checks.
"""

import pytest

from tests.helpers import IN_A_MEMORY_MODE
from torchport.tools.conformance import SUBSET, SUBSET_DTYPES, SUBSET_MAX_SAMPLES, run_in_process

DTYPES = tuple(d for d in SUBSET_DTYPES if d != "float64") if IN_A_MEMORY_MODE else SUBSET_DTYPES
SAMPLES = SUBSET_MAX_SAMPLES - 1 if IN_A_MEMORY_MODE else SUBSET_MAX_SAMPLES


@pytest.fixture(scope="module")
def results():
    return run_in_process(SUBSET, DTYPES, max_samples=SAMPLES, op_timeout=120)


def test_subset_has_no_failures(results):
    assert len(results) >= 60
    failures = {r["id"]: r.get("error") or {dt: v.get("errors") for kind in ("dtypes", "grad")
                                           for dt, v in r[kind].items()
                                           if v["status"] == "fail"}
                for r in results if r["status"] == "fail"}
    assert not failures, failures


def test_subset_exercises_every_path(results):
    seen = {p for r in results for p in r["paths"].values()}
    assert {"native", "decomposed", "fallback", "view"} <= seen
    assert sum(r["status"] == "pass" for r in results) >= 50
