"""The shard index: how a reader finds new shards without listing the run's history.

    {root}/{run}/_index/{YYYYMMDDTHH}/{MM}/{shard_id}~{env}~{policy_version}   one empty file per shard

Shard ids begin with the UTC time their writer made them, so the index is bucketed by hour and
minute of that time. A reader that has consumed everything before id W lists the hour directories
(one per hour of the run), then only the hours and minutes from W's on: the listings per poll
depend on how far behind the reader is, not on how long the run is, on local disks (directory
scans) and object stores (LIST requests) alike.

Writers create a shard's entry before the shard itself, so a shard a reader can see through the
index is never missed; an entry whose shard never appears (its writer died in between) is dropped
by the reader after the grace period. Shards copied into a run without their entries (a run's
rollouts/ copied elsewhere) are indexed once by `backfill`, which every ShardReader runs when the
run has no `_index/complete` marker (`index_shards` / `clotho shards index RUN_URL` for shards
copied in later).

Late arrivals: a reader's watermark trails its clock by `GRACE_S`, so a shard published up to
GRACE_S after its id was stamped (a slow upload, a writer clock ahead of the reader's) is still
listed and consumed exactly once; writers check their clock against the store's when they start and
refuse to write with a skew above GRACE_S / 4, and warn about a publish slower than GRACE_S / 2.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from dataclasses import dataclass
from datetime import UTC, datetime

import fsspec

from storage.filesystem import is_local, retrying
from storage.layout import ShardLocation, join, new_shard_id, parse_shard_name

log = logging.getLogger(__name__)

INDEX = "_index"
COMPLETE = "complete"  # written once every shard the run held when first read is indexed
GRACE_S = 120.0
_HOUR = re.compile(r"\d{8}T\d{2}")
_MINUTE = re.compile(r"\d{2}")
_SEPARATOR = "~"  # in no env name, shard id or number


@dataclass(frozen=True, order=True)
class IndexEntry:
    shard_id: str
    env: str
    policy_version: int

    @property
    def location(self) -> ShardLocation:
        return ShardLocation(self.env, self.policy_version, self.shard_id)

    @property
    def file_name(self) -> str:
        return _SEPARATOR.join([self.shard_id, self.env, str(self.policy_version)])

    @classmethod
    def of(cls, location: ShardLocation) -> IndexEntry:
        return cls(location.shard_id, location.env, location.policy_version)

    @classmethod
    def parse(cls, file_name: str) -> IndexEntry | None:
        parts = file_name.split(_SEPARATOR)
        if len(parts) != 3 or not parts[2].isdigit():
            return None
        location = parse_shard_name(f"env={parts[1]}/policy_version={parts[2]}/{parts[0]}.parquet")
        return None if location is None else cls.of(location)


def index_path(run_path: str) -> str:
    return join(run_path, INDEX)


def entry_path(run_path: str, location: ShardLocation) -> str:
    shard_id = location.shard_id
    return join(index_path(run_path), shard_id[:11], shard_id[11:13], IndexEntry.of(location).file_name)


def id_at(seconds: float) -> str:
    """The prefix of shard ids made at `seconds` (UTC): every id made later sorts after it."""
    whole = int(seconds)
    stamp = datetime.fromtimestamp(whole, tz=UTC).strftime("%Y%m%dT%H%M%S")
    return f"{stamp}.{int((seconds - whole) * 1e9):09d}Z"


def id_seconds(shard_id: str) -> float:
    """When a shard id was made (its writer's clock), in seconds since the epoch."""
    stamp, _, nanoseconds = shard_id.partition(".")
    seconds = datetime.strptime(stamp, "%Y%m%dT%H%M%S").replace(tzinfo=UTC).timestamp()
    return seconds + int(nanoseconds[:9]) / 1e9


def add_entry(fs: fsspec.AbstractFileSystem, run_path: str, location: ShardLocation) -> None:
    """Create the shard's entry (before the shard: see the module's doc); an existing one is kept."""
    path = entry_path(run_path, location)
    try:
        if is_local(fs):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "xb"):
                pass
        else:
            retrying(fs, path, fs.pipe_file, path, b"", mode="create")
    except FileExistsError:  # also a retry whose first try landed unanswered: empty either way
        pass


def remove_entries(fs: fsspec.AbstractFileSystem, run_path: str, locations: list[ShardLocation]) -> None:
    paths = [entry_path(run_path, location) for location in locations]
    with contextlib.suppress(FileNotFoundError):
        fs.rm(paths)


def drop_unpublished(
    fs: fsspec.AbstractFileSystem, run_path: str, rollouts_url: str, storage_options: dict | None = None
) -> list[IndexEntry]:
    """Removes the entries whose shard was never written, and returns them: for a run whose one
    writer is known to have stopped (a reprocess job run again after a kill), so its readers do
    not wait out the grace period at the dead writer's last entry. Never while a writer may be
    between an entry and its shard: that shard would then be missed. Lists the run's shards once
    (as backfill, its converse)."""
    from storage.shard_file import find_shards  # shard_file imports this module

    _, shards = find_shards(rollouts_url, storage_options=storage_options)
    published = {shard.location.shard_id for shard in shards}
    unpublished = [entry for entry in list_entries(fs, run_path) if entry.shard_id not in published]
    remove_entries(fs, run_path, [entry.location for entry in unpublished])
    return unpublished


def list_entries(fs: fsspec.AbstractFileSystem, run_path: str, after: str = "") -> list[IndexEntry]:
    """The entries with shard ids >= `after` (all for ""), oldest id first. Lists the hour
    directories, then only the buckets from `after`'s hour and minute on."""
    root = index_path(run_path)
    hours = [hour for hour in _children(fs, root, _HOUR) if hour >= after[:11]]
    entries = []
    for hour in hours:
        hour_path = join(root, hour)
        minutes = _children(fs, hour_path, _MINUTE)
        if hour == after[:11]:
            minutes = [minute for minute in minutes if minute >= after[11:13]]
        for minute in minutes:
            for name in _children(fs, join(hour_path, minute)):
                entry = IndexEntry.parse(name)
                if entry is not None and entry.shard_id >= after:
                    entries.append(entry)
    entries.sort()
    return entries


def _children(fs: fsspec.AbstractFileSystem, path: str, pattern: re.Pattern | None = None) -> list[str]:
    """Names (not paths) directly below `path`, sorted; [] when it does not exist."""
    if is_local(fs):
        try:
            names = os.listdir(path)
        except FileNotFoundError:
            return []
    else:
        try:
            names = [entry.rstrip("/").rsplit("/", 1)[-1] for entry in retrying(fs, path, fs.ls, path, detail=False)]
        except FileNotFoundError:
            return []
    return sorted(name for name in names if pattern is None or pattern.fullmatch(name))


def is_complete(fs: fsspec.AbstractFileSystem, run_path: str) -> bool:
    marker = join(index_path(run_path), COMPLETE)
    return retrying(fs, marker, fs.exists, marker)


def backfill(
    fs: fsspec.AbstractFileSystem, run_path: str, rollouts_url: str, storage_options: dict | None = None
) -> bool:
    """Index every shard under `rollouts_url` that has no entry (shards copied in without their
    entries), then mark the index complete; False (nothing marked) while the run
    holds no shard at all. Lists the whole run once; safe to run while writers write and twice at
    once (entries are only ever created)."""
    from storage.shard_file import find_shards  # shard_file imports this module

    _, shards = find_shards(rollouts_url, storage_options=storage_options)
    indexed = {entry.shard_id for entry in list_entries(fs, run_path)}
    if not shards and not indexed:
        return False
    missing = [shard for shard in shards if shard.location.shard_id not in indexed]
    for shard in missing:
        add_entry(fs, run_path, shard.location)
    marker = join(index_path(run_path), COMPLETE)
    if is_local(fs):
        os.makedirs(os.path.dirname(marker), exist_ok=True)
    retrying(fs, marker, fs.pipe_file, marker, b"")
    if missing:
        log.info("indexed %d shards of %s written without an index entry", len(missing), rollouts_url)
    return True


def index_shards(run_url: str, *, storage_options: dict | None = None) -> bool:
    """Index the shards of the run at `run_url` that have no entry: for shards copied into a run by
    hand (readers find new shards through the index only); True when the run holds any shard."""
    from storage.filesystem import resolve
    from storage.layout import ROLLOUTS

    fs, run_path = resolve(run_url, storage_options)
    return backfill(fs, run_path, join(run_url, ROLLOUTS), storage_options)


def check_clock(fs: fsspec.AbstractFileSystem, temp_path: str, grace_s: float = GRACE_S) -> float:
    """This machine's clock minus the store's (seconds), from a probe file's modification time;
    raises RuntimeError above grace_s / 4, where readers could pass this writer's shards."""
    probe = join(temp_path, f"clock-{new_shard_id()}")
    if is_local(fs):
        os.makedirs(temp_path, exist_ok=True)
    before = time.time()
    retrying(fs, probe, fs.pipe_file, probe, b"")
    after = time.time()
    try:
        info = retrying(fs, probe, fs.info, probe)
    finally:
        with contextlib.suppress(FileNotFoundError):
            fs.rm(probe)
    stamp = info.get("mtime") or info.get("LastModified") or info.get("created")
    if stamp is None:
        return 0.0  # a store that does not say when a file was written: nothing to compare
    store = stamp.timestamp() if isinstance(stamp, datetime) else float(stamp)
    # S3 keeps whole seconds: the store's time is in [store, store + 1).
    skew = 0.0 if before - 1.0 <= store <= after + 1.0 else (before + after) / 2 - store
    if abs(skew) > grace_s / 4:
        raise RuntimeError(
            f"this machine's clock is {skew:+.0f} s off the storage's ({temp_path}); shard ids carry "
            f"the writer's time and readers allow {grace_s / 4:.0f} s: synchronize the clock (NTP)"
        )
    return skew
