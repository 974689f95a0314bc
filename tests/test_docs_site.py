"""The README stays a first page: what clotho is, the two commands, the data flow, the command line,
deploying, writing an environment; the rest lives in docs/."""

from __future__ import annotations

import os
import re
import subprocess
import sys
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


def test_the_docs_site_builds_strictly_with_the_api_reference(tmp_path):
    # mkdocs.yml: strict, with missing pages, missing anchors and pages left out of the nav as failures.
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(tmp_path / "site")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert built.returncode == 0, built.stdout + built.stderr
    reference = (tmp_path / "site" / "reference" / "index.html").read_text()
    # Rendered from the docstrings: the contract, the environment API and the loss extension point.
    for name in ("ScoredGroup", "collect_trajectories", "LossInputs", "policy_loss"):
        assert name in reference, f"{name} is missing from the generated API reference"
