"""The conformance report's bookkeeping: known failures stay visible, skips keep reasons."""

import json
import re

from torchport.conformance import opinfo as run


def _result(oid, fwd, grad=None):
    r = {"id": oid, "name": oid, "dtypes": fwd, "grad": grad or {}, "paths": {"add.Tensor":
         "native"}, "path_counts": {"add.Tensor": {"native": 2}, "sin": {"fallback": 1}}}
    return run.apply_known(r)


def _fail(msg="AssertionError: not close"):
    return {"status": "fail", "samples": 2, "passed": 0, "failed": 2, "skipped": 0,
            "errors": [msg], "skip_reasons": []}


def _pass():
    return {"status": "pass", "samples": 2, "passed": 2, "failed": 0, "skipped": 0,
            "errors": [], "skip_reasons": []}


def test_known_limitation_is_counted_apart_never_passed():
    r = _result("to_sparse", {"float32": _fail(), "float64": _pass()})
    assert r["dtypes"]["float32"]["status"] == "known"
    assert "sparse" in r["dtypes"]["float32"]["known"]["reason"]
    assert r["dtypes"]["float64"]["status"] == "pass"
    assert r["status"] == "known"


def test_known_entries_never_touch_passing_results():
    r = _result("to_sparse", {"float32": _pass()})
    assert r["status"] == "pass" and "known" not in r["dtypes"]["float32"]


def test_a_diagnosed_bug_stays_a_failure(monkeypatch):
    monkeypatch.setattr(run, "KNOWN", [*run.KNOWN, (r"fft\.ihfft/float32/grad", "bug",
                                                    "a diagnosed bug")])
    r = _result("fft.ihfft", {"float32": _pass()}, {"float32": _fail()})
    assert r["grad"]["float32"]["status"] == "fail"
    assert r["grad"]["float32"]["known"]["kind"] == "bug"
    assert r["status"] == "fail"


def test_unknown_failure_stays_a_failure():
    r = _result("add", {"bfloat16": _fail()})
    assert r["status"] == "fail" and "known" not in r["dtypes"]["bfloat16"]


def test_report_lists_failures_known_paths_and_skips(tmp_path):
    results = [
        _result("add", {"float32": _pass(), "bfloat16": _fail(),
                        "bool": {"status": "skip", "reason": "dtype not supported by the op "
                                 "on CPU"}}),
        _result("to_sparse", {"float32": _fail()}),
    ]
    meta = {"command": "x", "torch": "2.13", "strict": True, "dtypes": ["float32", "bfloat16",
            "bool"], "max_samples": 5, "seconds": 1.0, "complete": True}
    totals = run.write_reports(results, tmp_path, meta, "conf-test")
    md = (tmp_path / "conf-test.md").read_text()
    data = json.loads((tmp_path / "conf-test.json").read_text())
    assert totals["opinfos"] == {"pass": 0, "known": 1, "fail": 1, "skip": 0}
    assert data["totals"]["dtypes_all"]["known"] == 1
    for section in ("## Totals", "## Core ATen ops by path", "## Failures", "## Known failures",
                    "## Per OpInfo", "## Path per overload", "## Skip reasons"):
        assert section in md
    assert "| add | bfloat16 | not diagnosed |" in md
    assert "dtype not supported by the op on CPU" in md
    # a core op on the fallback path is shown, per overload and in the core section
    assert "| **sin** |  |  |  | 2 |" in md
    assert "| fallback | 1 | sin |" in md
    assert "TORCHPORT_SIM_STRICT=1" in md


def test_report_of_another_backend_names_it(tmp_path):
    """A vendor's run (``--backend``) names its device and backend where the sim's gives
    its memory mode; the sim's own report keeps its header."""
    meta = {"command": "x", "torch": "2.13", "strict": False, "dtypes": ["float32"],
            "max_samples": 2, "seconds": 1.0, "complete": True, "device": "mychip",
            "backend": "mychip_torchport"}
    results = [_result("add", {"float32": _pass()}), _result("to_sparse", {"float32": _fail()})]
    run.write_reports(results, tmp_path, meta, "v")
    md = (tmp_path / "v.md").read_text()
    assert md.startswith("# torchport conformance: mychip vs CPU over PyTorch's OpInfo database")
    assert "backend: mychip_torchport" in md and "sim memory" not in md
    assert "Each sample runs on the CPU and on `mychip`" in md
    assert "| to_sparse | float32 | limitation | sparse layouts:" in md
    # the text describes the backend under test: it never says sim for it
    assert not re.search(r"\bsim\b", md), [ln for ln in md.splitlines()
                                            if re.search(r"\bsim\b", ln)]
