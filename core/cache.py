"""Where clotho keeps what it can make again: $XDG_CACHE_HOME/clotho/<kind> (~/.cache by default).
Environment venvs (clotho.env_venv) and models fetched from storage URLs (storage.models) live
there, each kind in its own directory; a first run with a new XDG_CACHE_HOME fills it again."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(kind: str) -> Path:
    """The directory of one kind of cached thing (not created here)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "clotho" / kind
