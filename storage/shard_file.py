"""One shard file: Parquet encoding, publishing, finding shards under a URL and reading them back."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from storage.filesystem import list_files, publish, read_bytes, relative, resolve, storage_errors
from storage.layout import SHARD_SUFFIX, ShardLocation, is_hidden, join, parse_shard_name
from storage.schema import SchemaVersionError, ShardFormatError
from storage.shard_checks import check_table

log = logging.getLogger(__name__)

# Random token ids and logprobs gain nothing from dictionaries; repeated strings do.
_DICTIONARY_COLUMNS = [
    "env",
    "group_id",
    "item_id",
    "finish_reason",
    "group_extras",
    "chat_template",
]
_FOOTER_READ = 64 * 1024  # a shard footer is a few kB; one read of the tail almost always holds it
_STATISTICS_COLUMNS = ["env", "policy_version", "group_id", "item_id", "score", "created_at"]


@dataclass(frozen=True)
class ShardInfo:
    """A shard found in storage: where it is, its partition, and its size in bytes (None when it was
    found through the index, which does not list sizes)."""

    url: str
    path: str  # the fsspec path (no protocol) of the same file
    location: ShardLocation
    size: int | None

    @property
    def name(self) -> str:
        """`env=E/policy_version=V/ID.parquet`: the shard's identity in ledgers, whatever the root."""
        return self.location.name

    @property
    def env(self) -> str:
        return self.location.env

    @property
    def listed_size(self) -> int:
        """Its size, for what needs one (footer reads, compaction): a shard found by listing has it."""
        if self.size is None:
            raise ValueError(f"{self.url}: size unknown (found through the index); find it by listing (find_shards)")
        return self.size

    @property
    def policy_version(self) -> int:
        return self.location.policy_version


def encode(table: pa.Table) -> pa.Buffer:
    """The Parquet bytes of a shard table (zstd), built in memory so publishing is one write."""
    sink = pa.BufferOutputStream()
    pq.write_table(
        table,
        sink,
        compression="zstd",
        use_dictionary=_DICTIONARY_COLUMNS,
        write_statistics=_STATISTICS_COLUMNS,
        use_byte_stream_split=["logprobs", "advantages"],
    )
    return sink.getvalue()


def decode(data: bytes | pa.Buffer, url: str) -> pa.Table:
    """Parse and check shard bytes; ShardFormatError (with the URL) if they are not a valid shard."""
    try:
        # ParquetFile, not read_table: read_table's dataset scan can drop its last reference to the
        # bytes on one of arrow's pool threads after returning, and a command that exits then aborts
        # ("terminate called without an active exception": that thread wants the GIL at finalization).
        with pq.ParquetFile(pa.BufferReader(data)) as file:
            table = file.read()
    except (pa.ArrowException, OSError, ValueError) as error:
        raise ShardFormatError(f"{url}: not a readable Parquet file ({error})") from error
    try:
        check_table(table)
    except (ShardFormatError, SchemaVersionError) as error:
        raise type(error)(f"{url}: {error}") from error
    return table


def write_shard(
    fs: fsspec.AbstractFileSystem, path: str, table: pa.Table, temp_dir: str, before: Callable[[], None] | None = None
) -> None:
    """Encode and publish a checked shard table at `path`; raises FileExistsError if it exists.
    `before` runs once the bytes are staged, just before the shard becomes visible (publish)."""
    check_table(table)
    publish(fs, path, memoryview(encode(table)), temp_dir, before)


def read_shard(fs: fsspec.AbstractFileSystem, shard: ShardInfo) -> pa.Table:
    """Fetch and decode a shard. I/O errors propagate; bad bytes raise ShardFormatError."""
    with storage_errors(shard.url):
        data = read_bytes(fs, shard.path)
    table = decode(data, shard.url)
    for name, expected in (("env", shard.env), ("policy_version", shard.policy_version)):
        if not pc.all(pc.equal(table.column(name), expected)).as_py():
            raise ShardFormatError(f"{shard.url}: column {name} holds values other than {expected!r} from its path")
    return table


def read_footer(fs: fsspec.AbstractFileSystem, shard: ShardInfo) -> pq.FileMetaData:
    """Only the footer: row count, tokenizer and compaction sources without reading rows."""
    with storage_errors(shard.url), fs.open(shard.path, "rb") as file:
        try:
            return pq.read_metadata(file)
        except (pa.ArrowException, OSError, ValueError) as error:
            raise ShardFormatError(f"{shard.url}: not a readable Parquet file ({error})") from error


def read_footers(fs: fsspec.AbstractFileSystem, shards: list[ShardInfo]) -> list[pq.FileMetaData | Exception]:
    """The footers of many shards from one batch of tail reads, concurrent on object stores.

    Each entry is the footer or the error for that shard (FileNotFoundError, ShardFormatError).
    """
    sizes = [shard.listed_size for shard in shards]
    starts = [max(0, size - _FOOTER_READ) for size in sizes]
    with storage_errors(shards[0].url if shards else ""):
        tails = fs.cat_ranges([s.path for s in shards], starts, sizes, on_error="return")
    footers: list[pq.FileMetaData | Exception] = []
    for shard, start, tail in zip(shards, starts, tails, strict=True):
        if isinstance(tail, Exception):
            footers.append(tail)
        elif start > 0 and len(tail) >= 8 and int.from_bytes(tail[-8:-4], "little") + 8 > len(tail):
            footers.append(_or_error(read_footer, fs, shard))  # a footer larger than the tail read
        else:
            footers.append(_or_error(_parse_footer, tail, shard.url))
    return footers


def _parse_footer(tail: bytes, url: str) -> pq.FileMetaData:
    try:  # the footer is addressed from the end of the file, so the tail alone parses
        return pq.read_metadata(pa.BufferReader(tail))
    except (pa.ArrowException, OSError, ValueError) as error:
        raise ShardFormatError(f"{url}: not a readable Parquet file ({error})") from error


def _or_error(function: Any, *args: Any) -> Any:
    try:
        return function(*args)
    except (ShardFormatError, OSError) as error:
        return error


def find_shards(
    url: str,
    *,
    storage_options: dict[str, Any] | None = None,
    envs: set[str] | None = None,
) -> tuple[fsspec.AbstractFileSystem, list[ShardInfo]]:
    """The shards under `url` (a run, its rollouts/ or a partition), oldest id first.

    Names starting with '_' or '.' (temporary files, quarantine) are skipped, as are files that are
    not `env=E/policy_version=V/ID.parquet`.
    """
    fs, base = resolve(url, storage_options)
    with storage_errors(url):
        if base.endswith(SHARD_SUFFIX) and fs.isfile(base):
            files = {base: fs.size(base)}
            base = base.rsplit("/", 3)[0]
            url = url.rsplit("/", 3)[0]
        else:
            files = {}
            for directory in _partition_dirs(fs, base, envs):
                files.update(list_files(fs, directory))
    shards = []
    for path, size in files.items():
        below = relative(path, base)
        if is_hidden(below) or not below.endswith(SHARD_SUFFIX):
            continue
        location = parse_shard_name("/".join(path.split("/")[-3:]))
        if location is None:
            log.debug("skipping %s: not env=E/policy_version=V/ID.parquet", path)
            continue
        if envs is not None and location.env not in envs:
            continue
        shards.append(ShardInfo(join(url, below), path, location, size))
    shards.sort(key=lambda shard: (shard.location.shard_id, shard.name))
    return fs, shards


def _partition_dirs(fs: fsspec.AbstractFileSystem, base: str, envs: set[str] | None) -> list[str]:
    """Directories to list: only the partitions of `envs`; `base` itself without a filter (one
    recursive listing is cheapest)."""
    if envs is None:
        return [base]
    env_dirs = _child_dirs(fs, base, "env=")
    if env_dirs is None:  # not a rollouts directory: the filter applies file by file
        return [base]
    return [path for value, path in env_dirs if value in envs]


def _child_dirs(fs: fsspec.AbstractFileSystem, path: str, prefix: str) -> list[tuple[str, str]] | None:
    """(value, path) of the `prefix`VALUE subdirectories of path; None if it has none."""
    try:
        children = fs.ls(path, detail=True)
    except FileNotFoundError:
        return []
    found = []
    for child in children:
        name = child["name"].rstrip("/").rsplit("/", 1)[-1]
        if child["type"] == "directory" and name.startswith(prefix):
            found.append((name.removeprefix(prefix), child["name"].rstrip("/")))
    return found or None
