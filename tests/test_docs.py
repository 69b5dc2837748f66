"""The documentation: the generated configuration page is current, and relative links resolve."""

from __future__ import annotations

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
