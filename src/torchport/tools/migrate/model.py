"""Plain data records shared by the rewriter, the tree walker and the report.

They are dataclasses (not rich/typer objects) so the Python API can be used
from tests and notebooks without any terminal machinery.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from torchport.tools.migrate.apis import FindingKind

_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MODULE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


class BackendSpecError(ValueError):
    """The ``--backend`` value is malformed (a usage error)."""


@dataclass(frozen=True)
class Backend:
    """Target device: its name (``torch.<name>``, ``"<name>:0"``) and the module to import."""

    name: str = "sim"
    module: str = "torchport.sim"

    @property
    def collective(self) -> str:
        """Name of the collective library replacing ``"nccl"`` (``sim`` -> ``simccl``)."""
        return f"{self.name}ccl"

    @classmethod
    def parse(cls, spec: str | Backend) -> Backend:
        """Parse ``NAME`` (module ``torchport.NAME``) or ``NAME=some.module``."""
        if isinstance(spec, Backend):
            return spec
        name, sep, module = spec.strip().partition("=")
        name = name.strip()
        module = module.strip() if sep else f"torchport.{name}"
        if not _NAME_RE.fullmatch(name) or name == "cuda":
            raise BackendSpecError(f"invalid backend name {name!r} in {spec!r}")
        if not _MODULE_RE.fullmatch(module):
            raise BackendSpecError(f"invalid backend module {module!r} in {spec!r}")
        return cls(name=name, module=module)


@dataclass
class Change:
    """One rewrite: where it happened (1-based line/column) and the source before/after."""

    path: str
    line: int
    column: int
    rule: str
    before: str
    after: str
    note: str = ""
    #: for a backend import: the imported libraries that choose the device through it
    libraries: tuple[str, ...] = ()


@dataclass
class Finding:
    """An API that was not migrated (unsupported), may not exist (unknown), or is inert (no-effect)."""

    path: str
    line: int
    column: int
    kind: FindingKind
    api: str
    reason: str


FailureKind = Literal["parse", "decode", "error"]


@dataclass
class Failure:
    """A Python file that could not be migrated; it was copied unchanged."""

    path: str
    kind: FailureKind
    message: str


@dataclass
class Skipped:
    """A path that was not migrated: not copied (a symlink leaving the source tree) or
    copied unchanged (a Python file above the size limit)."""

    path: str
    reason: str


@dataclass
class MigrationResult:
    """Everything ``migrate_path`` did or would do (with ``dry_run``)."""

    src: Path
    dst: Path | None
    backend: Backend
    dry_run: bool = False
    files_scanned: int = 0
    files_copied: int = 0
    files_changed: list[str] = field(default_factory=list)
    changes: list[Change] = field(default_factory=list)
    unsupported: list[Finding] = field(default_factory=list)
    unknown: list[Finding] = field(default_factory=list)
    no_effect: list[Finding] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    report_files: list[Path] = field(default_factory=list)
    analysis: str | None = None
    analysis_report: Path | None = None

    def add_findings(self, findings: list[Finding]) -> None:
        """File findings into the list matching their kind."""
        for finding in findings:
            {"unsupported": self.unsupported, "unknown": self.unknown, "no-effect": self.no_effect}[
                finding.kind
            ].append(finding)

    @property
    def summary(self) -> dict[str, int]:
        """Counts shown in the terminal table and at the top of the report."""
        return {
            "files scanned": self.files_scanned,
            "files changed": len(self.files_changed),
            "changes": len(self.changes),
            "unsupported": len(self.unsupported),
            "unknown": len(self.unknown),
            "no effect": len(self.no_effect),
            "parse failures": len(self.failures),
            "skipped": len(self.skipped),
        }
