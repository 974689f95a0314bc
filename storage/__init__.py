"""Rollout shards: ScoredGroups as Parquet on any fsspec URL, written atomically, read exactly once."""

from storage.compact import Compaction, compact
from storage.layout import new_shard_id, parse_shard_name, rollouts_url, run_url, shard_url
from storage.ledger import Ledger
from storage.reader import RolloutBatch, ShardReader, TokenizerMismatchError
from storage.schema import (
    SHARD_SCHEMA,
    SchemaVersionError,
    ShardFormatError,
    groups_to_table,
    table_to_groups,
)
from storage.shard_file import ShardInfo, find_shards
from storage.writer import ShardWriter

__all__ = [
    "SHARD_SCHEMA",
    "Compaction",
    "Ledger",
    "RolloutBatch",
    "SchemaVersionError",
    "ShardFormatError",
    "ShardInfo",
    "ShardReader",
    "ShardWriter",
    "TokenizerMismatchError",
    "compact",
    "find_shards",
    "groups_to_table",
    "new_shard_id",
    "parse_shard_name",
    "rollouts_url",
    "run_url",
    "shard_url",
    "table_to_groups",
]
