"""Prefect artifact keys for a run: the UI groups an artifact's versions by key, and keys take
lowercase letters, digits and dashes only."""

from __future__ import annotations

import re


def artifact_key(kind: str, run: str) -> str:
    """'{kind}-{run}' with every other character run replaced by a dash: artifact_key('train', 'My_Run')
    is 'train-my-run'."""
    return f"{kind}-" + re.sub(r"[^a-z0-9-]+", "-", run.lower())
