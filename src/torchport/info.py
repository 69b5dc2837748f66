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

# Every variable torchport reads, with its default (None: unset means "all"/"off").
KNOWN_VARIABLES: dict[str, tuple[str | None, str]] = {
    "TORCHPORT_BACKEND": ("sim", "backend for torchport run/coverage/info"),
    "TORCHPORT_SIM_DEVICES": ("2", "number of sim devices"),
    "TORCHPORT_SIM_MEMORY": ("8GiB", "memory per sim device"),
    "TORCHPORT_SIM_STRICT": ("0", "1: device-only sim memory"),
    "TORCHPORT_SIM_ASYNC": ("0", "1: sim streams run work on worker threads"),
    "TORCHPORT_LAUNCH_BLOCKING": ("0", "1: every launch synchronous"),
    "TORCHPORT_TRANSFER": ("0", "1: run CUDA code on the device"),
    "TORCHPORT_AUTOLOAD": (None, "backend that import torch registers (set by torchport run)"),
    "TORCHPORT_COVERAGE_CHILDREN": (None, "where child processes write op coverage (set by "
                                           "torchport coverage)"),
    "TORCHPORT_VISIBLE_DEVICES": (None, "devices to use (default: all)"),
    "TORCHPORT_HF_INTEGRATION": ("1", "0: leave accelerate/transformers' device choice alone"),
    "TORCHPORT_FALLBACK": ("1", "0: ops without a kernel raise instead of running on CPU"),
    "TORCHPORT_FALLBACK_WARN": ("1", "0: no warning when an op falls back"),
    "TORCHPORT_FORCE_FALLBACK_OPS": (None, "regexes of overloads forced to the CPU"),
    "TORCHPORT_OP_STATS": ("0", "1: print op statistics at exit"),
    "TORCHPORT_NATIVE": ("1", "0: views and device guard in Python, not C++"),
    "TORCHPORT_CACHE_DIR": (None, "the C++ library's build folder"),
    "TORCHPORT_AUTOCOMPARE": (None, "op regexes checked against CPU (autocompare)"),
    "TORCHPORT_AUTOCOMPARE_RAISE": ("0", "1: autocompare mismatches raise"),
    "TORCHPORT_DUMP_OPS": ("0", "op dump level 0-3"),
    "TORCHPORT_DUMP_DIR": (None, "directory for op dumps"),
    "TORCHPORT_DUMP_FILTER": (None, "op regexes to dump"),
    "TORCHPORT_DUMP_RANGE": (None, "start:end call range to dump"),
    "TORCHPORT_DUMP_MAX_BYTES": (None, "largest tensor saved in a dump"),
    "TORCHPORT_DUMP_CPU": ("0", "1: dump the CPU reference too"),
}


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
        if name not in KNOWN_VARIABLES:
            rows.append({"name": name, "value": value, "source": "unknown", "default": None,
                         "meaning": "not read by torchport (typo?)"})
    return rows


def collect(backend: str = "sim") -> dict[str, Any]:
    """Everything ``torchport info`` shows, as plain data (the ``--json`` output)."""
    import torch

    import torchport
    from torchport.run import load_backend

    versions = {"torchport": torchport.__version__, "torch": torch.__version__,
                "python": platform.python_version()}
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
                    "device_count": b.device_count()},
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
        backend: str = typer.Option(os.environ.get("TORCHPORT_BACKEND", "sim"), "--backend",
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
        con.print(f"torchport {v['torchport']}, torch {v['torch']}, Python {v['python']} "
                  f"({data['platform']})")
        b = data["backend"]
        if failed:
            con.print(f"backend: {b['name']} [red]cannot start[/]: {b['error']}", markup=True,
                      highlight=False)
        else:
            con.print(f"backend: {b['name']} ({b['runtime']}, {b['memory']} memory), "
                      f"{b['device_count']} device(s)")
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
