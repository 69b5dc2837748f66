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


# The long description of each variable, for docs/configuration.md (``torchport info`` shows
# the short meaning above): name -> (default as documented, description in Markdown).
# A variable missing here is documented with its short meaning.
VARIABLE_DOCS: dict[str, tuple[str, str]] = {
    "TORCHPORT_SIM_DEVICES": ("`2`", "number of sim devices"),
    "TORCHPORT_SIM_MEMORY": ("`8GiB`", "memory per sim device (`512MiB`, `8GiB`, bytes)"),
    "TORCHPORT_SIM_STRICT": ("`0`", "`1`: device-only memory (fake addresses, runtime copies "
                                    "only)"),
    "TORCHPORT_SIM_ASYNC": ("`0`", "`1`: sim streams run runtime work on worker threads "
                                   "(see [streams](streams-rng-amp.md))"),
    "TORCHPORT_LAUNCH_BLOCKING": ("`0`", "`1`: every launch synchronous (debugging)"),
    "TORCHPORT_TRANSFER": ("`0`", "`1`: run CUDA code on the device (see [Running CUDA code "
                                  "unchanged](cuda-code.md))"),
    "TORCHPORT_AUTOLOAD": (
        "none",
        "backend (as `--backend`) that every `import torch` registers, through PyTorch's "
        "device-backend autoload; `torchport run` exports it with `TORCHPORT_TRANSFER=1`, so "
        "processes the script starts (`torch.multiprocessing.spawn`, `multiprocessing`, "
        "`subprocess`) run on the device too (`TORCH_DEVICE_BACKEND_AUTOLOAD=0` turns autoload "
        "off)"),
    "TORCHPORT_VISIBLE_DEVICES": ("all", "comma list of physical devices to use, renumbered "
                                         "from 0 (like `CUDA_VISIBLE_DEVICES`)"),
    "TORCHPORT_HF_INTEGRATION": (
        "`1`",
        "`0`: leave Hugging Face accelerate and transformers alone (see [Hugging Face Trainer "
        "and accelerate](cuda-code.md)); by default they choose the device as a GPU"),
    "TORCHPORT_BACKEND": ("`sim`", "backend for `torchport run` / `coverage` / `info`"),
    "TORCHPORT_FORCE_FALLBACK_OPS": (
        "none",
        "comma-separated regexes matched in full against overload names (`add.out`, "
        "`.*\\.Scalar`, `addmm` or `addmm.default`): those ops run on the CPU"),
    "TORCHPORT_FALLBACK": ("`1`", "`0`: an op with no kernel raises `NotImplementedError` "
                                  "(naming op and dtypes) instead of running on the CPU"),
    "TORCHPORT_FALLBACK_WARN": ("`1`", "`0`: no `FallbackWarning` (one per op) when an op "
                                       "first falls back"),
    "TORCHPORT_OP_STATS": ("`0`", "`1`: record op statistics for the whole process, print the "
                                  "table at exit"),
    "TORCHPORT_NATIVE": (
        "`1`",
        "`0`: no C++ library: view ops run the Python view kernels instead of PyTorch's C++ "
        "ones, `pin_memory()` returns unpinned copies (one warning), and the device guard is "
        "PyTorch's Python one, which resolves an index-less device name to 0 in "
        "`torch.tensor`, `Tensor.to` and `torch.accelerator` (see "
        "[Limitations](limitations.md))"),
    "TORCHPORT_CACHE_DIR": ("`~/.cache/torchport`", "where the C++ library (view kernels, "
                                                    "device guard) is compiled, once per torch "
                                                    "and Python version"),
    "TORCHPORT_AUTOCOMPARE": ("none", "op regexes (same rules) checked against the CPU on "
                                      "every call (see [porting tools](porting-tools.md))"),
    "TORCHPORT_AUTOCOMPARE_RAISE": ("`0`", "`1`: the first autocompare mismatch raises"),
    "TORCHPORT_DUMP_OPS": ("`0`", "`1`-`3`: print each device op (path; + argument metadata; "
                                  "+ values) to stderr"),
    "TORCHPORT_DUMP_DIR": ("none", "write each op call's inputs/outputs (safetensors) and "
                                   "`manifest.jsonl` there"),
    "TORCHPORT_DUMP_FILTER": ("all", "dump only these ops (op regexes)"),
    "TORCHPORT_DUMP_RANGE": ("all", "dump only call indices `start:end`"),
    "TORCHPORT_DUMP_MAX_BYTES": ("all", "dump tensors up to this size (larger: statistics "
                                        "only)"),
    "TORCHPORT_DUMP_CPU": ("`0`", "`1`: dump the ATen ops of a CPU run in the same format (the "
                                  "reference)"),
}

# Settings the test suite reads (not torchport itself): ``torchport info`` lists them when
# set, as "test", instead of flagging them unknown.
# name -> (default, short meaning, long description).
TEST_VARIABLES: dict[str, tuple[str, str, str]] = {
    "TORCHPORT_FULL_MODELS": ("0", "1: tests/test_models_hf.py runs all 29 architectures",
                              "`1`: `tests/test_models_hf.py` runs all 29 architectures "
                              "(`make conformance`), not its seven"),
    "TORCHPORT_FULL_SCRIPTS": ("0", "1: tests/test_real_scripts.py runs every script every way",
                               "`1`: `tests/test_real_scripts.py` runs every script every way "
                               "(`make examples`), not its subset"),
}

CONFIGURATION_INTRO = (
    "torchport reads these environment variables; `torchport info` shows each one's value "
    "in effect and where it comes from (environment, default, or `unknown`: a name torchport "
    "does not read, usually a typo). The last ones are settings of the test suite, not of "
    "torchport. This page is generated from `src/torchport/info.py` (`KNOWN_VARIABLES`, "
    "`VARIABLE_DOCS`, `TEST_VARIABLES`): edit it there and run "
    "`python -m torchport.info --markdown > docs/configuration.md`."
)


def configuration_markdown() -> str:
    """docs/configuration.md: every variable with its long description and default."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = ["# Configuration: environment variables", "", CONFIGURATION_INTRO, "",
             "| variable | meaning | default |", "| --- | --- | --- |"]
    for name, (default, meaning) in KNOWN_VARIABLES.items():
        doc_default, doc = VARIABLE_DOCS.get(
            name, ("none" if default is None else f"`{default}`", meaning))
        lines.append(f"| `{name}` | {cell(doc)} | {doc_default} |")
    for name, (default, _meaning, doc) in TEST_VARIABLES.items():
        lines.append(f"| `{name}` | test setting: {cell(doc)} | `{default}` |")
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
    from torchport import native
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


if __name__ == "__main__":  # python -m torchport.info --markdown > docs/configuration.md
    import sys

    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python -m torchport.info --markdown > docs/configuration.md")
    sys.stdout.write(configuration_markdown())
