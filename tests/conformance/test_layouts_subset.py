"""A fast subset of the layout sweep (``python -m tests.conformance.layouts``): op_db samples
made transposed, ``[..., ::2]``, offset and expanded, sim against CPU, in the default suite.
The ops: normalisations (the CPU's ``native_batch_norm.out`` leaves its saved statistics
unwritten for strided inputs, which the sweep found), softmax, reductions, matrix
products, ``cat`` and the index ops."""

import pytest

from tests.conformance.layouts import run_in_process

SUBSET = (r"native_batch_norm|nn\.functional\.batch_norm|nn\.functional\.layer_norm|"
          r"nn\.functional\.group_norm|softmax|sum|mm|addmm|cat|index_select|index_add|"
          r"index_copy|index_put|index_fill|gather|scatter_add")


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_in_process(SUBSET, ("float32",), max_samples=3, op_timeout=60)


def test_layout_subset_has_no_failures(results: list[dict]) -> None:
    assert len(results) >= 15
    failures = {r["id"]: r.get("error") or r["failures"] for r in results
                if r["status"] == "fail"}
    assert not failures, failures


def test_layout_subset_runs_batch_norm_on_every_layout(results: list[dict]) -> None:
    # the samples that found the bug: each layout really ran (not skipped) and passed
    cells = {r["id"]: r["cells"] for r in results}
    for oid in ("native_batch_norm", "nn.functional.batch_norm"):
        for variant in ("transposed", "strided", "offset", "expanded"):
            c = cells[oid][f"float32/{variant}"]
            assert c["pass"] > 0 and c["fail"] == 0, (oid, variant, c)
