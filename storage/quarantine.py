"""Move a corrupt shard out of the dataset into `{run}/_quarantine/`, with the reason beside it."""

from __future__ import annotations

import logging
import posixpath

import fsspec

from storage.filesystem import is_local
from storage.index import remove_entries
from storage.layout import QUARANTINE
from storage.shard_file import ShardInfo

log = logging.getLogger(__name__)


def quarantine_path(shard: ShardInfo) -> str:
    """`{run}/rollouts/env=E/.../ID.parquet` -> `{run}/_quarantine/rollouts/env=E/.../ID.parquet`."""
    dataset_dir = shard.path.rsplit("/", 3)[0]  # the directory holding the env=E partitions
    parent, dataset_name = posixpath.split(dataset_dir)
    return posixpath.join(parent, QUARANTINE, dataset_name, shard.name)


def quarantine(fs: fsspec.AbstractFileSystem, shard: ShardInfo, reason: str) -> str | None:
    """Move `shard` aside and log it with its URL; returns the new path, None if it could not move.

    Never raises: a bad shard must not stop the reader, and the error log keeps it from vanishing
    silently even when the move fails (read-only bucket, say).
    """
    target = quarantine_path(shard)
    try:
        if is_local(fs):
            fs.makedirs(posixpath.dirname(target), exist_ok=True)
        fs.mv(shard.path, target)
        fs.pipe_file(f"{target}.error.txt", reason.encode())
        remove_entries(fs, shard.path.rsplit("/", 4)[0], [shard.location])  # no longer a shard of the run
    except FileNotFoundError:
        log.warning("corrupt shard %s was already moved by another reader: %s", shard.url, reason)
        return None
    except Exception as error:  # noqa: BLE001 - the reader goes on without the shard whatever the store said
        log.error("corrupt shard %s could not be quarantined (%s): %s", shard.url, error, reason)
        return None
    log.error("corrupt shard %s moved to %s: %s", shard.url, target, reason)
    return target
