"""The README stays a first page: what clotho is, the two commands, the data flow, the command line,
deploying, writing an environment; the rest lives in docs/."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_readme_stays_a_first_page():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move detail into docs/ instead"


def test_every_link_between_pages_lands_on_a_file():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    broken = [
        f"{page.relative_to(REPO)} -> {target}"
        for page in pages
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text())
        if not target.startswith(("http://", "https://")) and not (page.parent / target).exists()
    ]
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)
