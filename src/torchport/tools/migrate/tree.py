"""Migrate a file or a directory tree into a separate destination.

The walk first builds a plan and checks it (never write into SRC, never follow
a symlink out of SRC) and only then touches the disk, so a refusal leaves no
half-written output behind.
"""

from __future__ import annotations

import inspect
import os
import shutil
import stat
import tokenize
from collections.abc import Callable
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path
from typing import Literal

import libcst as cst

from torchport.tools.migrate.model import (
    Backend,
    Failure,
    MigrationResult,
    Skipped,
)
from torchport.tools.migrate.rewriter import rewrite_source

PYTHON_SUFFIXES = (".py",)
SKIPPED_DIRS = frozenset({"__pycache__"})


class MigrationError(Exception):
    """A refused or impossible request (bad paths, SRC would be overwritten): a usage error."""


@dataclass
class _Item:
    kind: Literal["dir", "python", "copy", "symlink"]
    src: Path
    dst: Path | None
    rel: str
    link: str = ""


def _inside(path: Path, root: Path) -> bool:
    return path == root or path.is_relative_to(root)


# Python files above this size are copied unchanged and listed as skipped: the rewriter
# (libcst) takes minutes and gigabytes on multi-megabyte files, which are generated code.
MAX_FILE_BYTES = 1 << 20


def _resolve(path: Path) -> Path:
    return Path(os.path.realpath(path))


def migrate_path(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str] | None,
    *,
    backend: str | Backend = "sim",
    report_dir: str | os.PathLike[str] | None = None,
    dry_run: bool = False,
    analyse: bool = False,
    entry: str | os.PathLike[str] | None = None,
    max_file_bytes: int | None = MAX_FILE_BYTES,
    progress: Callable[[int, int, str], None] | None = None,
) -> MigrationResult:
    """Migrate ``src`` (a ``.py`` file or a directory tree) into ``dst``.

    With ``dry_run`` nothing is written to ``dst`` (it may be ``None``); the
    result (and the report, when ``report_dir`` is given) still lists every
    change.  Python files above ``max_file_bytes`` (``None``: no limit) are copied
    unchanged and listed as skipped. ``progress(done, total, path)`` is called before
    each Python file is rewritten. Raises ``MigrationError`` for refusals such as
    ``dst`` inside ``src``.
    """
    backend = Backend.parse(backend)
    src_path = Path(src)
    if not os.path.lexists(src_path):
        raise MigrationError(f"source {src_path} does not exist")
    if dst is None and not dry_run:
        raise MigrationError("an output path (-o DST) is required unless --dry-run is given")
    if dst is not None and not os.fspath(dst):
        raise MigrationError("the output path is empty (an unset shell variable?): it would "
                             "write into the current directory; name the destination")
    src_real = _resolve(src_path)
    check_report_dir(src_path, report_dir)
    dst_path = None if dst is None else Path(dst)
    result = MigrationResult(src=src_path, dst=dst_path, backend=backend, dry_run=dry_run)

    if src_real.is_dir():
        plan = _plan_tree(src_real, dst_path, result)
    elif src_real.is_file():
        target = None
        if dst_path is not None:
            target = dst_path / src_path.name if dst_path.is_dir() else dst_path
        plan = [
            _Item("python" if _is_python(src_real) else "copy", src_real, target, src_path.name)
        ]
    else:
        raise MigrationError(f"source {src_path} is neither a file nor a directory")
    _check_plan(src_real, dst_path, plan)
    if not dry_run and dst_path is not None:
        _check_destination(src_real, dst_path)

    total = sum(item.kind == "python" for item in plan)
    done = 0
    for item in plan:
        if item.kind == "python":
            if max_file_bytes is not None and item.src.stat().st_size > max_file_bytes:
                size = item.src.stat().st_size
                result.skipped.append(Skipped(item.rel, (
                    f"{size} bytes, above the {max_file_bytes}-byte limit: copied unchanged "
                    f"(--max-file-size raises the limit)")))
                item = _Item("copy", item.src, item.dst, item.rel)
            elif progress is not None:
                progress(done, total, item.rel)
            done += 1
        try:
            _execute(item, backend, result, dry_run)
        except OSError as exc:  # the destination refuses a write: say where
            raise MigrationError(f"cannot write {item.dst}: {exc.strerror or exc}; choose a "
                                 f"writable destination") from None
    if not dry_run:
        _copy_dir_modes(plan)
    if analyse:
        result.analysis, result.analysis_report = _analyse(result, plan, entry, report_dir, dry_run)
    if report_dir is not None:
        from torchport.tools.migrate.report import write_reports

        result.report_files = write_reports(result, Path(report_dir))
    return result


def check_report_dir(src: str | os.PathLike[str],
                     report_dir: str | os.PathLike[str] | None) -> None:
    """Refuse a report directory inside the source tree, as a destination there is."""
    if report_dir is None:
        return
    if not os.fspath(report_dir):
        raise MigrationError("the report path is empty (an unset shell variable?); name the "
                             "report directory")
    src_real = _resolve(Path(src))
    if src_real.is_dir() and _inside(_resolve(Path(report_dir)), src_real):
        raise MigrationError(f"refusing to write the report inside the source tree: "
                             f"{report_dir} is in {src_real}")


def _replace_file(dst: Path, src: Path, data: bytes | None) -> None:
    """Write ``dst`` as a new file (``data``, or a copy of ``src``) with ``src``'s mode,
    then rename it over the old one: never through an existing inode, which may be a
    hard link to the source."""
    tmp = dst.with_name(f".{dst.name}.torchport-{os.getpid()}.tmp")
    try:
        if data is None:
            shutil.copy2(src, tmp)
        else:
            tmp.write_bytes(data)
            shutil.copymode(src, tmp)
        os.replace(tmp, dst)
    finally:
        if os.path.lexists(tmp):
            tmp.unlink()


def _is_python(path: Path) -> bool:
    return path.suffix in PYTHON_SUFFIXES


def _plan_tree(src_real: Path, dst: Path | None, result: MigrationResult) -> list[_Item]:
    plan: list[_Item] = []
    for dirpath, dirnames, filenames in os.walk(src_real, followlinks=False):
        here = Path(dirpath)
        rel_dir = here.relative_to(src_real)
        if rel_dir != Path("."):
            plan.append(
                _Item("dir", here, None if dst is None else dst / rel_dir, rel_dir.as_posix())
            )
        keep_dirs = []
        for name in sorted(dirnames):
            full = here / name
            if full.is_symlink():
                plan.extend(_plan_symlink(full, src_real, dst, result))
            elif name not in SKIPPED_DIRS:
                keep_dirs.append(name)
        dirnames[:] = keep_dirs
        for name in sorted(filenames):
            full = here / name
            rel = (rel_dir / name).as_posix()
            target = None if dst is None else dst / rel_dir / name
            if full.is_symlink():
                plan.extend(_plan_symlink(full, src_real, dst, result))
            elif stat.S_ISREG(full.lstat().st_mode):
                plan.append(_Item("python" if _is_python(full) else "copy", full, target, rel))
            else:
                result.skipped.append(Skipped(rel, "not a regular file"))
    return plan


def _plan_symlink(
    link: Path, src_real: Path, dst: Path | None, result: MigrationResult
) -> list[_Item]:
    """Symlinks inside the tree are recreated: a relative one with its own text (so that
    dangling links and loops stay what they were), an absolute one made relative; ones
    leaving the tree are skipped."""
    rel = link.relative_to(src_real).as_posix()
    text = os.readlink(link)
    if os.path.isabs(text):
        target = _resolve(link)
        inside = _inside(target, src_real)
        text = os.path.relpath(target, _resolve(link.parent))
    else:
        target = Path(os.path.normpath(link.parent / text))
        inside = _inside(target, src_real) and (
            not os.path.exists(link) or _inside(_resolve(link), src_real))
    if not inside:
        result.skipped.append(Skipped(rel, f"symlink points outside the source tree ({target})"))
        return []
    return [_Item("symlink", link, None if dst is None else dst / rel, rel, link=text)]


def _check_plan(src_real: Path, dst: Path | None, plan: list[_Item]) -> None:
    if dst is None:
        return
    dst_real = _resolve(dst)
    if dst_real == src_real:
        raise MigrationError(f"refusing to overwrite the source: {dst} is {src_real}")
    if src_real.is_dir() and _inside(dst_real, src_real):
        raise MigrationError(f"refusing to write inside the source tree: {dst} is in {src_real}")
    for item in plan:
        if item.dst is not None and _inside(_resolve(item.dst), src_real):
            raise MigrationError(f"refusing to overwrite the source: {item.dst} is in {src_real}")


def _check_destination(src_real: Path, dst: Path) -> None:
    """A usage error, before anything is written, for a destination that cannot be one:
    a file where a tree goes, or a folder that cannot be written."""
    if src_real.is_dir() and os.path.lexists(dst) and not dst.is_dir():
        raise MigrationError(f"the destination {dst} is a file; a source tree needs a "
                             f"directory (a new path, or an existing directory)")
    existing = dst if dst.is_dir() else dst.parent if src_real.is_file() else None
    while existing is not None and not existing.exists() and existing != existing.parent:
        existing = existing.parent  # the folder that will hold what is created
    if existing is None and src_real.is_dir():
        existing = next((p for p in dst.parents if p.exists()), None)
    if existing is not None and existing.is_dir() and not os.access(existing, os.W_OK | os.X_OK):
        raise MigrationError(f"the destination {existing} is not writable; choose another "
                             f"output path or change its permissions")


def _execute(item: _Item, backend: Backend, result: MigrationResult, dry_run: bool) -> None:
    if item.kind == "dir":
        if not dry_run and item.dst is not None:
            item.dst.mkdir(parents=True, exist_ok=True)
        return
    if item.kind == "symlink":
        if not dry_run and item.dst is not None:
            item.dst.parent.mkdir(parents=True, exist_ok=True)
            if os.path.lexists(item.dst):
                item.dst.unlink()
            os.symlink(item.link, item.dst)
        return
    if not os.access(item.src, os.R_OK):
        result.skipped.append(Skipped(item.rel, "not readable"))
        return
    new_bytes: bytes | None = None
    if item.kind == "python":
        result.files_scanned += 1
        new_bytes = _migrate_python(item, backend, result)
    else:
        result.files_copied += 1
    if dry_run or item.dst is None:
        return
    item.dst.parent.mkdir(parents=True, exist_ok=True)
    _replace_file(item.dst, item.src, new_bytes)


def _migrate_python(item: _Item, backend: Backend, result: MigrationResult) -> bytes | None:
    """Rewrite one file; ``None`` means "copy it unchanged"."""
    data = item.src.read_bytes()
    try:
        encoding, _ = tokenize.detect_encoding(BytesIO(data).readline)
        data.decode(encoding)
    except (SyntaxError, UnicodeDecodeError, LookupError) as exc:
        result.failures.append(Failure(item.rel, "decode", f"cannot decode: {exc}"))
        return None
    try:
        outcome = rewrite_source(data, backend, path=item.rel)
    except cst.ParserSyntaxError as exc:
        detail = exc.message.splitlines()[0] if exc.message else "syntax error"
        message = f"line {exc.editor_line}: {detail}"
        result.failures.append(Failure(item.rel, "parse", message))
        return None
    except (SyntaxError, UnicodeError) as exc:
        result.failures.append(Failure(item.rel, "decode", str(exc)))
        return None
    except Exception as exc:  # a rewriter bug must not abort a whole tree
        result.failures.append(Failure(item.rel, "error", f"{type(exc).__name__}: {exc}"))
        return None
    result.add_findings(outcome.findings)
    if not outcome.changes:
        return None
    result.changes.extend(outcome.changes)
    result.files_changed.append(item.rel)
    assert isinstance(outcome.code, bytes)
    return outcome.code


def _copy_dir_modes(plan: list[_Item]) -> None:
    # Deepest first, and after the files: a read-only source dir stays writable until then.
    for item in sorted(plan, key=lambda i: i.rel.count("/"), reverse=True):
        if item.kind == "dir" and item.dst is not None:
            shutil.copymode(item.src, item.dst)


def _analyse(
    result: MigrationResult,
    plan: list[_Item],
    entry: str | os.PathLike[str] | None,
    report_dir: str | os.PathLike[str] | None,
    dry_run: bool,
) -> tuple[str, Path | None]:
    """Glue to torchport.tools.debug.opcoverage, which runs the migrated script and reports op coverage.

    Returns a one-line outcome for the report and, when the coverage tool
    returned a path to its own report, that path (so the report can link it).
    """
    try:
        from torchport.tools.debug.opcoverage import run_script_coverage  # type: ignore[import-not-found]
    except ImportError:
        return "not available: torchport.tools.debug.opcoverage.run_script_coverage is missing", None
    if dry_run:
        return "skipped: nothing is written in a dry run", None
    script: Path | None = None
    if not _resolve(result.src).is_dir():
        script = plan[0].dst  # a single migrated file is its own entry script
    elif entry is not None and result.dst is not None:
        script = result.dst / entry
    if script is None:
        return "skipped: name the entry script (relative to SRC) with --entry", None
    kwargs: dict[str, object] = {}
    try:
        parameters = inspect.signature(run_script_coverage).parameters
    except (TypeError, ValueError):
        parameters = {}
    if report_dir is not None and "report_dir" in parameters:
        kwargs["report_dir"] = Path(report_dir)
    if "transfer" in parameters:  # the migrated code must run on the device on its own
        kwargs["transfer"] = False
    try:
        report = run_script_coverage(script, **kwargs)
    except Exception as exc:  # advisory only: the migration itself succeeded
        return f"FAILED on {script}: {type(exc).__name__}: {exc}", None
    if getattr(report, "ok", True) is False:  # the script crashed: its coverage is partial
        from torchport.tools.migrate.report import last_error_line

        html = getattr(report, "html_path", None)
        return (f"FAILED: {script} exited {getattr(report, 'exit_code', '?')}: "
                f"{last_error_line(getattr(report, 'error', None))}",
                Path(html) if html is not None else None)
    path = Path(report) if isinstance(report, (str, os.PathLike)) else None
    if path is not None and path.exists():
        return f"coverage of {script}", path
    return f"coverage of {script}: {report}", None
