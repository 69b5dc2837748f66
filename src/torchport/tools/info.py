"""``torchport info [--json]``: versions, backend, devices and settings in effect.

The first thing to paste into a bug report: it says which torchport/torch/Python
ran, on which backend and devices, and every ``TORCHPORT_*`` setting in effect
(set in the environment, or left at its default), so a report can be reproduced.
"""

from __future__ import annotations

import json
import os
import platform
from typing import Any

import typer

from torchport.core import settings as declared

# Views of the declarations in torchport.core.settings, for `torchport info` and its tests.
# KNOWN_VARIABLES: what torchport reads, name -> (default, short meaning) (default None:
# unset means "all"/"off"); TEST_VARIABLES: what the test suite reads (listed as "test"
# when set instead of "unknown"), name -> (default, short meaning, long description).
KNOWN_VARIABLES: dict[str, tuple[str | None, str]] = {
    s.name: (s.default, s.meaning) for s in declared.SETTINGS.values() if s.scope != "test"}
TEST_VARIABLES: dict[str, tuple[str, str, str]] = {
    s.name: (s.default or "", s.meaning, s.description)
    for s in declared.SETTINGS.values() if s.scope == "test"}

CONFIGURATION_INTRO = (
    "torchport reads these environment variables; `torchport info` shows each one's value "
    "in effect and where it comes from (environment, default, or `unknown`: a name torchport "
    "does not read, usually a typo). The last ones are settings of the test suite, not of "
    "torchport. Flags take `0` or `1` (also `true`/`false`, `yes`/`no`, `on`/`off`); a "
    "value of the wrong type stops torchport with an error naming the variable and what it "
    "allows. This page is generated from `src/torchport/core/settings.py`, where every "
    "variable is declared: edit it there and run "
    "`python -m torchport.tools.info --markdown > docs/configuration.md`."
)


def configuration_markdown() -> str:
    """docs/configuration.md: every variable with its long description and default."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = ["# Configuration: environment variables", "", CONFIGURATION_INTRO, "",
             "| variable | meaning | default |", "| --- | --- | --- |"]
    for s in sorted(declared.SETTINGS.values(), key=lambda s: s.scope == "test"):
        prefix = "test setting: " if s.scope == "test" else ""
        lines.append(f"| `{s.name}` | {prefix}{cell(s.description)} | {s.documented_default} |")
    return "\n".join(lines) + "\n"


def env_settings() -> dict[str, str]:
    """Every ``TORCHPORT_*`` variable set in this process."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("TORCHPORT_")}


def settings(error: str | None = None) -> list[dict[str, Any]]:
    """Every known variable (value in effect and where it comes from) plus unknown ones set.

    An unknown ``TORCHPORT_*`` name is usually a typo that silently does nothing,
    so it is listed with ``source: "unknown"``; a variable the backend's start-up
    ``error`` names is listed with ``source: "invalid"``.
    """
    env = env_settings()
    rows = []
    for name, (default, meaning) in KNOWN_VARIABLES.items():
        if name in env:
            bad = error is not None and f"{name}=" in error
            rows.append({"name": name, "value": env[name],
                         "source": "invalid" if bad else "environment",
                         "default": default, "meaning": meaning})
        else:
            rows.append({"name": name, "value": default, "source": "default",
                         "default": default, "meaning": meaning})
    for name, value in env.items():
        if name in TEST_VARIABLES:
            default, meaning, _doc = TEST_VARIABLES[name]
            rows.append({"name": name, "value": value, "source": "test", "default": default,
                         "meaning": meaning})
        elif name not in KNOWN_VARIABLES:
            rows.append({"name": name, "value": value, "source": "unknown", "default": None,
                         "meaning": "not read by torchport (typo?)"})
    return rows


def collect(backend: str = "sim") -> dict[str, Any]:
    """Everything ``torchport info`` shows, as plain data (the ``--json`` output)."""
    import torch

    import torchport
    from torchport.core import compat, native
    from torchport.tools.run import load_backend

    versions = {"torchport": torchport.__version__, "torch": torch.__version__,
                "torch_build": compat.build_summary(), "python": platform.python_version()}
    try:
        b = load_backend(backend)
    except typer.BadParameter:  # no such backend: a usage error
        raise
    except Exception as e:  # a bad setting: named in the table, not a traceback
        error = f"{type(e).__name__}: {e}"
        return {"versions": versions, "platform": platform.platform(),
                "backend": {"name": backend, "error": error}, "devices": [],
                "forced_fallback": [], "environment": env_settings(),
                "settings": settings(error)}
    mod = getattr(torch, b.name)
    devices = []
    for i in range(b.device_count()):
        p = mod.get_device_properties(i)
        dev: dict[str, Any] = {"device": f"{b.name}:{i}", "name": p.name,
                               "total_memory": int(p.total_memory),
                               "allocated": int(mod.memory_allocated(i)),
                               "reserved": int(mod.memory_reserved(i))}
        try:
            free, total = mod.mem_get_info(i)
            dev["free"] = int(free)
        except Exception:  # pragma: no cover - optional in a vendor's device module
            pass
        devices.append(dev)
    forced: list[str] = []
    try:
        from torchport.ops import force_fallback_patterns

        forced = force_fallback_patterns()
    except ImportError:  # pragma: no cover
        pass
    return {
        "versions": versions,
        "platform": platform.platform(),
        "backend": {"name": b.name, "runtime": type(b.runtime).__name__,
                    "memory": "host-addressable" if b.runtime.host_addressable
                    else "device-only",
                    "device_count": b.device_count(), "layer": native.describe()},
        "devices": devices,
        "forced_fallback": forced,
        "environment": env_settings(),
        "settings": settings(),
    }


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def register(app: typer.Typer) -> None:
    """Add the ``info`` command to the torchport CLI."""

    @app.command("info")
    def info(
        backend: str = typer.Option(declared.get("TORCHPORT_BACKEND"), "--backend",
                                    "-b", help="Backend: sim, a torchport.backends name, "
                                               "or a module path."),
        as_json: bool = typer.Option(False, "--json", help="Print the information as JSON."),
    ) -> None:
        """Show torchport/torch/Python versions, backend, devices and TORCHPORT_* settings.
        Exit status 1 when the backend cannot start (the setting at fault is marked)."""
        data = collect(backend)
        failed = "error" in data["backend"]
        if as_json:
            typer.echo(json.dumps(data, indent=1))
            if failed:
                raise typer.Exit(1)
            return
        from rich.console import Console
        from rich.table import Table

        con = Console()
        v = data["versions"]
        con.print(f"torchport {v['torchport']}, torch {v['torch']} ({v['torch_build']}), "
                  f"Python {v['python']} "
                  f"({data['platform']})")
        b = data["backend"]
        if failed:
            con.print(f"backend: {b['name']} [red]cannot start[/]: {b['error']}", markup=True,
                      highlight=False)
        else:
            con.print(f"backend: {b['name']} ({b['runtime']}, {b['memory']} memory), "
                      f"{b['device_count']} device(s)")
            con.print(f"device layer: {b['layer']}", highlight=False)
            t = Table("device", "name", "capacity", "allocated", "reserved", "free")
            for d in data["devices"]:
                t.add_row(d["device"], d["name"], _gib(d["total_memory"]), str(d["allocated"]),
                          str(d["reserved"]), _gib(d["free"]) if "free" in d else "-")
            con.print(t)
        s = Table("variable", "value", "source", "meaning", title="settings")
        for row in data["settings"]:
            style = {"environment": "bold", "unknown": "yellow",
                     "invalid": "bold red"}.get(row["source"], "dim")
            s.add_row(row["name"], "" if row["value"] is None else str(row["value"]),
                      f"[{style}]{row['source']}[/]", row["meaning"])
        con.print(s)
        if data["forced_fallback"]:
            con.print(f"forced to fallback: {', '.join(data['forced_fallback'])}")
        if failed:
            raise typer.Exit(1)


if __name__ == "__main__":  # python -m torchport.tools.info --markdown > docs/configuration.md
    import sys

    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python -m torchport.tools.info --markdown > docs/configuration.md")
    sys.stdout.write(configuration_markdown())
