"""The Arrow shard schema: one row per sequence, and ScoredGroup <-> Arrow table conversion."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

import numpy as np
import pyarrow as pa

from core.sampling import Sampling
from core.scored_group import SCHEMA_VERSION, ScoredGroup, ScoredSequence

# ScoredSequence.sampling; null: unset (temperature 1, no truncation), a null top_k: no top-k.
# (Its fields are nullable for Parquet's sake: a null struct's children are null too.)
SAMPLING_TYPE = pa.struct(
    [
        ("temperature", pa.float64()),
        ("top_p", pa.float64()),
        ("top_k", pa.int32()),
        ("min_p", pa.float64()),
        ("logprobs_mode", pa.string()),
    ]
)

# Group fields are repeated on every row of the group so any row, file or query stands alone.
SHARD_SCHEMA = pa.schema(
    [
        pa.field("env", pa.string(), nullable=False),
        pa.field("policy_version", pa.int64(), nullable=False),
        pa.field("group_id", pa.string(), nullable=False),
        pa.field("item_id", pa.string(), nullable=False),
        pa.field("group_size", pa.int32(), nullable=False),
        pa.field("sequence_index", pa.int32(), nullable=False),
        pa.field("tokens", pa.list_(pa.int32()), nullable=False),
        pa.field("mask", pa.list_(pa.bool_()), nullable=False),
        pa.field("logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("advantages", pa.list_(pa.float32()), nullable=True),
        pa.field("score", pa.float64(), nullable=False),
        pa.field("finish_reason", pa.string(), nullable=False),
        pa.field("messages", pa.string(), nullable=True),  # JSON list of messages
        pa.field("extras", pa.string(), nullable=False),  # JSON object of the sequence
        pa.field("group_extras", pa.string(), nullable=False),  # JSON object of the group
        pa.field("chat_template", pa.string(), nullable=True),
        pa.field("created_at", pa.timestamp("ns", tz="UTC"), nullable=False),
        pa.field("objective", pa.string(), nullable=True),
        pa.field("ref_logprobs", pa.list_(pa.float32()), nullable=True),
        pa.field("teacher_logprobs", pa.list_(pa.float32()), nullable=True),
        pa.field("previous_score", pa.float64(), nullable=True),
        # ScoredSequence.policy_versions: both null (unknown) or first <= last
        pa.field("first_policy_version", pa.int64(), nullable=True),
        pa.field("last_policy_version", pa.int64(), nullable=True),
        pa.field("sampling", SAMPLING_TYPE, nullable=True),
    ]
)
GROUP_COLUMNS = (
    "env",
    "policy_version",
    "item_id",
    "group_size",
    "group_extras",
    "chat_template",
    "created_at",
    "objective",
)
METADATA_SCHEMA_VERSION = b"clotho.schema_version"
METADATA_TOKENIZER = b"clotho.tokenizer"
METADATA_NUM_GROUPS = b"clotho.num_groups"
# JSON list of the shard names a compaction merged into this shard.
METADATA_COMPACTED_FROM = b"clotho.compacted_from"
# JSON list of the input shard names (of another run) a reprocess job made this shard from.
METADATA_REPROCESSED_FROM = b"clotho.reprocessed_from"


class ShardFormatError(Exception):
    """A shard's bytes or rows break the shard schema or the ScoredGroup invariants."""


class SchemaVersionError(Exception):
    """A shard was written with another schema version; it is valid data this clotho cannot read."""


def _to_json(value: Any, where: str) -> str:
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where} is not JSON-serializable ({error}); store plain JSON values") from error


def check_serializable(group: ScoredGroup) -> None:
    """Raise ValueError now, at the caller, if the group's open fields cannot be stored as JSON."""
    _to_json(group.extras, f"group {group.group_id} extras")
    for index, sequence in enumerate(group.sequences):
        _to_json(sequence.extras, f"group {group.group_id} sequences[{index}].extras")
        _to_json(sequence.messages, f"group {group.group_id} sequences[{index}].messages")


def _unix_ns(seconds: float) -> int:
    # Exact: int / 10**9 on the way back rounds to the same float, so created_at round-trips bit for bit.
    return round(Fraction(seconds) * 1_000_000_000)


def groups_to_table(groups: Sequence[ScoredGroup], tokenizer: str) -> pa.Table:
    """One row per sequence in group order, with schema version and tokenizer in the metadata."""
    if not groups:
        raise ValueError("groups is empty; a shard holds at least one group")
    if not tokenizer:
        raise ValueError("tokenizer is empty; pass the tokenizer's name or path so readers can check it")
    sequences = [sequence for group in groups for sequence in group.sequences]
    sizes = np.fromiter((len(group.sequences) for group in groups), np.int32, len(groups))
    row_group = np.repeat(np.arange(len(groups)), sizes)  # row -> index of its group

    def per_group(values: list[Any], type_: pa.DataType) -> pa.Array:
        return pa.array(values, type_).take(row_group)

    columns = {
        "env": per_group([g.env for g in groups], pa.string()),
        "policy_version": per_group([g.policy_version for g in groups], pa.int64()),
        "group_id": per_group([g.group_id for g in groups], pa.string()),
        "item_id": per_group([g.item_id for g in groups], pa.string()),
        "group_size": pa.array(sizes).take(row_group),
        "sequence_index": pa.array(np.concatenate([np.arange(n, dtype=np.int32) for n in sizes])),
        "tokens": pa.array([s.tokens for s in sequences], pa.list_(pa.int32())),
        "mask": pa.array([s.mask for s in sequences], pa.list_(pa.bool_())),
        "logprobs": pa.array([s.logprobs for s in sequences], pa.list_(pa.float32())),
        "advantages": pa.array([s.advantages for s in sequences], pa.list_(pa.float32())),
        "score": pa.array([s.score for s in sequences], pa.float64()),
        "finish_reason": pa.array([s.finish_reason for s in sequences], pa.string()),
        "messages": pa.array(
            [
                None if s.messages is None else _to_json(s.messages, f"group {g.group_id} messages")
                for g in groups
                for s in g.sequences
            ],
            pa.string(),
        ),
        "extras": pa.array(
            [_to_json(s.extras, f"group {g.group_id} sequence extras") for g in groups for s in g.sequences],
            pa.string(),
        ),
        "group_extras": per_group([_to_json(g.extras, f"group {g.group_id} extras") for g in groups], pa.string()),
        "chat_template": per_group([g.chat_template for g in groups], pa.string()),
        "created_at": per_group([_unix_ns(g.created_at) for g in groups], pa.int64()).cast(
            SHARD_SCHEMA.field("created_at").type
        ),
        "objective": per_group([g.objective for g in groups], pa.string()),
        "ref_logprobs": pa.array([s.ref_logprobs for s in sequences], pa.list_(pa.float32())),
        "teacher_logprobs": pa.array([s.teacher_logprobs for s in sequences], pa.list_(pa.float32())),
        "previous_score": pa.array([s.previous_score for s in sequences], pa.float64()),
        "first_policy_version": pa.array([s.policy_versions and s.policy_versions[0] for s in sequences], pa.int64()),
        "last_policy_version": pa.array([s.policy_versions and s.policy_versions[1] for s in sequences], pa.int64()),
        "sampling": pa.array([s.sampling and s.sampling.model_dump() for s in sequences], SAMPLING_TYPE),
    }
    metadata = {
        METADATA_SCHEMA_VERSION: str(SCHEMA_VERSION).encode(),
        METADATA_TOKENIZER: tokenizer.encode(),
        METADATA_NUM_GROUPS: str(len(groups)).encode(),
    }
    return pa.Table.from_pydict(columns, schema=SHARD_SCHEMA.with_metadata(metadata))


def concat_shard_tables(tables: list[pa.Table]) -> pa.Table:
    """Shard tables of one partition as one: rows in order, the first one's metadata with the group
    count summed (compaction and reprocessing merge shards this way)."""
    if len(tables) == 1:
        return tables[0]
    metadata = dict(tables[0].schema.metadata)
    metadata[METADATA_NUM_GROUPS] = str(sum(int(t.schema.metadata[METADATA_NUM_GROUPS]) for t in tables)).encode()
    return pa.concat_tables(tables).replace_schema_metadata(metadata)


def check_metadata(schema: pa.Schema) -> tuple[str, int]:
    """The shard's tokenizer and group count, after checking its schema version."""
    metadata = schema.metadata or {}
    try:
        version = int(metadata[METADATA_SCHEMA_VERSION])
        tokenizer = metadata[METADATA_TOKENIZER].decode()
        num_groups = int(metadata[METADATA_NUM_GROUPS])
    except (KeyError, ValueError) as error:
        raise ShardFormatError(f"file metadata lacks or garbles a clotho key ({error})") from None
    if version != SCHEMA_VERSION:
        raise SchemaVersionError(
            f"shard schema version {version} != {SCHEMA_VERSION}; read it with the clotho version "
            "that wrote it or convert it"
        )
    return tokenizer, num_groups


def compacted_from(metadata: dict[bytes, bytes] | None) -> list[str]:
    """Names of the shards a compacted shard replaced; [] for a shard written by a ShardWriter."""
    return _names(metadata, METADATA_COMPACTED_FROM)


def reprocessed_from(metadata: dict[bytes, bytes] | None) -> list[str]:
    """Names of the input shards a reprocess job made this shard from; [] for any other shard."""
    return _names(metadata, METADATA_REPROCESSED_FROM)


def _names(metadata: dict[bytes, bytes] | None, key: bytes) -> list[str]:
    raw = (metadata or {}).get(key)
    return json.loads(raw) if raw else []


def table_to_groups(table: pa.Table, *, validated: bool = False) -> list[ScoredGroup]:
    """Rebuild the groups of a shard table exactly.

    Each group is validated against the ScoredGroup contract, unless `validated` says `check_table`
    already passed on this table: its vectorized checks cover the same rules, and skipping the
    per-token Python checks makes decoding several times faster for the trainer.
    """
    check_metadata(table.schema)
    rows = {name: table.column(name).to_pylist() for name in SHARD_SCHEMA.names if name != "created_at"}
    created_ns = table.column("created_at").cast(pa.int64()).to_pylist()
    make_group = ScoredGroup.model_construct if validated else ScoredGroup
    samplings: dict[tuple, Sampling] = {}  # a shard's sequences share a few: one object each

    def sampling_of(row: dict[str, Any] | None) -> Sampling | None:
        if row is None:
            return None
        key = tuple(row.values())
        if key not in samplings:
            samplings[key] = Sampling(**row)
        return samplings[key]

    # Unvalidated: dicts, which ScoredGroup validates into sequences.
    make_sequence: Callable[..., Any] = ScoredSequence.model_construct if validated else dict
    groups: list[ScoredGroup] = []
    start = 0
    while start < table.num_rows:
        end = start + 1
        while end < table.num_rows and rows["group_id"][end] == rows["group_id"][start]:
            end += 1
        sequences = [
            make_sequence(
                tokens=rows["tokens"][i],
                mask=rows["mask"][i],
                logprobs=rows["logprobs"][i],
                score=rows["score"][i],
                advantages=rows["advantages"][i],
                ref_logprobs=rows["ref_logprobs"][i],
                teacher_logprobs=rows["teacher_logprobs"][i],
                previous_score=rows["previous_score"][i],
                policy_versions=None
                if rows["first_policy_version"][i] is None
                else (rows["first_policy_version"][i], rows["last_policy_version"][i]),
                sampling=sampling_of(rows["sampling"][i]),
                finish_reason=rows["finish_reason"][i],
                messages=None if rows["messages"][i] is None else json.loads(rows["messages"][i]),
                extras=json.loads(rows["extras"][i]),
            )
            for i in sorted(range(start, end), key=rows["sequence_index"].__getitem__)
        ]
        groups.append(
            make_group(
                env=rows["env"][start],
                item_id=rows["item_id"][start],
                sequences=sequences,
                group_id=rows["group_id"][start],
                policy_version=rows["policy_version"][start],
                chat_template=rows["chat_template"][start],
                extras=json.loads(rows["group_extras"][start]),
                created_at=created_ns[start] / 1_000_000_000,
                objective=rows["objective"][start],
                schema_version=SCHEMA_VERSION,
            )
        )
        start = end
    return groups
