"""The documentation: the generated configuration page is current, relative links resolve, and
the source paths and module names the pages and reports give exist."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from torchport.tools.info import configuration_markdown

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_configuration_page_is_generated() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page == configuration_markdown(), (
        "docs/configuration.md is out of date with src/torchport/tools/info.py; regenerate it: "
        ".venv/bin/python -m torchport.tools.info --markdown > docs/configuration.md")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    assert page.exists()
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # URLs and in-page anchors
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: links to missing files: {broken}"


SRC = ROOT / "src"
# what names source: the documentation, the committed reports, and the code writing the reports
NAMING = [ROOT / "README.md", ROOT / "tests" / "README.md", *sorted((ROOT / "docs").glob("*.md")),
          *sorted((ROOT / "reports").glob("*.md")),
          *sorted((SRC / "torchport" / "tools" / "conformance").glob("*.py")),
          *sorted((ROOT / "tests" / "conformance").glob("*.py"))]
SOURCE_PATH = re.compile(r"(?<![\w./-])(?:src/)?torchport/[\w./*-]*\w/?")
MODULE_NAME = re.compile(r"(?<![\w./-])torchport(?:\.\w+)+")


def _module_source(dotted: str) -> Path | None:
    """The file (a package's ``__init__.py``) or folder that module ``dotted`` is, if any."""
    path = SRC.joinpath(*dotted.split("."))
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return path if path.is_dir() else None


def _defined_names(source: Path) -> set[str]:
    """The names a module binds at its top level, those its ``__all__`` exports, and with a
    module ``__getattr__`` the keys of its tables (the packages resolve names on first use)."""
    if source.is_dir():
        return {child.stem for child in source.iterdir()}
    names, tables = set(), set()
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            tables |= {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                names |= {c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names | tables if "__getattr__" in names else names


def _names_something(dotted: str) -> bool:
    """Whether ``dotted`` is a module, or a module then a name it defines."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        source = _module_source(".".join(parts[:end]))
        if source is not None:
            return (end == len(parts) or re.fullmatch(r"__\w+__", parts[end]) is not None
                    or parts[end] in _defined_names(source))
    return False


def _names_a_path(path: str) -> bool:
    relative = path.removeprefix("src/")
    return any(SRC.glob(relative)) if "*" in relative else (SRC / relative).exists()


@pytest.mark.parametrize("page", NAMING, ids=lambda p: str(p.relative_to(ROOT)))
def test_source_paths_and_module_names_exist(page: Path) -> None:
    """``src/torchport/...`` / ``torchport/...`` paths and ``torchport.x.y`` names in a page, a
    report or a report's generator name real files and modules (not the ones moved away)."""
    text = page.read_text()
    stale = sorted({p for p in SOURCE_PATH.findall(text) if not _names_a_path(p)}
                   | {m for m in MODULE_NAME.findall(text) if not _names_something(m)})
    assert not stale, f"{page.relative_to(ROOT)} names missing paths or modules: {stale}"
