"""``torchport.core.settings``: every TORCHPORT_* variable declared once, parsed at call time,
documented, reported by ``torchport info``, and read nowhere else."""

from __future__ import annotations

import ast
import os
import re
import sys
from pathlib import Path

import pytest

from tests.helpers import run_python
from torchport.core import settings
from torchport.core.settings import SETTINGS, SettingError
from torchport.tools import info

ROOT = Path(__file__).resolve().parents[1]


def test_every_declared_setting_is_documented() -> None:
    page = info.configuration_markdown()
    for s in SETTINGS.values():
        assert s.name.startswith("TORCHPORT_") and s.meaning, s
        assert s.kind in settings.KINDS and s.scope in settings.SCOPES, s
        row = next(line for line in page.splitlines() if line.startswith(f"| `{s.name}` |"))
        assert s.description.replace("|", "\\|") in row and s.documented_default in row
    assert set(info.KNOWN_VARIABLES) | set(info.TEST_VARIABLES) == set(SETTINGS)
    assert not set(info.KNOWN_VARIABLES) & set(info.TEST_VARIABLES)


def test_the_settings_module_is_a_leaf() -> None:
    """Any layer may import it: it imports the standard library only (no torch)."""
    tree = ast.parse((ROOT / "src" / "torchport" / "core" / "settings.py").read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                for a in n.names}
    imported |= {(n.module or "").split(".")[0] for n in ast.walk(tree)
                 if isinstance(n, ast.ImportFrom) and n.level == 0}
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported


def test_unknown_and_test_variables_are_reported_by_info(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHPORT_SIM_MEMROY", "4GiB")  # a typo: read by nothing
    monkeypatch.setenv("TORCHPORT_FULL_MODELS", "1")
    rows = {r["name"]: r for r in info.settings()}
    assert rows["TORCHPORT_SIM_MEMROY"]["source"] == "unknown"
    assert rows["TORCHPORT_FULL_MODELS"]["source"] == "test"
    assert rows["TORCHPORT_SIM_MEMORY"] == {
        "name": "TORCHPORT_SIM_MEMORY", "value": "8GiB", "source": "default",
        "default": "8GiB", "meaning": SETTINGS["TORCHPORT_SIM_MEMORY"].meaning}
    with pytest.raises(KeyError, match="TORCHPORT_SIM_MEMROY is not a torchport setting"):
        settings.get("TORCHPORT_SIM_MEMROY")


def test_values_are_parsed_from_the_environment_at_call_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in SETTINGS:
        monkeypatch.delenv(name, raising=False)
    assert settings.get("TORCHPORT_SIM_MEMORY") == 8 << 30
    assert settings.get("TORCHPORT_SIM_DEVICES") == 2
    assert settings.get("TORCHPORT_FALLBACK") is True
    assert settings.get("TORCHPORT_SIM_STRICT") is False
    assert settings.get("TORCHPORT_VISIBLE_DEVICES") is None
    assert settings.get("TORCHPORT_BACKEND") == "sim"
    cases = {
        "TORCHPORT_SIM_MEMORY": [("512MiB", 512 << 20), ("1.5GB", 1_500_000_000),
                                 ("4096", 4096), ("", 8 << 30)],
        "TORCHPORT_DUMP_MAX_BYTES": [("2MB", 2 << 20), ("64KiB", 65536)],
        "TORCHPORT_SIM_DEVICES": [(" 3 ", 3), ("0", 0)],
        "TORCHPORT_FALLBACK": [("0", False), ("false", False), ("OFF", False), ("1", True),
                               ("yes", True), ("", True)],
        "TORCHPORT_SIM_ASYNC": [("1", True), ("", False)],
        "TORCHPORT_FORCE_FALLBACK_OPS": [(r"add\..*, relu,", [r"add\..*", "relu"])],
        "TORCHPORT_DUMP_RANGE": [("10:20", (10, 20)), ("7:", (7, None)), (":5", (0, 5)),
                                 ("", None)],
        # an empty device list is a list: no device visible, as with CUDA_VISIBLE_DEVICES
        "TORCHPORT_VISIBLE_DEVICES": [("", ""), ("1,0", "1,0")],
        "TORCHPORT_DUMP_DIR": [("", None), ("/tmp/d", "/tmp/d")],
    }
    for name, pairs in cases.items():
        for text, value in pairs:
            monkeypatch.setenv(name, text)
            assert settings.get(name) == value, (name, text)
            assert settings.raw(name) == text


@pytest.mark.parametrize("name, text, message", [
    ("TORCHPORT_SIM_MEMORY", "banana",
     "TORCHPORT_SIM_MEMORY='banana' is not a size; use e.g. 512MiB, 8GiB or 1073741824"),
    ("TORCHPORT_SIM_DEVICES", "abc",
     "TORCHPORT_SIM_DEVICES='abc' is not a device count; use a whole number such as 2"),
    ("TORCHPORT_SIM_DEVICES", "-1", "TORCHPORT_SIM_DEVICES='-1' is not a device count"),
    ("TORCHPORT_FALLBACK", "maybe", "TORCHPORT_FALLBACK='maybe' is not a flag; use 0 or 1"),
    ("TORCHPORT_DUMP_OPS", "high", "TORCHPORT_DUMP_OPS='high' is not a dump level; use 0, 1"),
    ("TORCHPORT_DUMP_RANGE", "12", "TORCHPORT_DUMP_RANGE='12' is not a call range; use start:end"),
    ("TORCHPORT_DUMP_RANGE", "a:b", "TORCHPORT_DUMP_RANGE='a:b' is not a call range"),
    ("TORCHPORT_DUMP_MAX_BYTES", "big", "TORCHPORT_DUMP_MAX_BYTES='big' is not a byte count"),
])
def test_a_bad_value_names_the_variable_and_what_it_allows(
        monkeypatch: pytest.MonkeyPatch, name: str, text: str, message: str) -> None:
    monkeypatch.setenv(name, text)
    with pytest.raises(SettingError, match=re.escape(message)) as e:
        settings.get(name)
    assert isinstance(e.value, ValueError)


def test_a_bad_flag_stops_the_import_with_its_name() -> None:
    """A flag torchport reads at import: ``TORCHPORT_FALLBACK=false`` used to leave the
    fallback on and a typo went unnoticed; now the first is off and the second an error."""
    code = "import torchport.ops.fallback as f; print(f._ENABLED)"
    env = {**os.environ, "TORCHPORT_FALLBACK_WARN": "0"}
    r = run_python(code, timeout=120, env=env, TORCHPORT_FALLBACK="false")
    assert r.returncode == 0 and r.stdout.split() == ["False"], r.stderr
    r = run_python(code, timeout=120, env=env, TORCHPORT_FALLBACK="nope")
    assert r.returncode == 1, r.stdout
    assert r.stderr.strip().splitlines()[-1] == (
        "torchport.core.settings.SettingError: TORCHPORT_FALLBACK='nope' is not a flag; use 0 or 1 "
        "(or true/false, yes/no, on/off)"), r.stderr


# os.environ.get("TORCHPORT_...", os.getenv("TORCHPORT_...", os.environ["TORCHPORT_..."]
# not followed by an assignment (writes for child processes stay where they are).
_ENV_READ = re.compile(r"""(?:os\.environ\.get|os\.getenv|environ\.get)\(\s*f?["']TORCHPORT_"""
                       r"""|os\.environ\[\s*f?["']TORCHPORT_[A-Z0-9_]*["']\s*\](?!\s*=[^=])""")


def test_the_reading_pattern_catches_reads_and_leaves_writes() -> None:
    assert _ENV_READ.search('x = os.environ.get("TORCHPORT_NATIVE", "1")')
    assert _ENV_READ.search("os.getenv('TORCHPORT_X')")
    assert _ENV_READ.search('if os.environ["TORCHPORT_X"] == "1":')
    assert not _ENV_READ.search('os.environ["TORCHPORT_X"] = "1"')
    assert not _ENV_READ.search('settings.get("TORCHPORT_NATIVE")')


def test_torchport_reads_its_variables_through_settings_only() -> None:
    src = ROOT / "src" / "torchport"
    found = [f"{f.relative_to(ROOT)}:{i}: {line.strip()}"
             for f in sorted(src.rglob("*.py")) if f != src / "core" / "settings.py"
             for i, line in enumerate(f.read_text().splitlines(), 1) if _ENV_READ.search(line)]
    assert not found, "read these through torchport.core.settings.get:\n" + "\n".join(found)
