"""The ``torchport`` command: subcommands, ``--help``, ``info [--json]`` and exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

import torchport.sim  # noqa: F401
from torchport.tools import cli
from torchport.tools.info import KNOWN_VARIABLES, TEST_VARIABLES, settings

pytestmark = pytest.mark.tools

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def app() -> typer.Typer:
    if not cli.app.registered_commands:
        cli._load()
    return cli.app


def test_every_subcommand_has_help(app: typer.Typer) -> None:
    runner = CliRunner()
    names = {c.name for c in app.registered_commands}
    assert {"info", "run", "migrate", "coverage"} <= names
    for name in sorted(n for n in names if n):
        res = runner.invoke(app, [name, "--help"])
        assert res.exit_code == 0, (name, res.output)
        assert "usage" in res.output.lower()
    res = runner.invoke(app, ["coverage", "--help"])
    for opt in ("--static", "--json", "--html", "--fail-on-fallback", "--transfer"):
        assert opt in res.output


def test_info_terminal(app: typer.Typer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHPORT_SIM_MEMORY", "8GiB")
    monkeypatch.setenv("TORCHPORT_TYPO_VAR", "1")
    res = CliRunner().invoke(app, ["info"])
    assert res.exit_code == 0, res.output
    out = res.output
    import torch

    assert f"torch {torch.__version__}" in out and "Python" in out and "torchport" in out
    assert "backend: sim" in out and "sim:0" in out and "capacity" in out
    assert "TORCHPORT_SIM_MEMORY" in out and "environment" in out
    assert "TORCHPORT_TYPO_VAR" in out and "unknown" in out


def test_info_json(app: typer.Typer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHPORT_FALLBACK_WARN", "0")
    res = CliRunner().invoke(app, ["info", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    import torch

    assert data["versions"]["torch"] == torch.__version__
    assert data["backend"]["name"] == "sim" and data["backend"]["device_count"] >= 1
    dev = data["devices"][0]
    assert dev["device"] == "sim:0" and dev["total_memory"] > 0
    assert {"allocated", "reserved", "name"} <= dev.keys()
    assert data["environment"]["TORCHPORT_FALLBACK_WARN"] == "0"
    from torchport.core import native

    layer = data["backend"]["layer"]
    if native.loaded() is not None:
        assert layer.startswith("C++: ") and "device guard" in layer, layer
    else:
        assert layer.startswith("Python ("), layer
    by_name = {s["name"]: s for s in data["settings"]}
    assert set(KNOWN_VARIABLES) <= by_name.keys()
    assert by_name["TORCHPORT_FALLBACK_WARN"]["source"] == "environment"
    assert by_name["TORCHPORT_LAUNCH_BLOCKING"] == {
        "name": "TORCHPORT_LAUNCH_BLOCKING", "value": "0", "source": "default",
        "default": "0", "meaning": KNOWN_VARIABLES["TORCHPORT_LAUNCH_BLOCKING"][1]}


def test_settings_lists_every_variable_in_effect(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHPORT_SOMETHING_NEW", "x")
    rows = {r["name"]: r for r in settings()}
    assert rows["TORCHPORT_SOMETHING_NEW"]["source"] == "unknown"
    # every TORCHPORT_* name the sources read is known to `info`
    import re

    read = set()
    for f in (ROOT / "src" / "torchport").rglob("*.py"):
        read |= set(re.findall(r"\"(TORCHPORT_[A-Z0-9_]*[A-Z0-9])\"", f.read_text()))
    declared = set(KNOWN_VARIABLES) | set(TEST_VARIABLES)
    assert read <= declared, read - declared


def test_exit_codes(app: typer.Typer, tmp_path: Path) -> None:
    runner = CliRunner()
    assert runner.invoke(app, ["no-such-command"]).exit_code == 2
    assert runner.invoke(app, ["info", "--bogus"]).exit_code == 2
    assert runner.invoke(app, ["info", "--backend", "no_such_backend"]).exit_code == 2
    assert runner.invoke(app, ["coverage"]).exit_code == 2
    ok = tmp_path / "ok.py"
    ok.write_text("import torch, torchport.sim\nprint((torch.ones(2, device='sim') * 2).sum())\n")
    bad = tmp_path / "bad.py"
    bad.write_text("raise RuntimeError('boom')\n")
    assert runner.invoke(app, ["coverage", "-q", str(ok)]).exit_code == 0
    assert runner.invoke(app, ["coverage", "-q", str(bad)]).exit_code == 1


def test_console_script_subprocess(tmp_path: Path) -> None:
    exe = Path(sys.executable).parent / "torchport"
    if not exe.exists():
        pytest.skip("torchport console script not installed in this environment")
    out = subprocess.run([str(exe), "info", "--json"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout)["backend"]["name"] == "sim"
    bad = subprocess.run([str(exe), "info", "--nope"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2


@pytest.mark.parametrize("as_json", [False, True])
def test_info_flags_a_bad_setting_instead_of_a_traceback(as_json: bool) -> None:
    import os
    env = dict(os.environ, TORCHPORT_SIM_MEMORY="banana")
    args = [sys.executable, "-m", "torchport.tools.cli", "info"] + (["--json"] if as_json else [])
    out = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    if as_json:
        data = json.loads(out.stdout)
        assert "TORCHPORT_SIM_MEMORY='banana' is not a size" in data["backend"]["error"]
        row = next(r for r in data["settings"] if r["name"] == "TORCHPORT_SIM_MEMORY")
        assert (row["value"], row["source"]) == ("banana", "invalid")
    else:
        assert "cannot start" in out.stdout and "invalid" in out.stdout, out.stdout


# Commands that run nothing on a device (they read files the device tools wrote).
_NO_DEVICE_COMMANDS = {"compare-dumps"}


def test_every_device_command_takes_backend(app: typer.Typer) -> None:
    runner = CliRunner()
    names = {c.name for c in app.registered_commands if c.name} - _NO_DEVICE_COMMANDS
    assert {"info", "run", "migrate", "coverage", "conformance"} <= names
    for name in sorted(names):
        res = runner.invoke(app, [name, "--help"], terminal_width=200)
        assert res.exit_code == 0, (name, res.output)
        assert "-b" in res.output.split() or "-b," in res.output, (name, res.output)
        assert "--backend" in res.output, (name, res.output)


def _console_script() -> Path:
    exe = Path(sys.executable).parent / "torchport"
    if not exe.exists():
        pytest.skip("torchport console script not installed in this environment")
    return exe


def test_backend_module_found_in_the_working_directory(tmp_path: Path) -> None:
    """``torchport -b mod`` from ``mod``'s own folder, as docs/vendor-guide.md says: the
    console script's ``sys.path`` does not hold the working directory; processes the
    script starts find the backend too."""
    import os
    import shutil

    exe = _console_script()
    shutil.copy(ROOT / "examples" / "vendor_walkthrough" / "backend.py",
                tmp_path / "npx_backend.py")
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "child.py").write_text(
        "import subprocess, sys, torch\n"
        "print('parent', torch.ones(2, device='cuda').device)\n"
        "code = 'import torch; print(\"child\", torch.ones(2, device=\"walk\").device)'\n"
        "subprocess.run([sys.executable, '-c', code], check=True)\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "TORCHPORT_AUTOLOAD", "TORCHPORT_BACKEND")}
    info = subprocess.run([str(exe), "info", "--json", "-b", "npx_backend"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env=env)
    assert info.returncode == 0, info.stdout[-2000:] + info.stderr[-2000:]
    assert json.loads(info.stdout)["backend"]["name"] == "walk"
    run = subprocess.run([str(exe), "run", "-b", "npx_backend", "scripts/child.py"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=180, env=env)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "parent walk:0" in run.stdout and "child walk:0" in run.stdout, run.stdout
    missing = subprocess.run([str(exe), "info", "-b", "no_such_backend_here"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=120, env=env)
    assert missing.returncode == 2
