"""Compaction: merge a partition's small shards into larger ones without losing or duplicating a row."""

from __future__ import annotations

import json
import logging
import os
import posixpath
from dataclasses import dataclass
from typing import Any

import fsspec
import pyarrow as pa

from storage.filesystem import storage_errors
from storage.index import add_entry, remove_entries
from storage.layout import TEMPORARY, ShardLocation, join
from storage.schema import (
    METADATA_COMPACTED_FROM,
    METADATA_TOKENIZER,
    ShardFormatError,
    compacted_from,
    concat_shard_tables,
)
from storage.shard_file import ShardInfo, find_shards, read_footers, read_shard, write_shard

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Compaction:
    """One merged shard and the shards it replaced."""

    url: str
    sources: list[str]
    rows: int


def compact(
    url: str, *, target_bytes: int = 128 * 2**20, storage_options: dict[str, Any] | None = None
) -> list[Compaction]:
    """Merge runs of small shards in every partition under `url` into shards of about `target_bytes`.

    Each merged shard is written (recording its sources in the file metadata), read back and checked,
    and only then are its sources deleted. A run interrupted between the two steps is finished by the
    next call, which deletes sources that a merged shard already holds. Do not compact partitions a
    live trainer is still consuming: its ledger knows the old names.
    """
    if target_bytes <= 0:
        raise ValueError(f"target_bytes is {target_bytes}; it must be > 0")
    fs, shards = find_shards(url, storage_options=storage_options)
    shards = _finish_interrupted(fs, shards)
    partitions: dict[str, list[ShardInfo]] = {}
    for shard in shards:
        partitions.setdefault(posixpath.dirname(shard.path), []).append(shard)
    done = []
    for partition in partitions.values():
        for group in _bins(partition, target_bytes):
            merged = _merge(fs, group)
            if merged is not None:
                done.append(merged)
    return done


def _bins(shards: list[ShardInfo], target_bytes: int) -> list[list[ShardInfo]]:
    """Consecutive small shards (oldest first) packed up to target_bytes; only bins worth merging."""
    bins: list[list[ShardInfo]] = [[]]
    total = 0
    for shard in shards:
        size = shard.listed_size
        if size >= target_bytes or total + size > target_bytes:
            bins.append([])
            total = 0
        if size < target_bytes:
            bins[-1].append(shard)
            total += size
    return [b for b in bins if len(b) >= 2]


def _merge(fs: fsspec.AbstractFileSystem, shards: list[ShardInfo]) -> Compaction | None:
    readable: list[tuple[ShardInfo, pa.Table]] = []
    for shard in shards:
        try:
            readable.append((shard, read_shard(fs, shard)))
        except ShardFormatError as error:  # left in place for a reader to quarantine, and said so
            log.error("not compacting corrupt shard %s: %s", shard.url, error)
    if len({table.schema.metadata[METADATA_TOKENIZER] for _, table in readable}) > 1:
        log.error(
            "not compacting %s: its shards come from different tokenizers",
            posixpath.dirname(shards[0].url),
        )
        return None
    if len(readable) < 2:
        return None
    sources = [shard for shard, _ in readable]
    merged = concat_shard_tables([table for _, table in readable])
    metadata = {**merged.schema.metadata, METADATA_COMPACTED_FROM: json.dumps([s.name for s in sources]).encode()}
    merged = merged.replace_schema_metadata(metadata)
    first = sources[0]
    # Keep the first source's time so the merged shard sorts where its rows were.
    shard_id = f"{first.location.shard_id.split('-')[0]}-{os.urandom(6).hex()}"
    location = ShardLocation(first.env, first.policy_version, shard_id)
    file_name = posixpath.basename(location.name)
    path = join(posixpath.dirname(first.path), file_name)
    url = join(posixpath.dirname(first.url), file_name)
    run_path = first.path.rsplit("/", 4)[0]
    with storage_errors(url):
        add_entry(fs, run_path, location)  # before the shard, as every writer does (storage.index)
        write_shard(fs, path, merged, _temp_dir(first))
        written = ShardInfo(url, path, location, fs.size(path))
    if read_shard(fs, written).num_rows != merged.num_rows:  # trust only what reads back
        raise ShardFormatError(f"{url}: merged shard reads back with a different row count; sources kept")
    _delete(fs, sources, url)
    log.info("compacted %d shards (%d rows) into %s", len(sources), merged.num_rows, url)
    return Compaction(url, [s.url for s in sources], merged.num_rows)


def _delete(fs: fsspec.AbstractFileSystem, sources: list[ShardInfo], merged_url: str) -> None:
    with storage_errors(merged_url):
        fs.rm([s.path for s in sources])
        remove_entries(fs, sources[0].path.rsplit("/", 4)[0], [s.location for s in sources])


def _temp_dir(shard: ShardInfo) -> str:
    """`{run}/_tmp` for a shard at `{run}/rollouts/env=E/policy_version=V/ID.parquet`."""
    return join(posixpath.dirname(shard.path.rsplit("/", 3)[0]), TEMPORARY)


def _finish_interrupted(fs: fsspec.AbstractFileSystem, shards: list[ShardInfo]) -> list[ShardInfo]:
    """Delete sources still present beside the merged shard that holds them; returns what is left."""
    by_name = {shard.name: shard for shard in shards}
    leftovers: set[str] = set()
    for shard, footer in zip(shards, read_footers(fs, shards), strict=True):
        if shard.name in leftovers or isinstance(footer, Exception):
            continue
        sources = compacted_from(footer.metadata)
        present = [by_name[name] for name in sources if name in by_name]
        if present:
            read_shard(fs, shard)  # the merged shard must be whole before its sources go
            log.warning(
                "finishing an interrupted compaction: deleting %d sources of %s",
                len(present),
                shard.url,
            )
            _delete(fs, present, shard.url)
            leftovers.update(s.name for s in present)
    return [shard for shard in shards if shard.name not in leftovers]
