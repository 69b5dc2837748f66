"""Op coverage (``torchport.tools.debug.opcoverage``, ``torchport coverage``): run and static modes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torchport.sim  # noqa: F401
from tests.helpers import run_python
from torchport import ops
from torchport.tools.debug import coverage
from torchport.tools.debug.opcoverage import PATH_ORDER, CoverageResult, OpCoverage, run_coverage

pytestmark = pytest.mark.tools

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "coverage"
TRAIN = DATA / "train_small.py"
STATIC = DATA / "model_static.py"


def _train_step() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 4)).to("sim")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 8).to("sim"), torch.randn(16, 4).to("sim")
    for _ in range(2):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    loss.item()


@pytest.fixture
def forced_addmm():
    old = ops.force_fallback_patterns()
    ops.set_force_fallback(["addmm"])
    warn = ops.set_fallback_warn(False)
    yield
    ops.set_force_fallback(old)
    ops.set_fallback_warn(warn)


def _by_name(rec: ops.Recorder) -> dict[str, tuple[int, dict[str, int]]]:
    return {n: (s.calls, dict(s.paths)) for n, s in rec.ops.items() if s.calls}


def _merged(paths: dict[str, int]) -> dict[str, int]:
    """Coverage's paths as the op statistics count them (torchport's kernels are native)."""
    out = {p: n for p, n in paths.items() if p != "torchport"}
    if paths.get("torchport"):
        out["native"] = out.get("native", 0) + paths["torchport"]
    return out


def test_context_manager_matches_op_record():
    with ops.record():  # the first recorded step makes one-time tensors (this file alone)
        _train_step()
    with ops.record(composites=True) as rec:
        _train_step()
    with coverage() as cov:
        _train_step()
    assert isinstance(cov, CoverageResult) and cov.mode == "run" and cov.backend == "sim"
    assert {o.name: (o.calls, _merged(o.paths)) for o in cov.ops} == _by_name(rec)
    for o in cov.ops:
        assert o.path == rec.path_of(o.name) or o.paths.get("fallback") or \
            o.path == "torchport" and rec.subpaths_of(o.name).get("native:torchport")
    assert cov.path_of("addmm") == "native" and cov.op("addmm").dtypes == ["float32"]
    assert cov.calls_per_path()["native"] > 0
    assert sum(cov.calls_per_path().values()) == sum(o.calls for o in cov.ops)


def test_forced_fallback_on_top(forced_addmm):
    with coverage() as cov:
        _train_step()
    assert cov.path_of("addmm") == "fallback"
    assert [o.name for o in cov.fallback_ops] == ["addmm"]
    rows = cov.rows()
    assert rows[0].name == "addmm"
    order = [PATH_ORDER.index(o.path) for o in rows]
    assert order == sorted(order)  # grouped: fallback, decomposed, native, view
    assert cov.forced_fallback == ["addmm"]
    text = cov.text()
    assert text.index("addmm") < text.index("mm ")
    assert re.search(rf"fallback\s+1\s+{cov.op('addmm').calls}\s", text), text


def test_run_coverage_script_matches_record_and_json(tmp_path):
    from torchport.tools.run import exec_main

    args = ["--steps", "2"]
    with ops.record(composites=True) as rec:
        exec_main(str(TRAIN), args, restore=True)
    res = run_coverage(str(TRAIN), args)
    assert res.exit_code == 0 and res.error is None and res.script == str(TRAIN)
    assert {o.name: (o.calls, _merged(o.paths)) for o in res.ops} == _by_name(rec)
    back = CoverageResult.from_dict(json.loads(res.to_json()))
    assert [o.to_dict() for o in back.rows()] == [o.to_dict() for o in res.rows()]
    failed = run_coverage(str(TRAIN), ["--steps", "1", "--exit", "5"])
    assert failed.exit_code == 5 and failed.ops  # ops are still reported


def test_cli_html_json_and_exit_codes(tmp_path, forced_addmm):
    from typer.testing import CliRunner

    from torchport.tools import cli

    if not cli.app.registered_commands:
        cli._load()
    app = cli.app
    html, js = tmp_path / "cov.html", tmp_path / "cov.json"
    runner = CliRunner()
    res = runner.invoke(app, ["coverage", "--html", str(html), "--json", str(js),
                              str(TRAIN), "--steps", "1"])
    assert res.exit_code == 0, res.output
    assert "fallback" in res.output and "addmm" in res.output
    page = html.read_text()
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page and "bar-fallback" in page
    assert "Host time per path" in page and '<table class="ops">' in page
    first_op = page.index('<tr class="op ')
    assert page[first_op:].startswith('<tr class="op op-fallback"') and "addmm" in page
    assert "<script" not in page and "http://" not in page.replace(
        'xmlns="http://www.w3.org/2000/svg"', "")  # self-contained
    data = json.loads(js.read_text())
    assert data["ops"][0]["name"] == "addmm" and data["ops"][0]["path"] == "fallback"
    assert data["totals"]["calls"]["fallback"] == data["ops"][0]["calls"]

    res = runner.invoke(app, ["coverage", "--fail-on-fallback", "-q", str(TRAIN), "--steps", "1"])
    assert res.exit_code == 3, res.output
    res = runner.invoke(app, ["coverage", "-q", str(TRAIN), "--steps", "1", "--exit", "4"])
    assert res.exit_code == 4
    res = runner.invoke(app, ["coverage", str(tmp_path / "missing.py")])
    assert res.exit_code == 2
    res = runner.invoke(app, ["coverage", "--no-such-option", str(TRAIN)])
    assert res.exit_code == 2


def test_static_no_device_memory():
    torch.sim.synchronize()
    before = torch.sim.memory_reserved(), torch.sim.memory_allocated()
    res = run_coverage(str(STATIC), static=True)
    assert (torch.sim.memory_reserved(), torch.sim.memory_allocated()) == before
    assert res.mode == "static" and res.exit_code == 0
    names = {o.name: o.path for o in res.ops}
    assert names["convolution"] == "native" and names["convolution_backward"] == "native"
    assert names["addmm"] == "native" and names["relu"] == "native"
    assert names["t"] == "composite" and names["randn"] == "native"
    assert res.stopped_at and "model_static.py:12" in res.stopped_at
    assert "_local_scalar_dense" in res.stopped_at
    assert all(o.host_time_s == 0 for o in res.ops)


def test_static_classifies_like_a_run(forced_addmm):
    """The paths a static trace predicts are the ones a real run takes (common overloads)."""
    with coverage(static=True) as st:
        _train_step()  # stops at loss.item(): the exception is swallowed, stopped_at says so
    assert st.stopped_at and "_local_scalar_dense" in st.stopped_at
    with coverage() as run:
        _train_step()
    common = {o.name for o in st.ops} & {o.name for o in run.ops}
    assert {"addmm", "mm", "relu"} <= common
    for name in common:
        assert st.path_of(name) == run.path_of(name), name
    assert st.path_of("addmm") == "fallback"


def test_static_block_fake_tensors_cpu_real():
    with coverage(static=True) as cov:
        cpu = torch.arange(4.0) * 2  # CPU work runs for real
        x = torch.ones(3, device="sim") + cpu[:3].to("sim")
        assert x.device.type == "sim" and cpu.tolist() == [0.0, 2.0, 4.0, 6.0]
    assert cov.stopped_at is None
    assert {"ones", "add.Tensor", "_to_copy"} <= {o.name for o in cov.ops}
    assert "arange" not in {o.name for o in cov.ops}  # not device work


def test_static_subprocess_cli(tmp_path):
    """A fresh process: nothing was ever allocated on the device."""
    js = tmp_path / "s.json"
    code = ("import sys, torch, torchport.sim\n"
            "from torchport.tools.debug.cli_coverage import main\n"
            "sys.argv = ['torchport coverage', '--static', '--json', sys.argv[1], sys.argv[2]]\n"
            "try:\n    main()\n"
            "except SystemExit as e:\n"
            "    print('RESERVED', torch.sim.memory_reserved(), 'EXIT', e.code)\n")
    out = run_python(code, args=[js, STATIC], timeout=120)
    assert "RESERVED 0 EXIT 0" in out.stdout, out.stdout + out.stderr[-2000:]
    assert "static" in out.stdout and "convolution" in out.stdout
    assert "after item" not in out.stdout
    assert json.loads(js.read_text())["mode"] == "static"


def test_summary_and_rows_order():
    r = CoverageResult(ops=[OpCoverage("a", 3, {"native": 3}, ["float32"], 0.5),
                            OpCoverage("b", 2, {"native": 1, "fallback": 1}, [], 0.1),
                            OpCoverage("c", 1, {"view": 1}, [], 0.0),
                            OpCoverage("d", 1, {"decomposed": 1}, [], 0.2)])
    assert [o.name for o in r.rows()] == ["b", "d", "a", "c"]
    assert r.time_per_path()["fallback"] == pytest.approx(0.05)
    assert r.summary().startswith("4 overloads, 7 calls, 1 fall back to CPU (b)")


def test_cuda_script_transfer_auto(tmp_path):
    """A script naming CUDA runs on the device (transfer on by default), then transfer is off."""
    from torchport import transfer

    script = tmp_path / "cuda_script.py"
    script.write_text("import torch\nx = torch.ones(4, device='cuda') * 3\n"
                      "assert x.device.type == 'sim'\nprint(x.sum().item())\n")
    res = run_coverage(str(script))
    assert res.exit_code == 0, res.error
    assert {"mul.Tensor", "sum.dim_IntList"} <= {o.name for o in res.ops}  # x.sum(), as on CUDA
    assert not transfer.is_enabled()
    off = run_coverage(str(script), transfer=False)
    assert off.exit_code == 1 and off.error  # no CUDA on this machine without transfer


def test_static_html_report(tmp_path):
    res = run_coverage(str(STATIC), static=True)
    page = res.write_html(tmp_path / "s.html").read_text()
    assert "Calls per path" in page and "<svg" in page and "static trace" in page
    assert "Static trace at" in page and "_local_scalar_dense" in page
    assert "host ms" not in page  # no timings for a trace that ran nothing


def test_accelerator_script_runs_on_the_device_by_default(tmp_path):
    """Scripts written against torch.accelerator (no "cuda" in their text) with a pinned
    DataLoader: transfer is on by default, so they run as a CUDA user's script would."""
    script = tmp_path / "accel.py"
    script.write_text(
        "import torch\n"
        "from torch.utils.data import DataLoader, TensorDataset\n"
        "dev = torch.accelerator.current_accelerator() if torch.accelerator.is_available() "
        "else torch.device('cpu')\n"
        "ds = TensorDataset(torch.arange(8.0).view(4, 2))\n"
        "kwargs = {'batch_size': 2, 'pin_memory': True}\n"
        "total = sum((b.to(dev, non_blocking=True) * 2).sum().item() for (b,) in "
        "DataLoader(ds, **kwargs))\n"
        "assert total == 56.0, total\n")
    res = run_coverage(str(script))
    assert res.exit_code == 0, res.error
    assert res.device_ops and res.op("mul.Tensor") is not None


def test_no_device_op_is_not_silent(tmp_path):
    """A script that computed only on the CPU measured nothing: say so, exit 4."""
    from typer.testing import CliRunner

    from torchport.tools import cli

    if not cli.app.registered_commands:
        cli._load()
    script = tmp_path / "cpu_only.py"
    script.write_text("import torch\nprint((torch.ones(3) * 2).sum().item())\n")
    res = run_coverage(str(script))
    assert res.exit_code == 0 and not res.device_ops
    assert "no op ran on the sim device" in res.text()
    out = CliRunner().invoke(cli.app, ["coverage", str(script)])
    assert out.exit_code == 4, out.output
    assert "no op ran on the sim device" in out.output


def test_ops_of_child_processes_are_included(tmp_path):
    """A script whose device work runs in processes it starts (mp.spawn workers, a
    subprocess): the children register the backend (TORCHPORT_AUTOLOAD) and report their
    ops to the coverage run, which would otherwise have measured nothing."""
    (tmp_path / "child.py").write_text(
        "import torch\nx = torch.ones(3, device='cuda')\nprint((x * 2).sum().item())\n")
    script = tmp_path / "parent.py"
    script.write_text("import subprocess, sys\n"
                      "subprocess.run([sys.executable, 'child.py'], check=True, cwd=sys.path[0])\n")
    res = run_coverage(str(script))
    assert res.exit_code == 0, res.error
    assert res.child_processes == 1 and res.op("mul.Tensor") is not None
    assert "1 child processes included" in res.summary()


def test_torchport_kernels_apart_from_the_backends() -> None:
    """Allocation and copies are torchport's own kernels (path ``torchport``; sub-path
    ``native:torchport`` in the op statistics), the backend's kernels ``native``."""
    x = torch.randn(4, 5)
    with ops.record() as rec, coverage() as cov:
        d = x.to("sim")
        torch.empty(3, device="sim")
        (d + 1).cpu()
    assert cov.path_of("_to_copy") == "torchport"
    assert cov.path_of("empty.memory_format") == "torchport"
    assert cov.path_of("add.Tensor") == "native"
    assert rec.subpaths_of("_to_copy") == {"native:torchport": 2}
    assert "native:torchport" not in rec.subpaths_of("add.Tensor")
    assert rec.path_of("_to_copy") == "native"  # the path stays: a kernel ran on the device
    assert "(torchport:2)" in rec.table()
    assert "torchport" in cov.text() and cov.ops_per_path()["torchport"] == 2


def test_composites_are_listed() -> None:
    """Ops PyTorch computes by a composite kernel never reach the backend under their name:
    coverage lists them (path ``composite``), their pieces on their own rows."""
    from torchport.ops import stats

    def step() -> None:
        o = torch.ones(2, 3, device="sim")
        o.t().sum()

    with ops.record() as plain, coverage() as cov:
        step()
    composite = {o.name for o in cov.ops if o.path == "composite"}
    assert {"ones", "t", "sum"} <= composite, cov.text()
    assert not composite & set(plain.ops)  # invisible to the backend's records
    assert cov.path_of("sum.dim_IntList") == "native"  # sum's piece
    for name in composite:
        base, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, base), overload or "default")
        assert stats.computed_by_composite(op), name
    assert not stats.computed_by_composite(torch.ops.aten.add.Tensor)  # the sim's kernel
    assert "computed by PyTorch's composites" in cov.summary()
    with coverage(composites=False) as off:
        step()
    assert not {o.name for o in off.ops} & composite


def test_composite_without_a_device_kernel_is_visible(tmp_path: Path) -> None:
    """A backend without a ``flip`` kernel: PyTorch's composite computes ``rot90`` from
    other ops; coverage names it (and the op its pieces fell back on). ``native_layer_norm``,
    which the CPU and CUDA compute with kernels of their own, is no composite on a device
    either: without a kernel it takes the CPU's."""
    walk = Path(__file__).resolve().parents[1] / "examples" / "vendor_walkthrough"
    script = tmp_path / "ln.py"
    script.write_text("import torch\nx = torch.randn(4, 8, device='walk')\n"
                      "torch.nn.functional.layer_norm(x, (8,)).sum().item()\n"
                      "torch.rot90(x).sum().item()\n")
    out = tmp_path / "cov.json"
    proc = subprocess.run([sys.executable, "-m", "torchport.tools.debug.cli_coverage", "-b",
                           "backend", "--json", str(out), "-q", str(script)], cwd=walk,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    paths = {o["name"]: o["path"] for o in json.loads(out.read_text())["ops"]}
    assert paths["rot90"] == "composite" and paths["flip"] == "fallback", paths
    assert paths["native_layer_norm"] == "fallback", paths
    assert paths["empty.memory_format"] == "torchport", paths
