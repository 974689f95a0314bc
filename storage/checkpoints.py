"""The checkpoint layout contract (trainer -> inference): publish, find and fetch HF checkpoints.

    {root}/{run}/checkpoints/step-{N:08d}/   Hugging Face files (safetensors, config, tokenizer), or
                                             the same with model.safetensors.delta in place of the
                                             weights: a delta against the previous publish
    {root}/{run}/checkpoints/step-{N:08d}/STABLE   JSON manifest, written after every file
    {root}/{run}/checkpoints/LATEST                 'step-{N:08d}', updated after STABLE
    {root}/{run}/checkpoints/BEST                   JSON {step, reward}: the best evaluated step

A reader trusts a step directory only once its STABLE exists, and STABLE lists every file with its
size, so a half-uploaded checkpoint is never loaded; STABLE itself appears whole (one PUT, or a
hard link of a finished file on local disks, where a full disk could otherwise leave it empty). Every
request is retried while an object store fails transiently (storage.filesystem.retrying): uploads
overwrite, so a publish that failed clearly can simply run again. The policy version of step N is N.

A delta step (storage.weight_delta) names in its STABLE `delta: {"chain": [K, ..., N-1]}` the full
step K it builds on and every delta between; fetch_checkpoint rebuilds its weights from them (from
the newest of them already rebuilt in the cache), and retention keeps a chain as long as any step
that needs it.

Retention (`apply_retention`, run by the trainer after each publish) keeps the last K published
steps, every N-th one, the one LATEST names, the one BEST names (`mark_best`, by the run's
evaluator: the step whose held-out reward was the highest) and every step a server pins (serves, or
is loading: `{run}/progress/pins/{server}.json`, written by the reload watcher). It deletes STABLE
first, so a reader never trusts a half-deleted step, then looks at the pins and BEST once more (a
watcher pins, the evaluator marks, then each checks STABLE: one of the two sees the other) and puts
STABLE back if the step was pinned or marked meanwhile; the next pass finishes steps a killed
deletion left without STABLE.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from storage.filesystem import download_whole, is_local, publish, put_file, resolve, retrying, storage_errors
from storage.layout import join, run_url
from storage.progress import PROGRESS, read_json, replace_json
from storage.weight_delta import DELTA_FILE, WEIGHTS_FILE, DeltaError, apply

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
STABLE = "STABLE"
LATEST = "LATEST"
BEST = "BEST"
CHECKPOINT_LAYOUT_VERSION = 2  # 2: delta steps
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

    @property
    def run_url(self) -> str:
        """The run the checkpoint belongs to: {run_url}/checkpoints/step-N."""
        parent, _, _ = self.url.rstrip("/").rpartition("/")
        run, _, directory = parent.rpartition("/")
        if directory != CHECKPOINTS:
            raise CheckpointError(f"{self.url} is not in a run's {CHECKPOINTS}/ directory: it names no run")
        return run

    @property
    def chain(self) -> list[int]:
        """The steps this one's weights are built from, oldest (a full checkpoint) first; [] for a
        full checkpoint."""
        return [int(step) for step in (self.manifest.get("delta") or {}).get("chain", [])]


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
        if _exists(fs, join(path, STABLE)):
            raise FileExistsError(f"{url} is already published (STABLE exists); steps are never overwritten")
        fs.makedirs(path, exist_ok=True)
        for file in files:
            target = join(path, file.relative_to(local).as_posix())
            put_file(fs, file, target)
        manifest = {
            "layout_version": CHECKPOINT_LAYOUT_VERSION,
            "step": step,
            "policy_version": step,
            "published_at": time.time(),
            "files": {file.relative_to(local).as_posix(): file.stat().st_size for file in files},
            **(extra or {}),
        }
        publish(fs, join(path, STABLE), json.dumps(manifest, indent=1).encode(), temp_dir=path)
        latest = join(resolve(checkpoints_url(root, run), storage_options)[1], LATEST)
        retrying(fs, latest, fs.pipe_file, latest, step_name(step).encode())
    return CheckpointInfo(url=url, step=step, manifest=manifest)


def read_checkpoint(url: str, *, storage_options: dict[str, Any] | None = None) -> CheckpointInfo:
    """The checkpoint at a step URL, after checking STABLE and that every listed file is there."""
    match = _STEP.search(url.rstrip("/").rsplit("/", 1)[-1])
    if not match:
        raise CheckpointError(f"{url} is not a checkpoint directory (expected .../checkpoints/step-NNNNNNNN)")
    fs, path = resolve(url, storage_options)
    with storage_errors(url):
        try:
            manifest = json.loads(retrying(fs, join(path, STABLE), fs.cat_file, join(path, STABLE)))
        except FileNotFoundError:
            raise CheckpointError(f"{url} has no STABLE marker: it is not (yet) published") from None
        prefix = path.rstrip("/") + "/"
        found = retrying(fs, path, fs.find, path, detail=True)
        sizes = {name[len(prefix) :]: entry["size"] for name, entry in found.items()}
    for name, size in manifest["files"].items():
        if sizes.get(name) != size:
            raise CheckpointError(f"{url}: {name} is missing or has {sizes.get(name)} bytes, STABLE says {size}")
    return CheckpointInfo(url=url, step=int(match.group(1)), manifest=manifest)


def latest_checkpoint(root: str, run: str, *, storage_options: dict[str, Any] | None = None) -> CheckpointInfo | None:
    """The newest STABLE step; None if none yet. Reads LATEST and looks one step past it (a trainer
    killed between STABLE and LATEST leaves it one behind), so a poll costs the same at step 10 and
    10**6; lists the steps only when LATEST is missing or names a step without STABLE."""
    base = checkpoints_url(root, run)
    fs, path = resolve(base, storage_options)
    with storage_errors(base):
        pointer = _latest_pointer(fs, path)
        if (match := _STEP.fullmatch(pointer)) and _exists(fs, join(path, pointer, STABLE)):
            step = int(match.group(1))
            while _exists(fs, join(path, step_name(step + 1), STABLE)):
                step += 1
        else:
            steps = published_steps(root, run, storage_options=storage_options)
            if not steps:
                return None
            step = steps[-1]
    return read_checkpoint(checkpoint_url(root, run, step), storage_options=storage_options)


def _latest_pointer(fs: Any, checkpoints_path: str) -> str:
    """What LATEST names ('step-N'), or "" before the first publish."""
    latest = join(checkpoints_path, LATEST)
    try:
        return retrying(fs, latest, fs.cat_file, latest).decode().strip()
    except FileNotFoundError:
        return ""


def _exists(fs: Any, path: str) -> bool:
    return retrying(fs, path, fs.exists, path)


def published_steps(root: str, run: str, *, storage_options: dict[str, Any] | None = None) -> list[int]:
    """Every STABLE step of the run, oldest first (lists the checkpoints directory)."""
    return sorted(step for step, stable in step_directories(root, run, storage_options=storage_options) if stable)


def step_directories(root: str, run: str, *, storage_options: dict[str, Any] | None = None) -> list[tuple[int, bool]]:
    """(step, has STABLE) for every step directory: a step without STABLE is half a checkpoint (being
    published, or left by a publisher that died), which readers never see."""
    base = checkpoints_url(root, run)
    fs, path = resolve(base, storage_options)
    with storage_errors(base):
        if not _exists(fs, path):
            return []
        return [
            (int(m.group(1)), _exists(fs, join(entry, STABLE)))
            for entry in retrying(fs, path, fs.ls, path, detail=False)
            if (m := _STEP.fullmatch(entry.rstrip("/").rsplit("/", 1)[-1]))
        ]


def best_url(root: str, run: str) -> str:
    return join(checkpoints_url(root, run), BEST)


def read_best(root: str, run: str, *, storage_options: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """What BEST says ({"step", "reward", "marked_at"}), or None before a step was marked."""
    return read_json(best_url(root, run), storage_options)


def mark_best(root: str, run: str, step: int, reward: float, *, storage_options: dict[str, Any] | None = None) -> bool:
    """Name published `step` the run's best (its held-out `reward`) in BEST, which retention then
    keeps. Written after the step's STABLE and checked against it after: where retention deleted the
    step before it saw BEST, BEST goes back to what it named before and this returns False."""
    previous = read_best(root, run, storage_options=storage_options)
    marker = best_url(root, run)
    replace_json(marker, {"step": step, "reward": reward, "marked_at": time.time()}, storage_options)
    url = checkpoint_url(root, run, step)
    fs, path = resolve(url, storage_options)
    with storage_errors(url):
        if _exists(fs, join(path, STABLE)):
            return True
        if previous is not None:
            replace_json(marker, previous, storage_options)
        else:
            marker_path = resolve(marker, storage_options)[1]
            retrying(fs, marker_path, fs.rm, marker_path)
    log.warning(
        "step %d of %s was removed before it could be marked best; BEST still names %s",
        step,
        run,
        previous and previous["step"],
    )
    return False


def best_checkpoint(root: str, run: str, *, storage_options: dict[str, Any] | None = None) -> CheckpointInfo | None:
    """The step BEST names (read and checked as read_checkpoint does); None before one was marked."""
    best = read_best(root, run, storage_options=storage_options)
    return (
        None
        if best is None
        else read_checkpoint(checkpoint_url(root, run, int(best["step"])), storage_options=storage_options)
    )


PINS = f"{PROGRESS}/pins"
PIN_TTL_S = 3600.0  # a pin its server has not renewed for this long is a dead server's


def pin_steps(
    root: str, run: str, server: str, steps: set[int], *, storage_options: dict[str, Any] | None = None
) -> None:
    """Tell retention that `server` serves or is loading `steps` (replaces its previous pin)."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", server)
    replace_json(
        join(run_url(root, run), PINS, f"{name}.json"),
        {"server": server, "steps": sorted(steps), "updated_at": time.time()},
        storage_options,
    )


def pinned_steps(root: str, run: str, *, storage_options: dict[str, Any] | None = None) -> set[int]:
    """Steps some live server pins (pins older than PIN_TTL_S are ignored)."""
    url = join(run_url(root, run), PINS)
    fs, path = resolve(url, storage_options)
    steps: set[int] = set()
    with storage_errors(url):
        try:
            names = retrying(fs, path, fs.ls, path, detail=False)
        except FileNotFoundError:
            return steps
        for name in names:
            try:
                pin = json.loads(retrying(fs, name, fs.cat_file, name))
            except (FileNotFoundError, ValueError):
                continue
            if time.time() - float(pin.get("updated_at", 0)) < PIN_TTL_S:
                steps.update(int(step) for step in pin.get("steps", []))
    return steps


def retained(steps: list[int], keep_last: int, keep_every: int | None) -> set[int]:
    """The steps retention keeps of `steps` (published, oldest first): the last `keep_last` and
    every `keep_every`-th."""
    keep = set(steps[-keep_last:]) if keep_last > 0 else set()
    if keep_every:
        keep.update(step for step in steps if step % keep_every == 0)
    return keep


def apply_retention(
    root: str,
    run: str,
    *,
    keep_last: int,
    keep_every: int | None = None,
    storage_options: dict[str, Any] | None = None,
) -> list[int]:
    """Delete the published steps retention does not keep (see the module's doc); returns them.
    A trainer resumed from an older state trains deleted steps again without publishing them
    (trainer.publishing.publish_step: LATEST never goes back), so none is kept for it."""
    if keep_last < 1:
        raise ValueError(f"keep_last is {keep_last}; keep at least the newest step (1)")
    base = checkpoints_url(root, run)
    fs, path = resolve(base, storage_options)
    dirs = step_directories(root, run, storage_options=storage_options)
    published = sorted(step for step, stable in dirs if stable)
    if not published:
        return []
    with storage_errors(base):
        pointer = _latest_pointer(fs, path)
    keep = retained(published, keep_last, keep_every) | {published[-1]}
    if match := _STEP.fullmatch(pointer):
        keep.add(int(match.group(1)))
    keep |= _chains(fs, path, keep)

    def protected() -> set[int]:  # what servers pin and what the evaluator marked best, with their chains
        best = read_best(root, run, storage_options=storage_options)
        steps = pinned_steps(root, run, storage_options=storage_options) | ({int(best["step"])} if best else set())
        return steps | _chains(fs, path, steps)

    held = protected()
    deleted = []
    for step in published:
        if step in keep or step in held:
            continue
        step_path = join(path, step_name(step))
        with storage_errors(join(base, step_name(step))):
            manifest = fs.cat_file(join(step_path, STABLE))
            fs.rm(join(step_path, STABLE))  # first: from here on no reader trusts the step
            if step in protected():
                fs.pipe_file(join(step_path, STABLE), manifest)  # pinned or marked best meanwhile
                continue
            fs.rm(step_path, recursive=True)
        deleted.append(step)
    # Steps a killed deletion left without STABLE (never ones past the newest: those may be uploading).
    for step, stable in dirs:
        if not stable and step < published[-1]:
            with contextlib.suppress(FileNotFoundError), storage_errors(join(base, step_name(step))):
                fs.rm(join(path, step_name(step)), recursive=True)
    if deleted:
        log.info("retention deleted checkpoint steps %s of %s", _ranges(deleted), base)
    return deleted


def _chains(fs: Any, checkpoints_path: str, steps: set[int]) -> set[int]:
    """The steps the delta steps among `steps` are built from (their STABLE manifests say)."""
    needed: set[int] = set()
    for step in steps:
        stable = join(checkpoints_path, step_name(step), STABLE)
        try:
            manifest = json.loads(retrying(fs, stable, fs.cat_file, stable))
        except (FileNotFoundError, ValueError):
            continue  # not published (any more): nothing of it is read
        needed.update(int(s) for s in (manifest.get("delta") or {}).get("chain", []))
    return needed


def _ranges(steps: list[int]) -> str:
    return ", ".join(str(s) for s in steps) if len(steps) <= 6 else f"{steps[0]}..{steps[-1]} ({len(steps)} steps)"


def fetch_checkpoint(
    info: CheckpointInfo, cache_dir: str | Path, *, storage_options: dict[str, Any] | None = None
) -> Path:
    """A local directory holding the checkpoint, loadable as it is by vLLM and transformers: the path
    itself for a full checkpoint on local disk, else a copy in `cache_dir`, a delta step's weights
    rebuilt there from its chain (raises CheckpointError when a step of the chain is gone or the
    rebuilt weights fail their checksums: nothing is left in the cache then)."""
    fs, path = resolve(info.url, storage_options)
    target = Path(cache_dir) / step_name(info.step)
    if not info.chain and is_local(fs):
        return Path(path)
    if _cached(target, info):
        return target
    if target.exists():  # another run's step N, or an older publish of this one: not these weights
        shutil.rmtree(target, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    build = None
    if info.chain:
        names = [name for name in info.manifest["files"] if name != DELTA_FILE]
        build = functools.partial(_rebuild, info, Path(cache_dir), storage_options)
    else:
        names = list(info.manifest["files"])
    download_whole(
        info.url, fs, path, names, target, written_last={STABLE: json.dumps(info.manifest).encode()}, build=build
    )
    return target


def _cached(target: Path, info: CheckpointInfo) -> bool:
    """Whether `target` holds the copy of `info`: its STABLE is the published one (a cache shared by
    runs, or a step published again after a deletion, must not give other weights)."""
    try:
        return json.loads((target / STABLE).read_text()) == info.manifest
    except (FileNotFoundError, ValueError):
        return False


# A weights file of a copy no one serves any more (drop_cached_copy), kept in a fetch_checkpoint cache
# for the next delta step's rebuild to write over (storage.weight_delta.apply's `reuse`).
SPARE_WEIGHTS = ".spare.safetensors"


def drop_cached_copy(directory: Path) -> None:
    """Deletes a copy in a fetch_checkpoint cache, keeping its weights file as the cache's spare."""
    weights = directory / WEIGHTS_FILE
    if weights.is_file() and not weights.is_symlink():
        os.replace(weights, directory.parent / SPARE_WEIGHTS)
    shutil.rmtree(directory, ignore_errors=True)


def _rebuild(info: CheckpointInfo, cache_dir: Path, storage_options: dict[str, Any] | None, directory: Path) -> None:
    """The weights of delta step `info` into `directory`: from the newest step of its chain already
    in `cache_dir` (else its full step, fetched), with the deltas after it applied."""
    started = time.perf_counter()
    siblings = info.url.rstrip("/").rsplit("/", 1)[0]
    chain = info.chain
    try:
        # From the newest step of the chain whose copy is in the cache (the steps before it are not read).
        steps: list[CheckpointInfo] = []
        for step in reversed(chain):
            steps.insert(0, read_checkpoint(join(siblings, step_name(step)), storage_options=storage_options))
            if _cached(cache_dir / step_name(step), steps[0]):
                break
    except CheckpointError as error:
        raise CheckpointError(f"{info.url} is a delta on steps {chain}, and one of them is gone: {error}") from None
    base, deltas = steps[0], steps[1:]
    base_dir = fetch_checkpoint(base, cache_dir, storage_options=storage_options)
    bodies = []
    for step_info in [*deltas, info]:
        fs, path = resolve(step_info.url, storage_options)
        with storage_errors(step_info.url):
            bodies.append((step_info.step, retrying(fs, join(path, DELTA_FILE), fs.cat_file, join(path, DELTA_FILE))))
    read = time.perf_counter()
    spare = (cache_dir / SPARE_WEIGHTS).exists()
    try:
        apply(base_dir / WEIGHTS_FILE, bodies, directory / WEIGHTS_FILE, reuse=cache_dir / SPARE_WEIGHTS)
    except DeltaError as error:
        raise CheckpointError(f"{info.url}: {error}") from None
    log.info(
        "step %d rebuilt from step %d and %d delta(s) in %.2f s (reading them %.2f s, applying %.2f s%s)",
        info.step,
        base.step,
        len(bodies),
        time.perf_counter() - started,
        read - started,
        time.perf_counter() - read,
        ", over the spare weights file" if spare else ", into a new file",
    )
