"""Dump comparison (API and ``torchport compare-dumps``) and per-module comparison."""

import copy
import json
import math

import pytest
import torch
from typer.testing import CliRunner

import torchport.ops as ops
import torchport.tools.cli
from torchport.ops import registry
from torchport.tools import debug
from torchport.tools.debug.compare import DumpFormatError, tensor_diff

pytestmark = pytest.mark.tools

A = torch.ops.aten


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Hardshrink(0.1),
                               torch.nn.Linear(8, 2))


def _wrong_hardshrink(x, lambd=0.5):
    return torch.nn.functional.hardshrink(x.cpu(), lambd).mul(1.5).to(x.device)


class _Perturbed:
    """A wrong hardshrink kernel on the device while the block runs."""

    def __init__(self, backend):
        self.backend = backend

    def __enter__(self):
        self.lib = torch.library.Library("aten", "IMPL")
        self.lib.impl("hardshrink", registry.wrap_kernel(self.backend, A.hardshrink.default,
                                                         _wrong_hardshrink), "PrivateUse1")

    def __exit__(self, *exc):
        self.lib._destroy()


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """CPU reference dump, a good device dump and one with a perturbed kernel."""
    import torchport.sim
    old = ops.set_fallback_warn(False)
    root = tmp_path_factory.mktemp("dumps")
    m = _model()
    x = torch.randn(3, 4)
    with debug.dump(root / "cpu", device="cpu"):
        m(x).sum().backward()
    md = copy.deepcopy(m).to("sim")
    with debug.dump(root / "good"):
        md(x.to("sim")).sum().backward()
    with _Perturbed(torchport.sim.BACKEND), debug.dump(root / "bad"):
        md(x.to("sim")).sum().backward()
    ops.set_fallback_warn(old)
    return root


def test_identical_runs_no_divergence(dumps):
    r = debug.compare_dumps(dumps / "good", dumps / "cpu")
    assert r.ok and r.first_divergent is None
    paired = [row for row in r.rows if row.index_a is not None and row.index_b is not None]
    assert {row.op for row in paired} >= {"addmm", "mm"}
    assert all(row.cosine == pytest.approx(1.0) for row in paired if row.cosine is not None)
    assert "no divergence" in r.summary()
    assert any(row.status == "only in A" and row.op == "_to_copy" for row in r.rows)


def test_perturbed_kernel_first_divergent_call(dumps):
    r = debug.compare_dumps(dumps / "bad", dumps / "cpu")
    first = r.first_divergent
    assert first is not None and first.op == "hardshrink"
    manifest = [json.loads(x) for x in (dumps / "bad" / "manifest.jsonl").read_text().splitlines()]
    idx = next(c["index"] for c in manifest[1:] if c["op"] == "hardshrink")
    assert first.index_a == idx
    assert first.max_rel == pytest.approx(0.5) and first.max_abs > 0 and first.mismatched > 0
    assert "inputs differ" not in first.note
    # everything before it matched
    before = r.rows[:r.rows.index(first)]
    assert before and all(not row.divergent for row in before)
    # loose tolerances hide the perturbation
    assert debug.compare_dumps(dumps / "bad", dumps / "cpu", rtol=1.0, atol=10.0).ok


def test_reports(dumps, tmp_path):
    r = debug.compare_dumps(dumps / "bad", dumps / "cpu")
    md = r.to_markdown()
    assert md.startswith("# torchport op dump comparison") and "| #A | #B | op |" in md
    assert "**diverged**" in md and "first divergent call: hardshrink" in md
    html = r.to_html()
    assert html.startswith("<!DOCTYPE html>") and 'class="first"' in html and "hardshrink" in html
    assert r.write_report(tmp_path / "r.html").read_text() == html
    assert r.write_report(tmp_path / "r.md").read_text() == md


def test_bad_input(tmp_path):
    with pytest.raises(DumpFormatError, match="no such directory"):
        debug.compare_dumps(tmp_path / "missing", tmp_path)
    with pytest.raises(DumpFormatError, match="manifest"):
        debug.compare_dumps(tmp_path, tmp_path)
    (tmp_path / "manifest.jsonl").write_text("not json\n")
    with pytest.raises(DumpFormatError, match="bad JSON"):
        debug.compare_dumps(tmp_path, tmp_path)


def test_cli_exit_codes_and_reports(dumps, tmp_path):
    torchport.tools.cli._load()
    runner = CliRunner()
    app = torchport.tools.cli.app
    r = runner.invoke(app, ["compare-dumps", "--help"])
    assert r.exit_code == 0 and "--rtol" in r.output and "--report" in r.output
    r = runner.invoke(app, ["compare-dumps", str(dumps / "good"), str(dumps / "cpu")])
    assert r.exit_code == 0, r.output
    assert "no divergence" in r.output
    out = tmp_path / "report.md"
    r = runner.invoke(app, ["compare-dumps", str(dumps / "bad"), str(dumps / "cpu"),
                            "--report", str(out)])
    assert r.exit_code == 1, r.output
    assert "first divergent call: hardshrink" in " ".join(r.output.split())
    assert "hardshrink" in out.read_text()
    out_html = tmp_path / "report.html"
    r = runner.invoke(app, ["compare-dumps", str(dumps / "bad"), str(dumps / "cpu"),
                            "--rtol", "1", "--atol", "10", "--report", str(out_html)])
    assert r.exit_code == 0 and out_html.read_text().startswith("<!DOCTYPE html>")
    r = runner.invoke(app, ["compare-dumps", str(tmp_path / "nope"), str(dumps / "cpu")])
    assert r.exit_code == 2
    r = runner.invoke(app, ["compare-dumps", str(dumps / "good"), str(dumps / "cpu"),
                            "--report", str(tmp_path / "r.txt")])
    assert r.exit_code == 2


def test_compare_modules_names_first_module(sim_backend):
    old = ops.set_fallback_warn(False)
    try:
        m = _model().to("sim")
        x = torch.randn(3, 4)
        good = debug.compare_modules(m, x)
        assert good.ok and good.first_divergent is None
        assert {r.name for r in good.rows} >= {"0", "1", "2", "(model)", "0.weight", "2.bias"}
        with _Perturbed(sim_backend):
            bad = debug.compare_modules(m, x)
            fwd_only = debug.compare_modules(m, x, backward=False)
    finally:
        ops.set_fallback_warn(old)
    first = bad.first_divergent
    assert first is not None and first.name == "1" and first.kind == "output"
    assert [r.name for r in bad.rows if r.kind == "output" and r.divergent][0] == "1"
    assert not next(r for r in bad.rows if r.name == "0").divergent
    assert any(r.kind == "grad" and r.divergent for r in bad.rows)
    assert all(r.kind != "grad" for r in fwd_only.rows)
    text = bad.summary()
    assert text.startswith("first divergent module: 1 (output)")
    assert all(p.grad is None for p in m.parameters())  # the model's grads are untouched


def test_tensor_diff_rules():
    a = torch.tensor([1.0, float("nan"), float("inf"), 2.0])
    assert tensor_diff(a, a.clone()).ok
    d = tensor_diff(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5]))
    assert not d.ok and d.mismatched == 1 and d.max_abs == pytest.approx(0.5)
    assert d.max_rel == pytest.approx(0.2)
    assert tensor_diff(torch.tensor([1.0]), torch.tensor([1.0 + 1e-7])).ok  # float32 default rtol
    assert not tensor_diff(torch.tensor([1, 2]), torch.tensor([1, 3])).ok  # integers exact
    s = tensor_diff(torch.zeros(2), torch.zeros(3))
    assert not s.ok and s.reason.startswith("shape")
    assert not tensor_diff(torch.zeros(2), torch.zeros(2, dtype=torch.float64)).ok
    z = tensor_diff(torch.tensor([1.0]), torch.tensor([0.0]))
    assert math.isinf(z.max_rel)


def test_a_binary_manifest_is_bad_input(dumps, tmp_path):
    bad = tmp_path / ("a-long-directory-name-" * 4)  # the message keeps its path whole
    bad.mkdir()
    (bad / "manifest.jsonl").write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe binary")
    with pytest.raises(DumpFormatError, match="not a text manifest"):
        debug.compare_dumps(bad, dumps / "cpu")
    torchport.tools.cli._load()
    r = CliRunner().invoke(torchport.tools.cli.app, ["compare-dumps", str(bad), str(dumps / "cpu")])
    assert r.exit_code == 2 and "not a text manifest" in r.output, r.output
    assert str(bad / "manifest.jsonl") in r.output, r.output


def test_a_truncated_tensor_file_is_not_no_divergence(dumps, tmp_path):
    import shutil
    damaged = tmp_path / "damaged"
    shutil.copytree(dumps / "good", damaged)
    manifest = [json.loads(x) for x in (damaged / "manifest.jsonl").read_text().splitlines()]
    name = next(c["file"] for c in manifest[1:] if c.get("file") and c["op"].startswith("addmm"))
    data = (damaged / name).read_bytes()
    (damaged / name).write_bytes(data[: len(data) // 2])
    r = debug.compare_dumps(damaged, dumps / "cpu")
    assert not r.ok and r.unreadable and r.unreadable[0].op.startswith("addmm")
    assert "unreadable" in r.summary() and "no divergence among the readable calls" in r.summary()
    torchport.tools.cli._load()
    res = CliRunner().invoke(torchport.tools.cli.app, ["compare-dumps", str(damaged), str(dumps / "cpu")])
    assert res.exit_code == 2, res.output
