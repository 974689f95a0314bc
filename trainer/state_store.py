"""The resume state in the run's storage: a trainer whose ranks share no disk, or that lost a host
with its disk, resumes from it on any hosts.

    {root}/{run}/trainer-state/step-{N:08d}/...   DeepSpeed's files of the state, each uploaded by
                                                  the rank that wrote it
    {root}/{run}/trainer-state/step-{N:08d}/COMPLETE   their list and sizes, by rank 0 once every
                                                  rank uploaded (a state without it never counts)
    {root}/{run}/trainer-state/LATEST             the newest complete state's tag, written after it

The local state dir stays where DeepSpeed saves and loads; this copies it out after each save, on
a thread beside the steps that follow (StateUpload: the trainer commits it once every rank's copy
is up), and, on resume, into each host's state dir when that host lacks it. The state in storage is the one a
trainer resumes from: a newer local one (saved, not yet complete in storage when the trainer died)
is trained again, to the checkpoints already published (trainer.publishing.replay_difference).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from storage.filesystem import download_whole, is_local, resolve, retrying, storage_errors
from storage.layout import join, run_url

log = logging.getLogger(__name__)

STATE = "trainer-state"
COMPLETE = "COMPLETE"
LATEST = "LATEST"
_RANK_FILE = re.compile(r"zero_pp_rank_(\d+)_")


def writer_rank(name: str) -> int:
    """The rank that writes DeepSpeed checkpoint file `name`: a ZeRO partition (zero_pp_rank_R_...)
    its rank R's, the rest (model states below ZeRO-3, the client state) rank 0's."""
    match = _RANK_FILE.search(name)
    return int(match.group(1)) if match else 0


def point_latest(state_dir: Path, tag: str) -> None:
    """Point `state_dir/latest` (DeepSpeed's name) at `tag` in one rename: a reader, or a trainer
    killed while writing it, sees the old tag or the new one, never an empty file."""
    temporary = state_dir / f".latest-{os.getpid()}"
    temporary.write_text(tag)
    os.replace(temporary, state_dir / "latest")


@dataclass(frozen=True)
class StateStore:
    """The run's resume states in storage (see the module's docstring)."""

    storage: str
    run: str
    storage_options: dict[str, Any] | None = None

    @property
    def url(self) -> str:
        return join(run_url(self.storage, self.run), STATE)

    @classmethod
    def for_run(
        cls, storage: str, run: str, enabled: bool | None, storage_options: dict[str, Any] | None = None
    ) -> StateStore | None:
        """The store when `enabled`, or (None) when the run's storage is not a local disk: a local
        run's work dir is already in its storage."""
        if enabled is None:
            enabled = not is_local(resolve(run_url(storage, run), storage_options)[0])
        return cls(storage, run, storage_options) if enabled else None

    def upload(self, tag_dir: Path, rank: int) -> dict[str, int]:
        """This rank's files of the state in `tag_dir` to storage; their names and sizes."""
        fs, root = resolve(self.url, self.storage_options)
        uploaded = {}
        with storage_errors(self.url):
            for path in sorted(p for p in tag_dir.rglob("*") if p.is_file()):
                name = path.relative_to(tag_dir).as_posix()
                if writer_rank(name) != rank:
                    continue
                target = join(root, tag_dir.name, name)
                fs.makedirs(
                    target.rsplit("/", 1)[0], exist_ok=True
                )  # a local disk's directories (no-op on object stores)
                retrying(fs, target, fs.put_file, str(path), target)
                uploaded[name] = path.stat().st_size
        return uploaded

    def commit(self, tag: str, files: dict[str, int], keep: int) -> None:
        """Rank 0, once every rank uploaded: COMPLETE, then LATEST; then only the newest `keep`
        complete states stay."""
        fs, root = resolve(self.url, self.storage_options)
        with storage_errors(self.url):
            complete = join(root, tag, COMPLETE)
            retrying(
                fs,
                complete,
                fs.pipe_file,
                complete,
                json.dumps({"tag": tag, "files": files, "saved_at": time.time()}).encode(),
            )
            latest = join(root, LATEST)
            retrying(fs, latest, fs.pipe_file, latest, tag.encode())
            names = (entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(root, detail=False))
            for old in sorted(name for name in names if name.startswith("step-") and name <= tag)[:-keep]:
                retrying(fs, join(root, old), fs.rm, join(root, old), recursive=True)

    def latest(self) -> tuple[str, dict[str, int]] | None:
        """The newest complete state: its tag and files; None when the run has none in storage."""
        fs, root = resolve(self.url, self.storage_options)
        with storage_errors(self.url):
            try:
                tag = retrying(fs, join(root, LATEST), fs.cat_file, join(root, LATEST)).decode().strip()
                manifest = json.loads(retrying(fs, join(root, tag, COMPLETE), fs.cat_file, join(root, tag, COMPLETE)))
            except FileNotFoundError:
                return None
        return tag, manifest["files"]

    def fetch(self, tag: str, files: dict[str, int], state_dir: Path) -> bool:
        """State `tag` into `state_dir/tag` unless it is there whole; points DeepSpeed's `latest`
        at it. Returns whether it downloaded. Safe beside another host doing the same into a
        shared dir: each downloads aside and renames, and keeps the first copy."""
        target = state_dir / tag
        if all((target / name).is_file() and (target / name).stat().st_size == size for name, size in files.items()):
            point_latest(state_dir, tag)
            return False
        fs, root = resolve(self.url, self.storage_options)
        started = time.monotonic()
        shutil.rmtree(target, ignore_errors=True)  # a partial copy (a save cut short)
        download_whole(self.url, fs, join(root, tag), files, target)
        point_latest(state_dir, tag)
        log.info(
            "resume state %s fetched from %s (%d files, %.1f s)", tag, self.url, len(files), time.monotonic() - started
        )
        return True


class StateUpload:
    """One rank's files of a saved resume state on their way to the store, on a thread: the steps
    go on meanwhile (an upload of 16 bytes a parameter is minutes at a real size). The state counts
    only once every rank's upload is done and rank 0 committed it (StateStore.commit); a trainer
    killed before that resumes from the previous one and trains the steps since again."""

    def __init__(self, store: StateStore, tag_dir: Path, rank: int, step: int):
        self.store, self.tag_dir, self.rank, self.step = store, tag_dir, rank, step
        self.files: dict[str, int] | None = None
        self.error: BaseException | None = None
        self.seconds = 0.0
        self._thread = threading.Thread(target=self._run, name=f"state-upload-{tag_dir.name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        started = time.monotonic()
        try:
            self.files = self.store.upload(self.tag_dir, self.rank)
        except BaseException as error:  # noqa: BLE001 - raised where the trainer waits for it (result)
            self.error = error
        self.seconds = time.monotonic() - started

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self) -> dict[str, int]:
        """Waits for the upload; this rank's files and sizes, or the upload's error raised."""
        self._thread.join()
        if self.error is not None:
            raise self.error
        assert self.files is not None
        return self.files
