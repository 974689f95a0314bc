"""What a run keeps in its storage, in bytes: its checkpoints (retention's bound is checked
against it) and its shards."""

from __future__ import annotations

from typing import Any

from storage.checkpoints import _STEP, checkpoints_url
from storage.filesystem import resolve, storage_errors
from storage.layout import rollouts_url


def _sizes(url: str, storage_options: dict[str, Any] | None) -> dict[str, int]:
    """Every file under url with its size, by its path relative to url ({} when there is none)."""
    fs, path = resolve(url, storage_options)
    with storage_errors(url):
        if not fs.exists(path):
            return {}
        found = fs.find(path, detail=True)
    prefix = path.rstrip("/") + "/"
    return {name.removeprefix(prefix): int(info.get("size") or 0) for name, info in found.items()}


def run_footprint(root: str, run: str, *, storage_options: dict[str, Any] | None = None) -> dict[str, float]:
    """checkpoints: step directories kept; checkpoint_bytes: their bytes in all; largest_checkpoint_bytes:
    the largest one's (a full checkpoint, when one is kept); shard_bytes: the rollout shards'."""
    steps: dict[str, int] = {}
    for name, size in _sizes(checkpoints_url(root, run), storage_options).items():
        top = name.split("/", 1)[0]
        if _STEP.fullmatch(top):
            steps[top] = steps.get(top, 0) + size
    shards = _sizes(rollouts_url(root, run), storage_options)
    return {
        "checkpoints": float(len(steps)),
        "checkpoint_bytes": float(sum(steps.values())),
        "largest_checkpoint_bytes": float(max(steps.values(), default=0)),
        "shard_bytes": float(sum(size for name, size in shards.items() if name.endswith(".parquet"))),
    }
