"""``torchport coverage [--static] [--json F] [--html F] script.py args...``: op coverage of a script.

Exit codes: the script's own exit code when it fails; otherwise 4 when no op ran on
the device (the script computed on the CPU: the report measured nothing); 3 with
``--fail-on-fallback`` when an op fell back to the CPU; otherwise 0. Usage errors
exit 2. Also runnable as ``python -m torchport.tools.debug.cli_coverage``.
"""

from __future__ import annotations

import os
from pathlib import Path

import typer

from torchport.core import settings
from torchport.tools.debug.opcoverage import EXIT_NO_DEVICE_OPS

EXIT_FALLBACK = 3


def register(app: typer.Typer) -> None:
    """Add the ``coverage`` command to the torchport CLI."""

    @app.command(
        "coverage",
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                          "allow_interspersed_args": False},
        help="Report every ATen op a script uses on the device, with its path (fallback, "
             "decomposed, composite, native: the backend's kernels, torchport: torchport's "
             "own, view), calls, dtypes and host time; fallback ops first. "
             "Options go before SCRIPT; the script's own arguments follow it. Exit code: the "
             "script's if it fails, 4 when no op ran on the device, 3 with --fail-on-fallback "
             "when an op fell back, else 0.")
    def coverage_cmd(
        ctx: typer.Context,
        script: str = typer.Argument(..., help="Python script (or module with -m)."),
        static: bool = typer.Option(
            False, "--static",
            help="Trace on fake tensors without running anything on the device; stops where "
                 "the script needs device data (.item(), print(tensor))."),
        json_file: Path | None = typer.Option(None, "--json", metavar="FILE",
                                              help="Write the result as JSON."),
        html_file: Path | None = typer.Option(None, "--html", metavar="FILE",
                                              help="Write a self-contained HTML report."),
        fail_on_fallback: bool = typer.Option(
            False, "--fail-on-fallback", help="Exit 3 when any op fell back to the CPU."),
        transfer: bool | None = typer.Option(
            None, "--transfer/--no-transfer",
            help="Run CUDA code on the device (torchport.transfer), as torchport run does. "
                 "Default: on."),
        backend: str = typer.Option(
            settings.get("TORCHPORT_BACKEND"), "--backend", "-b",
            help="Backend: sim, a torchport.backends name, or a module path."),
        module: bool = typer.Option(False, "-m", "--module",
                                    help="Run SCRIPT as a module, like python -m."),
        limit: int | None = typer.Option(None, "--limit", metavar="N",
                                         help="Show at most N rows in the terminal table."),
        quiet: bool = typer.Option(False, "--quiet", "-q",
                                   help="No terminal table (with --json/--html)."),
        composites: bool = typer.Option(
            True, "--composites/--no-composites",
            help="List the ops PyTorch computes by a composite kernel above the backend (path "
                 "composite). A Python dispatch mode watches the ops for it: torch.compile "
                 "runs eagerly under it; --no-composites to record compiled code."),
    ) -> None:
        from rich.console import Console

        from torchport.tools.debug.opcoverage import run_coverage

        if not module and not os.path.isfile(script):
            raise typer.BadParameter(f"no such script: {script}", param_hint="SCRIPT")
        result = run_coverage(script, list(ctx.args), static=static, transfer=transfer,
                              backend=backend, module=module,
                              composites=composites and not static)
        if json_file is not None:
            result.write_json(json_file)
        if html_file is not None:
            result.write_html(html_file)
        console = Console()
        if not quiet:
            console.print()
            result.print(console, limit=limit)
        for label, f in (("json", json_file), ("html", html_file)):
            if f is not None and not quiet:
                console.print(f"{label}: {f}")
        if result.exit_code:
            raise typer.Exit(result.exit_code)
        if not result.device_ops:
            if quiet:
                typer.echo(result.no_device_ops_text(), err=True)
            raise typer.Exit(EXIT_NO_DEVICE_OPS)
        if fail_on_fallback and result.fallback_ops:
            raise typer.Exit(EXIT_FALLBACK)


def main() -> None:
    """``python -m torchport.tools.debug.cli_coverage``: the command without the full CLI."""
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    register(app)
    app(prog_name="torchport coverage")


if __name__ == "__main__":
    main()
