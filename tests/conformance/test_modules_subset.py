"""A representative subset of the nn.Module conformance run (sim vs CPU), in the default suite.

Whole modules reach what single ops do not: fused RNN cells, batch norm running
statistics, the attention fast paths, ``Module.to`` and serialization of device modules.
The full run is ``python -m tests.conformance.modules`` (``make conformance``).
"""

from typing import Any

import pytest

from tests.conformance import modules
from tests.conformance.modules import SUBSET, problems, run_in_process

SUBSET_MAX_SAMPLES = 2


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_in_process(SUBSET, max_samples=SUBSET_MAX_SAMPLES, timeout=120)


def test_subset_has_no_crash_and_no_unexplained_mismatch(results):
    assert {r["id"] for r in results} == {
        "nn.Linear", "nn.Conv2d", "nn.BatchNorm2d", "nn.LayerNorm", "nn.Embedding", "nn.LSTM",
        "nn.GRU", "nn.MultiheadAttention", "nn.TransformerEncoderLayer", "nn.GroupNorm"}
    found = problems(results)
    assert not found, "\n".join(f"{m}: {p[:300]}" for m, ps in found.items() for p in ps)


def test_subset_runs_every_check(results):
    """Every check kind ran somewhere (a harness change cannot silently skip one)."""
    ran = {c for r in results for e in r["entries"] for s in e["samples"]
           for c, v in s["checks"].items() if v["status"] != "skip"}
    assert ran == set(modules.CHECKS) - {"lazy"}
    assert all(r["entries"] and all(e["samples"] for e in r["entries"]) for r in results)


def test_a_mismatch_is_reported_not_passed():
    """The comparison itself: bit for bit, within tolerance, or a failure, and which."""
    import torch

    import torchport.sim  # noqa: F401

    x = torch.linspace(0, 1, 7, dtype=torch.float64)
    assert modules.compare(x.to("sim"), x) == ("bitwise", None)
    st, msg = modules.compare((x * (1 + 1e-9)).to("sim"), x)
    assert st == "close" and "max abs diff" in msg
    assert modules.compare((x + 1e-3).to("sim"), x)[0] == "fail"
    assert modules.compare(x, x)[0] == "fail"  # a result left on the CPU
    # a random module: shape, dtype and device only
    assert modules.compare(torch.rand(7, dtype=torch.float64).to("sim"), x, random=True) \
        == ("meta", None)
    nc = x.to("sim").expand(2, 7).t()
    assert modules.compare(nc, x.expand(2, 7).t().contiguous(), strides=True)[0] == "fail"


def test_known_causes_explain_tolerance_and_never_hide_a_crash(monkeypatch):
    monkeypatch.setattr(modules, "KNOWN", [
        (r"nn\.GRU/.*/forward", "tolerance", "another code path on non-CPU devices"),
        (r"nn\.Foo/.*", "difference", "a legitimate difference"),
        (r"nn\.Bar/.*", "bug", "a diagnosed torchport bug")])

    def result(mid: str, check: str, status: str) -> dict[str, Any]:
        return {"id": mid, "entries": [{"dtype": "float32", "mode": "train", "samples": [
            {"i": 0, "desc": "", "checks": {check: {"status": status, "msg": "m"}}}]}]}

    r = modules.apply_known(result("nn.GRU", "forward", "close"))
    assert r["status"] == "pass" and not problems([r])
    r = modules.apply_known(result("nn.GRU", "forward", "crash"))
    assert r["status"] == "crash" and problems([r])
    r = modules.apply_known(result("nn.Linear", "forward", "close"))
    assert problems([r])  # within tolerance without a reason: the math should be the same
    r = modules.apply_known(result("nn.Foo", "buffers", "fail"))
    assert r["status"] == "known" and not problems([r])
    for status in ("close", "fail"):  # a diagnosis explains nothing away
        r = modules.apply_known(result("nn.Bar", "forward", status))
        assert problems([r]) and "diagnosis" in r["entries"][0]["samples"][0]["checks"]["forward"]


def test_random_module_compares_metadata_only_and_eval_mode_bitwise():
    """A module whose output changes with the seed (dropout in training) cannot match the
    CPU's values: only its structure, shape, dtype and device; in eval mode, its values."""
    import torch

    import torchport.sim  # noqa: F401

    modules.load_module_db()
    from torch.testing import make_tensor
    from torch.testing._internal.common_modules import FunctionInput, ModuleInfo, ModuleInput

    def inputs(mi, device, dtype, requires_grad, training, **kwargs):
        x = make_tensor((4, 5), device=device, dtype=dtype, requires_grad=requires_grad)
        return [ModuleInput(FunctionInput(0.5), forward_input=FunctionInput(x))]

    mi = ModuleInfo(torch.nn.Dropout, module_inputs_func=inputs, train_and_eval_differ=True)
    r = modules.Runner(max_samples=1).run_module(mi)
    by_mode = {(e["dtype"], e["mode"]): e["samples"][0]["checks"] for e in r["entries"]}
    assert set(by_mode) == {(d, m) for d in ("float32", "float64") for m in ("train", "eval")}
    for (_, mode), checks in by_mode.items():
        want = "meta" if mode == "train" else "bitwise"
        assert checks["forward"]["status"] == want
        assert checks["grad_input"]["status"] == want
    assert r["status"] == "pass" and not problems([r])


def test_report_counts_every_check_and_lists_every_difference(tmp_path):
    import json

    def entry(mode: str, **checks: str) -> dict[str, Any]:
        return {"dtype": "float32", "mode": mode, "samples": [
            {"i": 0, "desc": "", "checks": {c: {"status": checks.get(c, "bitwise"),
                                                 "msg": f"{c} message"}
                                             for c in modules.CHECKS}}]}

    results = [modules.apply_known(r) for r in (
        {"id": "nn.A", "entries": [entry("train", forward="close"), entry("eval")]},
        {"id": "nn.B", "entries": [entry("train", pickle="crash", lazy="skip")]},
        {"id": "nn.C", "entries": [], "error": "worker died (exit status -11)"})]
    meta = {"command": "x", "torch": "2.13", "strict": False, "asynchronous": True,
            "max_samples": 3, "seconds": 1.0, "complete": True}
    totals = modules.write_reports(results, tmp_path, meta, "m-test")
    md = (tmp_path / "m-test.md").read_text()
    data = json.loads((tmp_path / "m-test.json").read_text())
    assert totals["modules"] == {"pass": 1, "known": 0, "fail": 0, "crash": 2, "skip": 0}
    assert totals["checks"]["forward"] == {**dict.fromkeys(modules.STATUSES, 0),
                                           "bitwise": 2, "close": 1}
    assert data["totals"]["checks"]["pickle"]["crash"] == 1
    for section in ("## Totals per check", "## Differences", "## Per ModuleInfo",
                    "## Skip reasons", "## Known causes"):
        assert section in md
    assert "| nn.A | forward | close | 1 | float32/train | not explained |" in md
    assert "| nn.B | pickle | crash |" in md and "worker died" in md
    assert "TORCHPORT_SIM_ASYNC=1" in md
