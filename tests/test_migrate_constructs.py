"""``torchport migrate`` on the constructs real CUDA scripts use beyond the obvious ones.

Device strings outside the classic device positions (f-strings, conditional
expressions, names and attributes that do not say "device"), ``.cuda(x)`` for
every kind of ``x``, the backend import only where the device is used,
``pin_memory`` in a kwargs dict kept as written, a report naming everything left
unported, and ``--analyse`` reporting a crashed script as a failure.

The project in ``tests/data/migrate/project`` (pytorch/examples style: argparse,
``torch.accelerator``, ``.cuda(device)``, DataLoader options in a dict, a
checkpoint reloaded with ``map_location=f"cuda:{rank}"``, a CPU-only helper
module) is migrated once; the migrated scripts then run with plain
``.venv/bin/python`` (no ``torchport.transfer``) and their numbers are compared
with a CPU run of the originals. To keep this fast, one interpreter imports torch
and forks a fresh child per run, so each script starts from a bare ``import
torch`` as it would in its own process.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import typer
from typer.testing import CliRunner

from tests.helpers import run_python
from torchport.tools.debug import opcoverage
from torchport.tools.migrate import migrate_path, migrate_source, rewrite_source
from torchport.tools.migrate.cli import register

pytestmark = pytest.mark.tools

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ROOT / "tests" / "data" / "migrate" / "project"
BACKEND_IMPORT = 'import torchport.sim  # noqa: F401  registers the "sim" device\n'


def migrated(code: str) -> str:
    """``code`` migrated, without the backend import line."""
    new, _ = migrate_source(textwrap.dedent(code))
    return new.replace(BACKEND_IMPORT, "")


def findings(code: str) -> list[tuple[int, str, str]]:
    result = rewrite_source(textwrap.dedent(code), path="train.py")
    return [(f.line, f.kind, f.api) for f in result.findings]


def mismatches(cases: list[tuple[str, str]], prefix: str = "import torch\n") -> list[str]:
    """The cases whose migration differs from the expectation (all of them are checked)."""
    out = []
    for before, after in cases:
        got = migrated(prefix + textwrap.dedent(before))
        want = prefix + textwrap.dedent(after)
        if got != want:
            out.append(f"{before!r}\n  gave {got[len(prefix):]!r}\n  want {after!r}")
    return out


# --------------------------------------------------------------------------- device strings


def test_device_strings_outside_the_known_device_positions() -> None:
    cases = [
        ('dev = "cuda"\n', 'dev = "sim"\n'),
        ('map_location = "cuda:0"\n', 'map_location = "sim:0"\n'),
        ('args.accel = "cuda"\n', 'args.accel = "sim"\n'),
        ('loc = f"cuda:{rank}"\n', 'loc = f"sim:{rank}"\n'),
        ('loc = "cuda:%d" % rank\n', 'loc = "sim:%d" % rank\n'),
        ('dev = "cuda" if torch.cuda.is_available() else "cpu"\n',
         'dev = "sim" if torch.sim.is_available() else "cpu"\n'),
        ("def pick():\n    return 'cuda' if torch.cuda.is_available() else 'cpu'\n",
         "def pick():\n    return 'sim' if torch.sim.is_available() else 'cpu'\n"),
        ('def run(model, dev="cuda:1"): ...\n', 'def run(model, dev="sim:1"): ...\n'),
        ('cfg = {"accel": "cuda", "cuda_version": "12.1"}\n',
         'cfg = {"accel": "sim", "cuda_version": "12.1"}\n'),
        ('trainer = Trainer(accel="cuda")\n', 'trainer = Trainer(accel="sim")\n'),
        ('p.add_argument("--accel", default="cuda", choices=["cuda", "cpu"])\n',
         'p.add_argument("--accel", default="sim", choices=["sim", "cpu"])\n'),
        ('for d in ("cuda:0", "cpu"):\n    pass\n', 'for d in ("sim:0", "cpu"):\n    pass\n'),
        ('dev = os.environ.get("DEVICE", "cuda")\n', 'dev = os.environ.get("DEVICE", "sim")\n'),
        ('get = lambda: "cuda"\n', 'get = lambda: "sim"\n'),
        ('dist_backend = "nccl"\n', 'dist_backend = "simccl"\n'),
        ('opts = {"ddp": "nccl"}\n', 'opts = {"ddp": "simccl"}\n'),
    ]
    wrong = mismatches(cases)
    assert not wrong, "\n".join(wrong)


def test_comparisons_follow_the_device_strings_they_test() -> None:
    # CUDA's answer is the spec: after migration the device type is "sim"
    cases = [
        ('dev = "cuda"\nif dev == "cuda":\n    pass\n', 'dev = "sim"\nif dev == "sim":\n    pass\n'),
        ('args.accel = "cuda"\nok = args.accel != "cuda"\n',
         'args.accel = "sim"\nok = args.accel != "sim"\n'),
        ('d = pick()\nx = x.to(d)\nif d == "cuda":\n    pass\n',
         'd = pick()\nx = x.to(d)\nif d == "sim":\n    pass\n'),
        ('p.add_argument("--accel", default="cuda")\nif opt.accel == "cuda":\n    pass\n',
         'p.add_argument("--accel", default="sim")\nif opt.accel == "sim":\n    pass\n'),
        ('ok = str(w.device).startswith("cuda")\n', 'ok = str(w.device).startswith("sim")\n'),
        ('on_gpu = "cuda" in str(w.device)\n', 'on_gpu = "sim" in str(w.device)\n'),
    ]
    wrong = mismatches(cases)
    assert not wrong, "\n".join(wrong)


def test_strings_that_merely_mention_cuda_are_left_and_exact_ones_reported() -> None:
    code = """\
    import logging
    import torch
    logging.info("using cuda")
    print(f"cuda:{rank} is ready")
    stats = {"cuda": 1, "cuda_version": "12.1"}
    hits = stats["cuda"]
    if name == "cuda":
        log("cuda")
    x = torch.ones(1).cuda()
    """
    new = migrated(code)
    body = textwrap.dedent(code).replace("torch.ones(1).cuda()", 'torch.ones(1).to("sim")')
    assert new == body
    left = [(line, api) for line, kind, api in findings(code) if kind == "unsupported"]
    assert left == [(5, '"cuda"'), (6, '"cuda"'), (7, '"cuda"'), (8, '"cuda"')]


# --------------------------------------------------------------------------- .cuda(x)


def test_cuda_method_argument_of_every_kind() -> None:
    cases = [
        # a torch.device, a device string, an int, None: all proven by their binding
        ('device = torch.device("cuda", 0)\nm.cuda(device)\n',
         'device = torch.device("sim", 0)\nm.to(device)\n'),
        ('dev = "cuda:1"\nm.cuda(dev)\n', 'dev = "sim:1"\nm.to(dev)\n'),
        ('rank = int(os.environ["LOCAL_RANK"])\nm.cuda(rank)\n',
         'rank = int(os.environ["LOCAL_RANK"])\nm.to(f"sim:{rank}")\n'),
        ("def f(m, gpu: int):\n    return m.cuda(gpu)\n",
         'def f(m, gpu: int):\n    return m.to(f"sim:{gpu}")\n'),
        ('p.add_argument("--gpu", type=int, default=0)\nm.cuda(args.gpu)\n',
         'p.add_argument("--gpu", type=int, default=0)\nm.to(f"sim:{args.gpu}")\n'),
        ("m.cuda(torch.device(type='cuda', index=1))\n",
         "m.to(torch.device(type='sim', index=1))\n"),
        # may be None: .cuda(None) is the current device, .to(None) would not move
        ("def f(m, device=None):\n    return m.cuda(device)\n",
         'def f(m, device=None):\n    return m.to("sim" if device is None else device)\n'),
        ("if args.gpu is not None:\n    m.cuda(args.gpu, non_blocking=True)\n",
         "if args.gpu is not None:\n    m.to(args.gpu, non_blocking=True)\n"),
    ]
    wrong = mismatches(cases)
    assert not wrong, "\n".join(wrong)


def test_migrated_cuda_method_moves_to_the_device_for_every_argument_kind() -> None:
    """The rewritten call, run: what CUDA's .cuda(x) does, on the device."""
    new = migrated("""\
        import torch
        def move(t, device=None):
            return t.cuda(device)
    """)
    namespace: dict[str, Any] = {}
    exec(compile(new, "moved.py", "exec"), namespace)
    for arg in (None, 0, "sim:0", torch.device("sim", 0), torch.device("sim")):
        moved = namespace["move"](torch.ones(2), arg)
        assert moved.device.type == "sim" and moved.device.index in (0, None), arg
        assert torch.equal(moved.cpu(), torch.ones(2))


# --------------------------------------------------------------------------- backend import


def test_cpu_only_modules_do_not_get_the_backend_import() -> None:
    cpu_only = "import numpy as np\nimport torch\n\n\ndef double(x):\n    return x * 2\n"
    assert migrate_source(cpu_only) == (cpu_only, [])
    library = "import torch\n\n\ndef acc(logits, y):\n    return (logits.argmax(1) == y).float()\n"
    assert migrate_source(library) == (library, [])
    # ...but a module asking for the current accelerator runs on the backend
    accel = "import torch\n\ndevice = torch.accelerator.current_accelerator()\n"
    assert BACKEND_IMPORT in migrate_source(accel)[0]
    # ...and so does a script whose device comes from its command line
    script = ("import sys\nimport torch\n\nif __name__ == '__main__':\n"
              "    print(torch.ones(1, device=torch.device(sys.argv[1])))\n")
    assert BACKEND_IMPORT in migrate_source(script)[0]


# --------------------------------------------------------------------------- pin_memory


def test_pin_memory_in_a_kwargs_dict_is_kept_as_written() -> None:
    """The device has pinned host memory: only the generic torch.cuda mapping applies."""
    code = """\
    import torch
    cuda_kwargs = {"num_workers": 1,
                   "pin_memory": True,
                   "shuffle": True}
    kwargs = dict(batch_size=8, pin_memory=use_cuda)
    kwargs["pin_memory"] = torch.cuda.is_available()
    loader = torch.utils.data.DataLoader(ds, **cuda_kwargs)
    """
    result = rewrite_source(textwrap.dedent(code), path="train.py")
    assert isinstance(result.code, str)
    assert '"pin_memory": True,' in result.code
    assert "dict(batch_size=8, pin_memory=use_cuda)" in result.code
    assert 'kwargs["pin_memory"] = torch.sim.is_available()' in result.code
    changes = [(c.line, c.rule, c.before, c.after) for c in result.changes
               if c.rule != "backend-import"]
    assert changes == [(6, "torch.cuda", "torch.cuda.is_available", "torch.sim.is_available")]

# --------------------------------------------------------------------------- findings


UNPORTED = """\
import os
import torch
import torch.nn as nn
from setuptools import Extension

os.environ["NCCL_DEBUG"] = "INFO"
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
torch.backends.cudnn.benchmark = True
if torch.version.cuda is not None and torch.backends.cudnn.is_available():
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
to_gpu = torch.Tensor.cuda
prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
weights = weights.type("torch.cuda.FloatTensor")
register("cuda", "nccl")
ext = Extension("k", sources=["kernel.cu"])
scaler = torch.amp.GradScaler()


class Wrapper(nn.Module):
    def cuda(self, device=None):
        return super().cuda(device)
open_on("cuda:%d" % rank)
"""


def test_everything_left_unported_is_reported_with_its_line() -> None:
    got = {(line, api) for line, _, api in findings(UNPORTED)}
    assert got >= {
        (6, "NCCL_DEBUG"),
        (7, "PYTORCH_CUDA_ALLOC_CONF"),
        (8, "torch.backends.cudnn.benchmark"),
        (9, "torch.version.cuda"),
        (9, "torch.backends.cudnn.is_available"),
        (11, "torch.Tensor.cuda"),
        (12, "torch.profiler.ProfilerActivity.CUDA"),
        (13, '"torch.cuda.FloatTensor"'),
        (14, '"cuda"'),
        (14, '"nccl"'),
        (15, "kernel.cu"),
        (20, "Wrapper.cuda"),
        (22, '"cuda:%d"'),  # a device string built where no device is known to go
    }, sorted(got)
    # GradScaler's device defaults to "cuda": it is given the backend instead
    assert 'scaler = torch.amp.GradScaler("sim")' in migrated(UNPORTED)


def _migrate_app() -> typer.Typer:
    """The migrate command on an app of its own (as the torchport app has it)."""
    app = typer.Typer()

    @app.callback()
    def main() -> None:
        """Stand-in for the torchport app."""

    register(app)
    return app


def test_cli_needs_attention_lists_every_finding(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.py").write_text(UNPORTED)
    app = _migrate_app()
    report = tmp_path / "report"
    outcome = CliRunner().invoke(
        app, ["migrate", str(tmp_path / "src"), "-o", str(tmp_path / "out"), "--report",
              str(report)], env={"COLUMNS": "400"})
    assert outcome.exit_code == 0, outcome.output
    attention = outcome.output.split("Needs attention", 1)[1]
    md = (report / "migration_report.md").read_text().split("## Needs attention", 1)[1]
    for location, api in [("train.py:6", "NCCL_DEBUG"), ("train.py:8", "cudnn.benchmark"),
                          ("train.py:11", "torch.Tensor.cuda"),
                          ("train.py:14", '"cuda"'), ("train.py:20", "Wrapper.cuda")]:
        for text in (attention, md):
            assert any(location in row and api in row for row in text.splitlines()), \
                (location, api, text)


# --------------------------------------------------------------------------- --analyse


def _failing_coverage(script: Path, args: list[str] | None = None, **_: Any
                      ) -> opcoverage.ScriptAnalysis:
    """What run_script_coverage gives for a script that raised after recording some ops."""
    partial = opcoverage.CoverageResult(exit_code=1, error="RuntimeError: loss is nan")
    return opcoverage.ScriptAnalysis(
        Path(script), list(args or []), 1, result=partial,
        error='Traceback (most recent call last):\n  File "train.py", line 9\n'
              "RuntimeError: loss is nan")


def test_analyse_reports_a_crashed_script_as_a_failure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(opcoverage, "run_script_coverage", _failing_coverage)
    src = tmp_path / "src"
    src.mkdir()
    (src / "train.py").write_text("import torch\n\nif __name__ == '__main__':\n"
                                  "    x = torch.ones(2).cuda()\n")
    app = _migrate_app()
    report = tmp_path / "report"
    outcome = CliRunner().invoke(
        app, ["migrate", str(src), "-o", str(tmp_path / "out"), "--report", str(report),
              "--analyse"], env={"COLUMNS": "300"})
    assert outcome.exit_code == 3, outcome.output
    assert "FAILED" in outcome.output
    assert "train.py (exit 1: RuntimeError: loss is nan)" in outcome.output
    assert (tmp_path / "out" / "train.py").exists()  # the migration itself was written
    md = (report / "migration_report.md").read_text()
    assert "every op the analysed scripts used has a device kernel" not in md
    assert "| train.py |  | **FAILED** (exit 1) |" in md
    assert "| train.py | 1 | RuntimeError: loss is nan |" in md
    # the Python API says so too
    result = migrate_path(src / "train.py", tmp_path / "one.py", analyse=True)
    assert result.analysis is not None and result.analysis.startswith("FAILED")
    assert "RuntimeError: loss is nan" in result.analysis


# --------------------------------------------------------------------------- a project, run

_DRIVER = r"""
import contextlib, json, os, runpy, sys, traceback
# Imported once (torch._dynamo: the optimizers load it, seconds each time); every run
# below is a fresh fork of this interpreter, with no torchport in it.
import torch, torch._dynamo, torch.optim, torch.utils.data
sys.dont_write_bytecode = True
results = {}
for name, script, args, cwd in json.loads(sys.argv[1]):
    out_path = os.path.join(cwd, name + ".log")
    pid = os.fork()
    if pid == 0:
        code = 0
        with open(out_path, "w") as log, contextlib.redirect_stdout(log), \
                contextlib.redirect_stderr(log):
            os.chdir(cwd)
            sys.argv = [script, *args]
            sys.path.insert(0, os.path.dirname(script))
            try:
                runpy.run_path(script, run_name="__main__")
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    with open(out_path) as log:
        results[name] = {"code": os.waitstatus_to_exitcode(status), "out": log.read()}
print(json.dumps(results))
"""


def _values(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        for key in ("final loss", "params checksum", "accuracy", "device type", "running on",
                    "restored on", "epoch 0 loss", "epoch 1 loss", "epoch 2 loss"):
            if line.startswith(key + " "):
                out[key] = line[len(key) + 1:]
    return out


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The project migrated, and its scripts run: migrated on the device, originals on CPU."""
    root = tmp_path_factory.mktemp("project")
    src, dst = root / "src", root / "out"
    shutil.copytree(PROJECT, src, ignore=shutil.ignore_patterns("__pycache__"))
    result = migrate_path(src, dst, report_dir=root / "report")
    runs = [
        ("dev_ckpt", str(dst / "train_ckpt.py"), ["--ckpt", str(root / "dev.pt")], str(dst)),
        ("cpu_ckpt", str(src / "train_ckpt.py"), ["--no-cuda", "--ckpt", str(root / "cpu.pt")],
         str(src)),
        ("dev_mnist", str(dst / "mnist_accel.py"), [], str(dst)),
        ("cpu_mnist", str(src / "mnist_accel.py"), ["--no-accel"], str(src)),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHPORT_TRANSFER")}
    env.update(OMP_NUM_THREADS="1", TORCHPORT_FALLBACK_WARN="0", PYTHONDONTWRITEBYTECODE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]))
    proc = run_python(_DRIVER, args=[json.dumps(runs)], env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    outputs = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"result": result, "src": src, "dst": dst, "report": root / "report",
            "runs": outputs}


def _ok(project: dict[str, Any], name: str) -> dict[str, str]:
    run = project["runs"][name]
    assert run["code"] == 0, (name, run["out"][-3000:])
    assert "torchport.transfer" not in run["out"]
    return _values(run["out"])


def test_migrated_project_gets_the_backend_import_only_where_the_device_is_used(
        project: dict[str, Any]) -> None:
    src, dst = project["src"], project["dst"]
    assert (dst / "data_utils.py").read_bytes() == (src / "data_utils.py").read_bytes()
    assert sorted(project["result"].files_changed) == ["mnist_accel.py", "train_ckpt.py"]
    for name in ("train_ckpt.py", "mnist_accel.py"):
        tree = ast.parse((dst / name).read_text())
        assert any(isinstance(n, ast.Import) and n.names[0].name == "torchport.sim"
                   for n in tree.body), name
        for n in ast.walk(tree):  # no device string names CUDA any more
            assert not (isinstance(n, ast.Constant) and n.value in ("cuda", "nccl")), name
            assert not (isinstance(n, ast.JoinedStr) and n.values
                        and getattr(n.values[0], "value", None) == "cuda:"), name
    assert not project["result"].unsupported


def test_migrated_checkpoint_script_matches_its_cpu_run(project: dict[str, Any]) -> None:
    dev, cpu = _ok(project, "dev_ckpt"), _ok(project, "cpu_ckpt")
    assert dev["running on"] == "sim" and cpu["running on"] == "cpu"
    assert dev["restored on"] == "gpu"  # '"cuda" in str(weight.device)', as on a GPU
    # epochs 0 and 1, then epoch 2 resumed from the checkpoint (model and optimizer state)
    for key in ("epoch 0 loss", "epoch 1 loss", "epoch 2 loss", "final loss", "params checksum"):
        assert float(dev[key]) == pytest.approx(float(cpu[key]), rel=1e-5, abs=1e-6), key
    assert dev["accuracy"] == cpu["accuracy"]


def test_migrated_accelerator_script_matches_its_cpu_run(project: dict[str, Any]) -> None:
    dev, cpu = _ok(project, "dev_mnist"), _ok(project, "cpu_mnist")
    assert dev["device type"] == "sim" and cpu["device type"] == "cpu"
    for key in ("epoch 1 loss", "epoch 2 loss", "final loss", "params checksum"):
        assert float(dev[key]) == pytest.approx(float(cpu[key]), rel=1e-5, abs=1e-6), key


def test_migrated_project_keeps_the_dict_pin_memory(project: dict[str, Any]) -> None:
    dst = project["dst"]
    assert '{"num_workers": 1, "pin_memory": True}' in (dst / "mnist_accel.py").read_text()
    assert ('{"num_workers": 1, "pin_memory": True, "shuffle": False}'
            in (dst / "train_ckpt.py").read_text())
    md = (project["report"] / "migration_report.md").read_text()
    assert "pin-memory" not in md and "| mnist_accel.py:46 |" not in md
    assert "| train_ckpt.py:71 |" not in md
    assert "| train_ckpt.py:78 | .cuda() | `model.cuda(device)` | `model.to(device)` |" in md
