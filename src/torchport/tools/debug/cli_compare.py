"""``torchport compare-dumps``: where do two op dumps first diverge?"""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    """Add the ``compare-dumps`` command to the torchport CLI."""

    @app.command("compare-dumps")
    def compare_dumps_cmd(
        dir_a: Path = typer.Argument(..., help="first dump directory (e.g. the device run)"),
        dir_b: Path = typer.Argument(..., help="second dump directory (e.g. the CPU run)"),
        rtol: float | None = typer.Option(None, help="relative tolerance (default: per dtype, "
                                                     "as torch.testing.assert_close)"),
        atol: float | None = typer.Option(None, help="absolute tolerance (default: per dtype)"),
        report: Path | None = typer.Option(None, help="also write a report: .md or .html"),
        nested: bool = typer.Option(False, help="also align calls made inside other calls"),
        max_rows: int = typer.Option(40, help="rows shown in the terminal (around the first "
                                              "divergence); reports hold every row"),
    ) -> None:
        """Compare two op dumps (TORCHPORT_DUMP_DIR) call by call.

        Prints cosine similarity, max abs/rel error per aligned call and the first call
        beyond tolerance. Exit code: 0 no divergence, 1 divergent, 2 bad input (not a
        dump, or saved tensors that cannot be read)."""
        from rich.console import Console

        from torchport.tools.debug.compare import DumpFormatError, compare_dumps

        con = Console()
        if report is not None and report.suffix.lower() not in (".md", ".markdown", ".html",
                                                                 ".htm"):
            con.print(f"[red]error:[/red] --report must end in .md or .html, got {report}",
                      soft_wrap=True)
            raise typer.Exit(2)
        try:
            result = compare_dumps(dir_a, dir_b, rtol=rtol, atol=atol, nested=nested)
        except DumpFormatError as e:
            con.print(f"[red]error:[/red] {e}", soft_wrap=True)  # paths kept whole
            raise typer.Exit(2) from None
        con.print(result.table(max_rows=max_rows))
        con.print(result.summary(), style="bold red" if not result.ok else "green")
        if report is not None:
            try:
                result.write_report(report)
            except OSError as e:
                con.print(f"[red]error:[/red] cannot write {report}: {e}", soft_wrap=True)
                raise typer.Exit(2) from None
            con.print(f"report written to {report}")
        raise typer.Exit(0 if result.ok else 1 if result.divergent else 2)
