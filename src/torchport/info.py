"""``torchport info``: versions, backend, devices and settings in effect."""

from __future__ import annotations

import os
import platform

import typer


def env_settings() -> dict[str, str]:
    """Every ``TORCHPORT_*`` variable set in this process."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("TORCHPORT_")}


def register(app: typer.Typer) -> None:
    @app.command()
    def info(backend: str = typer.Option("sim", help="backend module under torchport.")) -> None:
        """Show torchport/torch/Python versions, devices and TORCHPORT_* settings."""
        import importlib

        import torch
        from rich.console import Console
        from rich.table import Table

        import torchport

        importlib.import_module(f"torchport.{backend}")
        b = torchport.active_backend()
        con = Console()
        con.print(f"torchport {torchport.__version__}, torch {torch.__version__}, "
                  f"Python {platform.python_version()}")
        mode = "host-addressable" if b.runtime.host_addressable else "device-only"
        con.print(f"backend: {b.name} ({type(b.runtime).__name__}, {mode} memory)")
        t = Table("device", "name", "capacity", "allocated", "reserved")
        mod = getattr(torch, b.name)
        for i in range(b.device_count()):
            p = mod.get_device_properties(i)
            t.add_row(f"{b.name}:{i}", p.name, f"{p.total_memory / 2**30:.2f} GiB",
                      str(mod.memory_allocated(i)), str(mod.memory_reserved(i)))
        con.print(t)
        env = env_settings()
        con.print("environment: " + (", ".join(f"{k}={v}" for k, v in env.items()) or "(none)"))
