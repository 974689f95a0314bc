"""The upstream environments under tests/data/upstream are the files their repositories hold, byte
for byte (README there names the commits): the adapters' tests run what a user would take."""

from __future__ import annotations

import hashlib
from pathlib import Path

UPSTREAM = Path(__file__).resolve().parent / "data" / "upstream"


def test_every_upstream_copy_is_unchanged() -> None:
    recorded = dict(reversed(line.split("  ", 1)) for line in (UPSTREAM / "SHA256SUMS").read_text().splitlines())
    copies = {
        str(p.relative_to(UPSTREAM))
        for p in UPSTREAM.rglob("*")
        if p.is_file() and p.name not in ("README.md", "SHA256SUMS") and "__pycache__" not in p.parts
    }
    assert copies == set(recorded), "a copy without a recorded sha256, or a recorded file missing"
    for name, digest in recorded.items():
        assert hashlib.sha256((UPSTREAM / name).read_bytes()).hexdigest() == digest, f"{name} differs from upstream"
