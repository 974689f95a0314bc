"""Inspection of stored shards: summaries from footers, and full verification against the contract."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from core.scored_group import InvalidGroupError
from storage.schema import (
    METADATA_NUM_GROUPS,
    METADATA_TOKENIZER,
    SchemaVersionError,
    ShardFormatError,
    table_to_groups,
)
from storage.shard_file import ShardInfo, find_shards, read_footers, read_shard


@dataclass(frozen=True)
class ShardSummary:
    """What a shard's footer says, without reading its rows."""

    shard: ShardInfo
    groups: int | None = None
    sequences: int | None = None
    tokenizer: str | None = None
    error: str | None = None


@dataclass
class ShardCheck:
    """The result of reading a shard whole and validating every group."""

    shard: ShardInfo
    groups: int = 0
    sequences: int = 0
    tokens: int = 0
    tokenizer: str | None = None
    problems: list[str] = field(default_factory=list)


def summarize(url: str, *, storage_options: dict[str, Any] | None = None) -> list[ShardSummary]:
    fs, shards = find_shards(url, storage_options=storage_options)
    summaries = []
    for shard, footer in zip(shards, read_footers(fs, shards), strict=True):
        if isinstance(footer, Exception):
            summaries.append(ShardSummary(shard, error=str(footer)))
            continue
        metadata = footer.metadata or {}
        groups = metadata.get(METADATA_NUM_GROUPS)
        tokenizer = metadata.get(METADATA_TOKENIZER)
        summaries.append(
            ShardSummary(
                shard,
                groups=None if groups is None else int(groups),
                sequences=footer.num_rows,
                tokenizer=None if tokenizer is None else tokenizer.decode(),
            )
        )
    return summaries


def verify(url: str, *, storage_options: dict[str, Any] | None = None) -> list[ShardCheck]:
    """Read every shard under `url`, check schema, invariants and partition, decode every group, and
    flag group ids seen in two shards and tokenizers that differ from the first shard's."""
    fs, shards = find_shards(url, storage_options=storage_options)
    checks = []
    seen_groups: dict[str, str] = {}
    first_tokenizer: str | None = None
    for shard in shards:
        check = ShardCheck(shard)
        checks.append(check)
        try:
            table = read_shard(fs, shard)
            groups = table_to_groups(table)
        except (ShardFormatError, SchemaVersionError, InvalidGroupError, ValueError) as error:
            check.problems.append(str(error))
            continue
        check.tokenizer = table.schema.metadata[METADATA_TOKENIZER].decode()
        first_tokenizer = first_tokenizer or check.tokenizer
        if check.tokenizer != first_tokenizer:
            check.problems.append(f"tokenizer {check.tokenizer!r} differs from {first_tokenizer!r} of the first shard")
        check.groups, check.sequences = len(groups), table.num_rows
        check.tokens = sum(group.num_tokens for group in groups)
        for group in groups:
            if group.group_id in seen_groups:
                check.problems.append(f"group {group.group_id} is also in {seen_groups[group.group_id]}")
            seen_groups[group.group_id] = shard.url
    return checks
