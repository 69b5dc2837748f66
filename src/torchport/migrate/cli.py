"""``torchport migrate``: the command-line face of :func:`torchport.migrate.migrate_path`.

The lead's main typer app calls :func:`register`; nothing here runs at import.
Exit codes: 0 success (even when unsupported APIs were found: they are in the
report), 2 usage errors and refusals, 1 internal failures.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from torchport.migrate.model import BackendSpecError, MigrationResult
from torchport.migrate.tree import MigrationError, migrate_path

_ROWS_SHOWN = 25


def register(app: typer.Typer) -> None:
    """Add the ``migrate`` command to ``app``."""
    app.command(
        "migrate",
        help="Rewrite CUDA PyTorch code (a file or a tree) for a torchport backend.",
    )(migrate_command)


def migrate_command(
    src: Annotated[
        Path, typer.Argument(metavar="SRC", help="File or directory to migrate (never modified).")
    ],
    output: Annotated[
        Path | None,
        typer.Option("-o", "--output", metavar="DST", help="Where to write the migrated copy."),
    ] = None,
    backend: Annotated[
        str,
        typer.Option(
            metavar="NAME[=MODULE]", help="NAME (imports torchport.NAME) or NAME=some.module."
        ),
    ] = "sim",
    report: Annotated[
        Path | None,
        typer.Option(
            metavar="DIR", help="Directory for migration_report.md and migration_report.csv."
        ),
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Report what would change; write nothing to DST.")
    ] = False,
    analyse: Annotated[
        bool,
        typer.Option(
            "--analyse",
            "--analyze",
            help="Run torchport's op-coverage analysis on the migrated entry script.",
        ),
    ] = False,
    entry: Annotated[
        Path | None,
        typer.Option(
            metavar="FILE", help="Entry script, relative to SRC, for --analyse on a directory."
        ),
    ] = None,
) -> None:
    """Migrate SRC into -o DST and print a summary."""
    console = Console()
    errors = Console(stderr=True)
    try:
        result = migrate_path(
            src,
            output,
            backend=backend,
            report_dir=report,
            dry_run=dry_run,
            analyse=analyse,
            entry=entry,
        )
    except (MigrationError, BackendSpecError) as exc:
        errors.print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(2) from None
    except Exception as exc:
        errors.print(f"[bold red]internal error:[/] {type(exc).__name__}: {exc}")
        raise typer.Exit(1) from None
    _print_result(console, result)


def _print_result(console: Console, result: MigrationResult) -> None:
    if result.dry_run:
        console.print("[bold]dry run:[/] nothing was written")
    summary = Table(title="torchport migrate", show_header=False)
    summary.add_column("what")
    summary.add_column("count", justify="right")
    for name, count in result.summary.items():
        summary.add_row(name, str(count))
    console.print(summary)

    if result.dry_run and result.changes:
        changes = Table(title="Changes", show_lines=False)
        for column in ("location", "rule", "before", "after"):
            changes.add_column(column, overflow="fold")
        for change in result.changes[:_ROWS_SHOWN]:
            changes.add_row(
                f"{change.path}:{change.line}", change.rule, change.before, change.after
            )
        console.print(changes)
        _more(console, len(result.changes))

    findings = [*result.unsupported, *result.unknown]
    if findings:
        table = Table(title="Needs attention")
        for column in ("location", "kind", "API", "reason"):
            table.add_column(column, overflow="fold")
        for finding in findings[:_ROWS_SHOWN]:
            table.add_row(
                f"{finding.path}:{finding.line}", finding.kind, finding.api, finding.reason
            )
        console.print(table)
        _more(console, len(findings))
    for failure in result.failures:
        console.print(
            f"[yellow]copied unchanged[/] {failure.path}: {failure.kind}: {failure.message}"
        )
    for skipped in result.skipped:
        console.print(f"[yellow]skipped[/] {skipped.path}: {skipped.reason}")
    if result.analysis:
        console.print(f"analysis: {result.analysis}")
    for path in result.report_files:
        console.print(f"report: {path}")


def _more(console: Console, total: int) -> None:
    if total > _ROWS_SHOWN:
        console.print(f"... and {total - _ROWS_SHOWN} more (see --report)")
