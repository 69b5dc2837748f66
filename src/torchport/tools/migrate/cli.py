"""``torchport migrate``: the command-line face of :func:`torchport.tools.migrate.migrate_path`.

The lead's main typer app calls :func:`register`; nothing here runs at import.
Exit codes: 0 success (even when unsupported APIs were found: they are in the
report), 3 when ``--analyse`` ran a migrated script that failed (the migration is
written all the same; the terminal and the report name the script and its error),
2 usage errors and refusals, 1 internal failures.

``--analyse`` runs ``torchport coverage`` on each migrated entry script (a file
with ``if __name__ == "__main__"``) in a subprocess, or on the scripts named
with ``--analyse-script FILE`` and the arguments after ``--``; the ops that
would fall back to the CPU go into the report. A script that fails is a failure,
not a clean coverage result: its ops were only recorded up to the crash.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table

from torchport.tools.migrate.apis import DEVICE_CHOOSING_LIBRARIES
from torchport.tools.migrate.model import BackendSpecError, MigrationResult
from torchport.tools.migrate.report import last_error_line, library_imports
from torchport.tools.migrate.tree import (
    MAX_FILE_BYTES,
    MigrationError,
    check_report_dir,
    migrate_path,
)

if TYPE_CHECKING:
    from torchport.tools.debug.opcoverage import ScriptAnalysis

_ROWS_SHOWN = 25
#: Exit code when an analysed script failed (as ``torchport coverage``'s 3: a finding, not
#: a usage error or a crash of the tool).
EXIT_ANALYSIS_FAILED = 3


def register(app: typer.Typer) -> None:
    """Add the ``migrate`` command to ``app``."""
    app.command(
        "migrate",
        help="Rewrite CUDA PyTorch code (a file or a tree) for a torchport backend. "
        "With --analyse, run the op-coverage analysis of the migrated scripts "
        "(arguments for them follow --). Exit code: 0 success, 3 when an analysed "
        "script failed (the migration is still written; the failure is listed), "
        "2 usage error, 1 internal error.",
        context_settings={"allow_extra_args": True},
    )(migrate_command)


def migrate_command(
    ctx: typer.Context,
    src: Annotated[
        Path, typer.Argument(metavar="SRC", help="File or directory to migrate (never modified).")
    ],
    output: Annotated[
        str | None,
        typer.Option("-o", "--output", metavar="DST", help="Where to write the migrated copy."),
    ] = None,
    backend: Annotated[
        str,
        typer.Option(
            "--backend", "-b",
            metavar="NAME[=MODULE]", help="NAME (imports torchport.NAME) or NAME=some.module."
        ),
    ] = "sim",
    report_arg: Annotated[
        str | None,
        typer.Option(
            "--report",
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
            help="Run torchport's op-coverage analysis on the migrated entry scripts; "
            "exit 3 if one of them fails.",
        ),
    ] = False,
    entry: Annotated[
        Path | None,
        typer.Option(
            metavar="FILE", help="Entry script, relative to SRC, for --analyse on a directory."
        ),
    ] = None,
    analyse_script: Annotated[
        list[Path] | None,
        typer.Option(
            "--analyse-script",
            "--analyze-script",
            metavar="FILE",
            help="Analyse this script (relative to SRC; repeatable) with the arguments "
            "after --; implies --analyse.",
        ),
    ] = None,
    analyse_timeout: Annotated[
        float, typer.Option(metavar="SECONDS", help="Time limit per analysed script.")
    ] = 600.0,
    max_file_size: Annotated[
        int,
        typer.Option(
            metavar="BYTES", min=0,
            help="Copy Python files larger than this unchanged (listed as skipped); "
            "0: no limit.",
        ),
    ] = MAX_FILE_BYTES,
) -> None:
    """Migrate SRC into -o DST and print a summary."""
    console = Console()
    errors = Console(stderr=True)
    script_args = list(ctx.args)
    analyses: list[ScriptAnalysis] = []
    chosen = [*(analyse_script or []), *([entry] if entry is not None else [])]
    wanted = analyse or bool(chosen)
    if script_args and not chosen:
        errors.print(
            f"[bold red]error:[/] unexpected arguments {' '.join(script_args)!r} "
            "(script arguments need --analyse-script FILE before --)", soft_wrap=True
        )
        raise typer.Exit(2)
    try:
        check_report_dir(src, report_arg)  # also when the analysis writes the report
        report = None if report_arg is None else Path(report_arg)
        with Progress(TextColumn("migrating"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("{task.description}"), console=errors,
                      transient=True) as bar:
            task = bar.add_task("", total=None)

            def progress(done: int, total: int, path: str) -> None:
                bar.update(task, completed=done, total=total, description=path)

            result = migrate_path(
                src,
                output,
                backend=backend,
                report_dir=None if wanted else report,
                dry_run=dry_run,
                max_file_bytes=max_file_size or None,
                progress=progress,
            )
        if wanted:
            analyses = _analyse(result, chosen, script_args, report, analyse_timeout, console)
            if report is not None:
                from torchport.tools.migrate.report import write_reports

                result.report_files = write_reports(result, report, analyses)
    except (MigrationError, BackendSpecError) as exc:
        errors.print(f"[bold red]error:[/] {exc}", soft_wrap=True)  # paths kept whole
        raise typer.Exit(2) from None
    except Exception as exc:
        errors.print(f"[bold red]internal error:[/] {type(exc).__name__}: {exc}", soft_wrap=True)
        raise typer.Exit(1) from None
    _print_result(console, result)
    if wanted and any(not a.ok for a in analyses):
        raise typer.Exit(EXIT_ANALYSIS_FAILED)


def _dst_script(result: MigrationResult, name: Path) -> Path:
    """Where script ``name`` (given relative to SRC, or as a path in SRC/DST) was migrated to."""
    assert result.dst is not None
    if not result.src.is_dir():  # a single file: DST is the file or a directory holding it
        return result.dst / result.src.name if result.dst.is_dir() else result.dst
    for base in (result.src, result.dst):
        try:
            return result.dst / name.resolve().relative_to(base.resolve())
        except ValueError:
            continue
    return result.dst / name


def _analyse(
    result: MigrationResult,
    chosen: list[Path],
    script_args: list[str],
    report: Path | None,
    timeout: float,
    console: Console,
) -> list[ScriptAnalysis]:
    """Coverage of the migrated scripts, each in its own subprocess (failures are reported)."""
    from torchport.tools.debug.opcoverage import find_entry_scripts, run_script_coverage

    if result.dry_run or result.dst is None:
        result.analysis = "skipped: nothing is written in a dry run"
        return []
    if chosen:
        scripts = [(_dst_script(result, c), script_args) for c in chosen]
    else:
        scripts = [(p, []) for p in find_entry_scripts(result.dst)]
    root = result.dst if result.dst.is_dir() else result.dst.parent
    spec = result.backend.module if result.backend.module else result.backend.name
    analyses = []
    for script, args in scripts:
        rel = script.relative_to(root).as_posix() if script.is_relative_to(root) else script.name
        console.print(f"analysing [bold]{rel}[/] {' '.join(args)}".rstrip())
        if not script.is_file():
            from torchport.tools.debug.opcoverage import ScriptAnalysis

            analyses.append(ScriptAnalysis(script, args, 2, error=f"no such script: {script}"))
            continue
        name = rel.removesuffix(".py").replace("/", "_")
        # transfer off: the migrated code must run on the device on its own
        analyses.append(run_script_coverage(script, args, report_dir=report, cwd=root,
                                            timeout=timeout, backend=spec, name=name,
                                            transfer=False))
    result.analysis = analysis_summary(analyses, root)
    _print_analyses(console, analyses, root)
    return analyses


def _rel(script: Path, root: Path) -> str:
    return script.relative_to(root).as_posix() if script.is_relative_to(root) else script.name


def analysis_summary(analyses: list[ScriptAnalysis], root: Path) -> str:
    """One line for the terminal and the report; a failed script is named as FAILED.

    The fallback list only covers the ops that ran, so with a failure it is marked
    incomplete rather than claiming every op has a device kernel.
    """
    if not analyses:
        return "no entry script found (name one with --analyse-script FILE)"
    ok = sum(a.ok for a in analyses)
    failed = [a for a in analyses if not a.ok]
    fb = sorted({op.name for a in analyses for op in a.fallback_ops})
    text = (f"{len(analyses)} script(s) analysed, {ok} ran, {len(failed)} failed; "
            "fall back to CPU: " + (", ".join(fb) if fb else "none"))
    if failed:
        text += (" (incomplete: only the ops that ran before the failure); FAILED: "
                 + "; ".join(f"{_rel(a.script, root)} (exit {a.exit_code}: "
                             f"{last_error_line(a.error)})" for a in failed))
    return text


def _print_analyses(console: Console, analyses: list[ScriptAnalysis], root: Path) -> None:
    if not analyses:
        return
    table = Table(title="Op coverage of the migrated scripts")
    for column in ("script", "outcome", "overloads", "fall back to CPU", "error"):
        table.add_column(column, overflow="fold")
    for a in analyses:
        outcome = "ok" if a.ok else f"[bold red]FAILED[/] (exit {a.exit_code})"
        table.add_row(_rel(a.script, root), outcome,
                      "" if a.result is None else str(len(a.result.ops)),
                      ", ".join(op.name for op in a.fallback_ops) or "-",
                      "" if a.ok else escape(last_error_line(a.error)))
    console.print(table)


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

    libraries = library_imports(result)
    if libraries:
        table = Table(title="Libraries that choose the device (backend import added)")
        for column in ("location", "library", "how it finds the device"):
            table.add_column(column, overflow="fold")
        for change in libraries[:_ROWS_SHOWN]:
            for lib in change.libraries:
                table.add_row(f"{change.path}:{change.line}", lib,
                              DEVICE_CHOOSING_LIBRARIES[lib].format(device=result.backend.name))
        console.print(table)
        _more(console, len(libraries))

    findings = [*result.unsupported, *result.unknown, *result.no_effect]
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
        console.print(f"analysis: {escape(result.analysis)}")
    for path in result.report_files:
        console.print(f"report: {path}")


def _more(console: Console, total: int) -> None:
    if total > _ROWS_SHOWN:
        console.print(f"... and {total - _ROWS_SHOWN} more (see --report)")
