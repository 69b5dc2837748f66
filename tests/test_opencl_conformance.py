"""The conformance runner on the OpenCL backend (``--backend opencl``), as a vendor runs it
on theirs: native kernels and the CPU fallback both pass against the CPU, dropout (its own
generator) passes its property checks, and the report says which path each overload took."""

import json
import subprocess
import sys

import pytest

from tests.opencl_support import ROOT, worker_env

pytestmark = [pytest.mark.opencl, pytest.mark.opencl_full]


def test_conformance_subset_passes_with_native_and_fallback_paths(tmp_path):
    pytest.importorskip("pyopencl", reason="the opencl extra is not installed")
    cmd = [sys.executable, "-m", "torchport.tools.conformance", "--backend", "opencl", "--ops",
           "add|mm|sum|cumsum|nn.functional.dropout", "--dtypes", "float32,int64",
           "--max-samples", "3", "--jobs", "1", "--out", str(tmp_path), "--quiet"]
    run = subprocess.run(cmd, cwd=ROOT, env=worker_env(), capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads((tmp_path / "conformance.json").read_text())
    assert report["meta"]["device"] == "ocl" and report["meta"]["backend"] == "opencl"
    statuses = {r["id"]: r["status"] for r in report["results"]}
    assert set(statuses.values()) == {"pass"}, statuses
    assert {"add", "mm", "sum", "cumsum", "nn.functional.dropout"} <= set(statuses), statuses
    paths = report["totals"]["overload_paths"]
    for overload in ("add.Tensor", "mm", "sum.dim_IntList", "native_dropout"):
        assert paths[overload] == "native", (overload, paths)
    assert {v for k, v in paths.items() if k.startswith("cumsum")} == {"fallback"}, paths
    dropout = next(r for r in report["results"] if r["id"] == "nn.functional.dropout")
    # the third sample is random (p=0.5 in training): checked by its properties
    assert dropout["dtypes"]["float32"]["passed"] == 3, dropout
    assert dropout["grad"]["float32"]["passed"] == 3, dropout
    assert "## Property checks" in (tmp_path / "conformance.md").read_text()
