"""The checkpoint layout contract (trainer -> inference): publish, find and fetch HF checkpoints.

    {root}/{run}/checkpoints/step-{N:08d}/   Hugging Face files (safetensors, config, tokenizer)
    {root}/{run}/checkpoints/step-{N:08d}/STABLE   JSON manifest, written after every file
    {root}/{run}/checkpoints/LATEST                 'step-{N:08d}', updated after STABLE

A reader trusts a step directory only once its STABLE exists, and STABLE lists every file with its
size, so a half-uploaded checkpoint is never loaded. The policy version of step N is N.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from storage.filesystem import resolve, storage_errors
from storage.layout import join, run_url

CHECKPOINTS = "checkpoints"
STABLE = "STABLE"
LATEST = "LATEST"
CHECKPOINT_LAYOUT_VERSION = 1
_STEP = re.compile(r"step-(\d{8})")


class CheckpointError(Exception):
    """A checkpoint is missing, incomplete or does not match its STABLE manifest."""


@dataclass(frozen=True)
class CheckpointInfo:
    """A published (STABLE) checkpoint."""

    url: str
    step: int
    manifest: dict[str, Any]

    @property
    def policy_version(self) -> int:
        return self.step


def checkpoints_url(root: str, run: str) -> str:
    return join(run_url(root, run), CHECKPOINTS)


def step_name(step: int) -> str:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"checkpoint step {step!r} must be an int >= 0")
    return f"step-{step:08d}"


def checkpoint_url(root: str, run: str, step: int) -> str:
    return join(checkpoints_url(root, run), step_name(step))


def publish_checkpoint(
    local_dir: str | Path,
    root: str,
    run: str,
    step: int,
    *,
    extra: dict[str, Any] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> CheckpointInfo:
    """Uploads a local HF checkpoint directory as step N, then STABLE, then LATEST, in that order.

    Never overwrites a STABLE checkpoint: publishing the same step twice is an error.
    """
    local = Path(local_dir)
    # A STABLE in the source (a copy of a published checkpoint) is not part of the weights: this
    # publish writes its own, last.
    files = sorted(p for p in local.rglob("*") if p.is_file() and p.name != STABLE)
    if not any(p.name == "config.json" for p in files):
        raise CheckpointError(f"{local} has no config.json; save the model with save_pretrained first")
    url = checkpoint_url(root, run, step)
    fs, path = resolve(url, storage_options)
    with storage_errors(url):
        if fs.exists(join(path, STABLE)):
            raise FileExistsError(f"{url} is already published (STABLE exists); steps are never overwritten")
        fs.makedirs(path, exist_ok=True)
        for file in files:
            fs.put_file(str(file), join(path, file.relative_to(local).as_posix()))
        manifest = {
            "layout_version": CHECKPOINT_LAYOUT_VERSION,
            "step": step,
            "policy_version": step,
            "published_at": time.time(),
            "files": {file.relative_to(local).as_posix(): file.stat().st_size for file in files},
            **(extra or {}),
        }
        fs.pipe_file(join(path, STABLE), json.dumps(manifest, indent=1).encode())
        fs.pipe_file(join(resolve(checkpoints_url(root, run), storage_options)[1], LATEST), step_name(step).encode())
    return CheckpointInfo(url=url, step=step, manifest=manifest)


def read_checkpoint(url: str, *, storage_options: dict[str, Any] | None = None) -> CheckpointInfo:
    """The checkpoint at a step URL, after checking STABLE and that every listed file is there."""
    match = _STEP.search(url.rstrip("/").rsplit("/", 1)[-1])
    if not match:
        raise CheckpointError(f"{url} is not a checkpoint directory (expected .../checkpoints/step-NNNNNNNN)")
    fs, path = resolve(url, storage_options)
    with storage_errors(url):
        try:
            manifest = json.loads(fs.cat_file(join(path, STABLE)))
        except FileNotFoundError:
            raise CheckpointError(f"{url} has no STABLE marker: it is not (yet) published") from None
        prefix = path.rstrip("/") + "/"
        sizes = {name[len(prefix):]: entry["size"] for name, entry in fs.find(path, detail=True).items()}
    for name, size in manifest["files"].items():
        if sizes.get(name) != size:
            raise CheckpointError(f"{url}: {name} is missing or has {sizes.get(name)} bytes, STABLE says {size}")
    return CheckpointInfo(url=url, step=int(match.group(1)), manifest=manifest)


def latest_checkpoint(root: str, run: str, *, storage_options: dict[str, Any] | None = None) -> CheckpointInfo | None:
    """The newest STABLE step (LATEST is a pointer for people and tools; a trainer killed between
    STABLE and LATEST leaves it one behind, so readers list the steps instead); None if none yet."""
    base = checkpoints_url(root, run)
    fs, path = resolve(base, storage_options)
    with storage_errors(base):
        if not fs.exists(path):
            return None
        steps = sorted(
            int(m.group(1))
            for entry in fs.ls(path, detail=False)
            if (m := _STEP.fullmatch(entry.rstrip("/").rsplit("/", 1)[-1])) and fs.exists(join(entry, STABLE))
        )
    if not steps:
        return None
    return read_checkpoint(checkpoint_url(root, run, steps[-1]), storage_options=storage_options)


def fetch_checkpoint(info: CheckpointInfo, cache_dir: str | Path, *, storage_options: dict[str, Any] | None = None) -> Path:
    """A local directory holding the checkpoint: the path itself on local disk, else a cached copy."""
    fs, path = resolve(info.url, storage_options)
    if type(fs).__name__ == "LocalFileSystem":
        return Path(path)
    target = Path(cache_dir) / step_name(info.step)
    if (target / STABLE).exists():
        return target
    partial = target.with_name(target.name + ".partial")
    with storage_errors(info.url):
        for name in info.manifest["files"]:
            (partial / name).parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(join(path, name), str(partial / name))
    (partial / STABLE).write_text(json.dumps(info.manifest))
    partial.rename(target)
    return target
