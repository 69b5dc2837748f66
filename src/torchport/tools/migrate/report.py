"""Markdown and CSV migration reports.

Markdown is for people reviewing a port (what changed, what still needs a
human); the CSV carries the same rows for spreadsheets and scripts.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import TYPE_CHECKING

from torchport.tools.migrate.apis import DEVICE_CHOOSING_LIBRARIES
from torchport.tools.migrate.model import Change, Finding, MigrationResult

if TYPE_CHECKING:
    from torchport.tools.debug.opcoverage import ScriptAnalysis

MARKDOWN_NAME = "migration_report.md"
CSV_NAME = "migration_report.csv"
CSV_COLUMNS = ("category", "file", "line", "column", "rule_or_api", "before", "after", "detail")
_SNIPPET_LIMIT = 240


def write_reports(result: MigrationResult, report_dir: Path,
                  analyses: list[ScriptAnalysis] | None = None) -> list[Path]:
    """Write ``migration_report.md`` and ``migration_report.csv`` into ``report_dir``.

    ``analyses`` (``migrate --analyse``) adds the op coverage of the migrated
    scripts: the ops that would fall back to the CPU, and the scripts that failed.
    """
    report_dir.mkdir(parents=True, exist_ok=True)
    markdown = report_dir / MARKDOWN_NAME
    table = report_dir / CSV_NAME
    markdown.write_text(render_markdown(result, report_dir, analyses), encoding="utf-8")
    with table.open("w", encoding="utf-8", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(CSV_COLUMNS)
        writer.writerows(csv_rows(result, analyses))
    return [markdown, table]


def csv_rows(result: MigrationResult, analyses: list[ScriptAnalysis] | None = None
             ) -> list[tuple[str, str, str, str, str, str, str, str]]:
    """One row per change, finding, failure, skipped path and analysed script / fallback op."""
    rows: list[tuple[str, str, str, str, str, str, str, str]] = []
    for change in result.changes:
        rows.append(
            (
                "change",
                change.path,
                str(change.line),
                str(change.column),
                change.rule,
                change.before,
                change.after,
                change.note,
            )
        )
    for category, findings in _finding_groups(result):
        for finding in findings:
            rows.append(
                (
                    category,
                    finding.path,
                    str(finding.line),
                    str(finding.column),
                    finding.api,
                    "",
                    "",
                    finding.reason,
                )
            )
    for failure in result.failures:
        rows.append((f"{failure.kind}-failure", failure.path, "", "", "", "", "", failure.message))
    for skipped in result.skipped:
        rows.append(("skipped", skipped.path, "", "", "", "", "", skipped.reason))
    for a in analyses or []:
        script = _script_name(a, result)
        if a.result is None or a.exit_code:
            rows.append(("coverage-failure", script, "", "", "", " ".join(a.args), "",
                         f"exit {a.exit_code}: {last_error_line(a.error)}"))
        if a.result is not None:
            rows.append(("coverage", script, "", "", "", " ".join(a.args), "",
                         a.result.summary()))
            for op in a.fallback_ops:
                rows.append(("fallback-op", script, "", "", op.name, "", "",
                             f"calls {op.calls}; dtypes {','.join(op.dtypes)}"))
    return rows


def _script_name(a: ScriptAnalysis, result: MigrationResult) -> str:
    base = result.dst if result.dst is not None and result.dst.is_dir() else None
    if base is not None:
        try:
            return a.script.resolve().relative_to(base.resolve()).as_posix()
        except ValueError:
            pass
    return a.script.name


def library_imports(result: MigrationResult) -> list[Change]:
    """The backend imports added for libraries that choose the device themselves."""
    return [c for c in result.changes if c.rule == "backend-import" and c.libraries]


def last_error_line(text: str | None) -> str:
    """The last line of a failed script's output: its exception, usually."""
    lines = (text or "").strip().splitlines()
    return lines[-1].strip() if lines else "no result"


def _link(target: Path | None, report_dir: Path | None) -> str:
    if target is None:
        return ""
    if report_dir is not None:
        try:
            target = Path(os.path.relpath(target.resolve(), report_dir.resolve()))
        except ValueError:
            pass
    return f"[{target.name}]({target.as_posix()})"


def render_analyses(result: MigrationResult, analyses: list[ScriptAnalysis],
                    report_dir: Path | None = None) -> list[str]:
    """The Markdown section on op coverage of the migrated scripts."""
    lines = ["", "## Op coverage of the migrated scripts", ""]
    if not analyses:
        lines.append(result.analysis or "No script was analysed.")
        return lines
    lines += ["Each script ran on the device with op recording (`torchport coverage`); "
              "ops without a device kernel ran on the CPU.", "",
              "| script | args | outcome | overloads | fall back to CPU | report |",
              "|---|---|---|---:|---:|---|"]
    for a in analyses:
        outcome = "ok" if a.ok else f"**FAILED** (exit {a.exit_code})"
        n = "" if a.result is None else str(len(a.result.ops))
        nfb = "" if a.result is None else str(len(a.fallback_ops))
        lines.append(f"| {_cell(_script_name(a, result))} | {_code(' '.join(a.args))} "
                     f"| {outcome} | {n} | {nfb} | {_link(a.html_path, report_dir)} |")
    lines += ["", "### Ops that would fall back to CPU", ""]
    fb = [(a, op) for a in analyses for op in a.fallback_ops]
    if fb:
        lines += ["| script | overload | calls | dtypes |", "|---|---|---:|---|"]
        for a, op in fb:
            lines.append(f"| {_cell(_script_name(a, result))} | `{op.name}` | {op.calls} "
                         f"| {_cell(', '.join(op.dtypes))} |")
    failed = [a for a in analyses if not a.ok]
    if failed:  # a crash stops the recording: no claim about the ops it never reached
        note = ("Incomplete: " + ", ".join(_cell(_script_name(a, result)) for a in failed)
                + " FAILED, so only the ops that ran before the failure were recorded.")
        lines += ["", note] if fb else ["None recorded. " + note]
    elif not fb:
        lines.append("None: every op the analysed scripts used has a device kernel, a "
                     "decomposition or is a view.")
    if failed:
        lines += ["", "### Scripts that FAILED (the migration itself was written)", "",
                  "| script | exit code | error |", "|---|---:|---|"]
        for a in failed:
            lines.append(f"| {_cell(_script_name(a, result))} | {a.exit_code} "
                         f"| {_cell(last_error_line(a.error))} |")
    return lines


def _finding_groups(result: MigrationResult) -> list[tuple[str, list[Finding]]]:
    return [
        ("unsupported", result.unsupported),
        ("unknown", result.unknown),
        ("no-effect", result.no_effect),
    ]


def _cell(text: str) -> str:
    text = text.replace("\r\n", "\n").replace("\n", " ⏎ ")
    if len(text) > _SNIPPET_LIMIT:
        text = text[: _SNIPPET_LIMIT - 1] + "…"
    return text.replace("|", "\\|")


def _code(text: str) -> str:
    if not text:
        return ""
    text = _cell(text)
    fence = "``" if "`" in text else "`"
    pad = " " if "`" in text else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def render_markdown(result: MigrationResult, report_dir: Path | None = None,
                    analyses: list[ScriptAnalysis] | None = None) -> str:
    """The human-readable report; ``report_dir`` makes links relative to it."""
    backend = result.backend
    lines = [
        "# torchport migration report",
        "",
        f"- Source: `{result.src}`",
        ("- Destination: none" if result.dst is None else f"- Destination: `{result.dst}`")
        + (" (dry run: nothing was written)" if result.dry_run else ""),
        f"- Backend: `{backend.name}` (import `{backend.module}`, "
        f"collectives `{backend.collective}`)",
        "",
        "## Summary",
        "",
        "| | count |",
        "|---|---:|",
    ]
    lines += [f"| {name} | {count} |" for name, count in result.summary.items()]
    lines += ["", "## Changes", ""]
    lines += _md_table(
        ["location", "rule", "before", "after", "note"],
        [[f"{_cell(c.path)}:{c.line}", c.rule, _code(c.before), _code(c.after), _cell(c.note)]
         for c in result.changes], empty="No changes.")
    lines += ["", "## Libraries that choose the device", "",
              "Modules importing a library that picks its device from a fixed list of "
              "vendors got the backend import: registering the backend is what makes the "
              "library choose the device (no call in the script changes)."]
    lines += [""] + _md_table(
        ["location", "library", "how it finds the device"],
        [[f"{_cell(c.path)}:{c.line}", lib,
          _cell(DEVICE_CHOOSING_LIBRARIES[lib].format(device=backend.name))]
         for c in library_imports(result) for lib in c.libraries])
    titles = {
        "unsupported": "Unsupported (left unchanged, need a human)",
        "unknown": f"Unknown APIs (renamed; `torch.{backend.name}` is not known to provide them)",
        "no-effect": f"No effect on `{backend.name}` (left unchanged, harmless)",
    }
    lines += ["", "## Needs attention", "",
              "What still names CUDA after the migration, by location: what has no "
              "equivalent or could not be proven a device, what was renamed on trust, and "
              "what is accepted but does nothing."]
    for category, findings in _finding_groups(result):
        lines += ["", f"### {titles[category]}", ""]
        lines += _md_table(["location", "API", "reason"],
                           [[f"{_cell(f.path)}:{f.line}", _code(f.api), _cell(f.reason)]
                            for f in findings])
    lines += ["", "## Files copied unchanged because they could not be migrated", ""]
    lines += _md_table(["file", "problem", "message"],
                       [[_cell(f.path), f.kind, _cell(f.message)] for f in result.failures])
    lines += ["", "## Skipped paths", ""]
    lines += _md_table(["path", "reason"],
                       [[_cell(k.path), _cell(k.reason)] for k in result.skipped])
    if analyses is not None:
        lines += render_analyses(result, analyses, report_dir)
    elif result.analysis is not None:
        lines += ["", "## Coverage analysis", "", _analysis_line(result, report_dir)]
    return "\n".join(lines) + "\n"


def _analysis_line(result: MigrationResult, report_dir: Path | None) -> str:
    text = result.analysis or ""
    if result.analysis_report is None:
        return text
    target = result.analysis_report
    if report_dir is not None:
        try:
            target = Path(os.path.relpath(target.resolve(), report_dir.resolve()))
        except ValueError:
            pass
    return f"{text}: [{target.name}]({target.as_posix()})"


def _md_table(header: list[str], rows: list[list[str]], empty: str = "None.") -> list[str]:
    """Markdown table lines (cells already escaped), or ``empty`` when there are no rows."""
    if not rows:
        return [empty]
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(str(c) for c in r) + " |" for r in rows)]
