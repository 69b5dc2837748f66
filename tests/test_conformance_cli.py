"""``torchport conformance``: the subcommand, ``--full``'s sample cap, samples that never reach
the device, and ``--upstream`` over a small device-generic test file of a fake checkout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import typer
from typer.testing import CliRunner

import torchport.sim  # noqa: F401
from torchport.tools import cli
from torchport.tools.conformance import catalog, upstream
from torchport.tools.conformance import opinfo as conf
from torchport.tools.conformance.runner import Runner

pytestmark = pytest.mark.tools


@pytest.fixture(scope="module")
def app() -> typer.Typer:
    if not cli.app.registered_commands:
        cli._load()
    return cli.app


def test_subcommand_has_the_runners_options(app: typer.Typer) -> None:
    res = CliRunner().invoke(app, ["conformance", "--help"], terminal_width=200)
    assert res.exit_code == 0, res.output
    assert "usage: torchport conformance" in res.output
    for opt in ("--backend", "-b", "--full", "--ops", "--max-samples", "--upstream", "--jobs"):
        assert opt in res.output, opt
    bad = CliRunner().invoke(app, ["conformance", "--full", "--subset"])
    assert bad.exit_code == 2


def test_subcommand_runs_and_writes_reports(app: typer.Typer, tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["conformance", "-b", "sim", "--ops", "abs", "--dtypes",
                                   "float32", "--max-samples", "2", "--no-grad", "--jobs", "1",
                                   "--out", str(tmp_path), "--quiet"])
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "conformance.json").read_text())
    assert data["meta"]["command"].startswith("torchport conformance -b sim --ops abs")
    assert data["meta"]["max_samples"] == 2


def test_full_caps_samples_as_documented() -> None:
    a = conf.parse_args(["--full"])
    assert a.max_samples == catalog.FULL_MAX_SAMPLES == 5
    assert conf.parse_args(["--full", "--max-samples", "9"]).max_samples == 9
    assert "up to 5 per OpInfo" in (Path(__file__).parents[1] / "docs" / "conformance.md"
                                    ).read_text()


def _op(name: str) -> object:
    return next(o for o in catalog.load_op_db() if o.name == name and not o.variant_test_name)


def test_samples_without_a_device_tensor_are_not_run_nor_counted() -> None:
    """``arange(1, 3)`` has no tensor and no device argument: its result is on the CPU in
    both runs (a device check reported it as a failure); such samples are left out and the
    cap counts the others."""
    op = _op("arange")
    torch.manual_seed(0)
    every = list(op.sample_inputs("cpu", torch.float32))
    leaves = [torch.utils._pytree.tree_flatten((s.input, tuple(s.args), dict(s.kwargs)))[0]
              for s in every]
    no_device = [i for i, xs in enumerate(leaves)
                 if not any(isinstance(x, (torch.Tensor, torch.device)) or x == "cpu"
                            for x in xs)]
    assert no_device, "arange's samples changed: pick another op"
    runner = Runner("sim", max_samples=None, grad=False)
    picked = runner._samples(op, torch.float32, False)
    assert len(picked) == len(every) - len(no_device)
    r = runner.run_opinfo(op, ["float32"])["dtypes"]["float32"]
    assert (r["status"], r["samples"], r["failed"]) == ("pass", len(picked), 0), r


def test_the_cap_counts_only_samples_that_reach_the_device() -> None:
    from torch.testing._internal.opinfo.core import SampleInput

    class Op:  # an OpInfo whose first samples pass no tensor
        name = "arange"

        def sample_inputs(self, device: str, dtype: torch.dtype, requires_grad: bool = False):
            yield SampleInput(1, args=(3,))
            yield SampleInput(2)
            for n in range(1, 5):
                yield SampleInput(n, args=(9,), kwargs={"device": device, "dtype": dtype})

    capped = Runner("sim", max_samples=3, grad=False)._samples(Op(), torch.float32, False)
    assert [s.input for s, _ in capped] == [1, 2, 3]
    assert all(s.kwargs["device"] == "cpu" for s, _ in capped)


_TINY = '''
    import torch
    from torch.testing._internal.common_device_type import (
        dtypes, instantiate_device_type_tests, onlyCPU)
    from torch.testing._internal.common_utils import (  # the label: newer than torch 2.13
        HardwareClassification, TestCase, run_tests)


    class TestTiny(TestCase):
        @dtypes(torch.float32, torch.int64)
        def test_add(self, device, dtype):
            x = torch.arange(6, device=device).to(dtype)
            self.assertEqual((x + x).cpu(), torch.arange(6).to(dtype) * 2)

        def test_on_the_cpu_only(self, device):
            self.assertEqual(torch.empty(1, device=device).device.type, "cpu")

        def test_fails_everywhere(self, device):
            raise AssertionError("broken test")

        @onlyCPU
        def test_cpu_specific(self, device):
            pass

        def test_accelerator_only(self, device):
            if torch.device(device).type == "cpu":
                self.skipTest("an accelerator's test")


    class TestNotGeneric(TestCase):
        def test_plain(self):
            pass


    instantiate_device_type_tests(TestTiny, globals())

    if __name__ == "__main__":
        run_tests()
'''


def test_upstream_compares_a_checkouts_device_generic_tests(app: typer.Typer,
                                                             tmp_path: Path) -> None:
    checkout = tmp_path / "pytorch"
    (checkout / "test").mkdir(parents=True)
    (checkout / "test" / "test_tiny.py").write_text(textwrap.dedent(_TINY))
    (checkout / "test" / "conftest.py").write_text("raise RuntimeError('not ours to load')\n")
    (checkout / "pytest.ini").write_text("[pytest]\naddopts = --no-such-option\n")
    out = tmp_path / "reports"
    res = CliRunner().invoke(app, ["conformance", "-b", "sim", "--upstream", str(checkout),
                                   "--upstream-files", "test_tiny.py", "--out", str(out)])
    assert res.exit_code == 1, res.output  # test_on_the_cpu_only fails on sim
    data = json.loads((out / "upstream.json").read_text())
    (f,) = data["files"]
    assert f["cpu_tests"] == 6 and f["cpu_passing"] == 4, f
    tests = {k.split("::")[-1]: v["status"] for k, v in f["tests"].items()}
    assert tests == {"test_add_DEV_float32": "pass", "test_add_DEV_int64": "pass",
                     "test_on_the_cpu_only_DEV": "fail", "test_cpu_specific_DEV": "skip"}
    assert [k.split("::")[-1] for k in f["device_only"]] == ["test_accelerator_only_DEV"]
    assert data["totals"]["pass"] == 2 and data["totals"]["fail"] == 1
    md = (out / "upstream.md").read_text()
    assert "2 of 4 CPU-passing tests pass on sim (1 fail" in md
    assert "test_on_the_cpu_only_DEV" in md and "TestNotGeneric" not in md
    assert "2 of 4 CPU-passing tests pass on sim" in res.output


def test_upstream_without_test_files_is_a_usage_error(app: typer.Typer, tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["conformance", "--upstream", str(tmp_path),
                                   "--out", str(tmp_path / "r")])
    assert res.exit_code == 2
    assert "PyTorch source checkout" in res.output
    assert CliRunner().invoke(app, ["conformance", "--upstream", str(tmp_path),
                                    "--full"]).exit_code == 2


def test_device_free_names_pair_the_two_runs() -> None:
    assert upstream.device_free("t.py::TestFooCPU::test_x_cpu_float32", "cpu") == \
        "t.py::TestFoo::test_x_DEV_float32"
    assert upstream.device_free("t.py::TestFooPRIVATEUSE1::test_x_sim_float32", "sim") == \
        "t.py::TestFoo::test_x_DEV_float32"
    assert upstream.device_free("t.py::TestFooSIM::test_cpu_sim", "sim") == \
        "t.py::TestFoo::test_cpu_DEV"


def test_module_entry_point_still_works(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TORCHPORT_OP_STATS"}
    out = subprocess.run([sys.executable, "-m", "torchport.tools.conformance", "--help"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and "python -m torchport.tools.conformance" in out.stdout
