"""The checks every shard read runs on its Arrow table before decoding it (storage.shard_file):
the ScoredGroup contract's rules, vectorized by column, so the trainer's reads stay fast."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from core.scored_group import FINISH_REASONS, OBJECTIVES
from storage.schema import GROUP_COLUMNS, SHARD_SCHEMA, ShardFormatError, check_metadata


def check_table(table: pa.Table) -> None:
    """Raise ShardFormatError naming every broken rule; vectorized so the trainer's reads stay fast."""
    _, num_groups = check_metadata(table.schema)
    problems = _schema_problems(table.schema)
    if problems:
        raise ShardFormatError("; ".join(problems))
    if table.num_rows == 0:
        raise ShardFormatError("no rows; a shard holds at least one group")
    column = {name: _one_chunk(table.column(name)) for name in table.column_names}
    lengths = pc.list_value_length(column["tokens"])
    if pc.min(lengths).as_py() == 0:
        problems.append("tokens: an empty sequence; every sequence has at least one token")
    for name in ("mask", "logprobs", "advantages", "ref_logprobs", "teacher_logprobs"):
        other = pc.list_value_length(column[name])
        if not pc.all(pc.or_kleene(pc.equal(other, lengths), pc.is_null(other))).as_py():
            problems.append(f"{name}: length differs from tokens in some row; lengths must match")
    tokens = pc.list_flatten(column["tokens"])
    if len(tokens) and pc.min(tokens).as_py() < 0:
        problems.append("tokens: negative token id")
    for name in ("logprobs", "advantages", "ref_logprobs", "teacher_logprobs"):
        if not np.isfinite(pc.list_flatten(column[name]).to_numpy(zero_copy_only=False)).all():
            problems.append(f"{name}: NaN or inf")
    mask_lengths = pc.list_value_length(column["mask"]).to_numpy()
    if mask_lengths.min() == 0 or not _every_row_has_a_true(column["mask"], mask_lengths):
        problems.append("mask: a sequence with no trained token")
    if not pc.all(pc.is_finite(column["score"])).as_py():
        problems.append("score: NaN or inf")
    if not pc.all(pc.is_in(column["finish_reason"], pa.array(FINISH_REASONS))).as_py():
        problems.append(f"finish_reason: a value outside {FINISH_REASONS}")
    objective = column["objective"]
    if (
        objective.null_count < len(objective)
        and not pc.all(pc.or_kleene(pc.is_in(objective, pa.array(OBJECTIVES)), pc.is_null(objective))).as_py()
    ):
        problems.append(f"objective: a value outside {OBJECTIVES} (or null)")
    problems += _version_problems(column)
    problems += _objective_problems(column)
    problems += _group_problems(column, num_groups)
    if problems:
        raise ShardFormatError("; ".join(problems))


def _one_chunk(column: pa.ChunkedArray) -> pa.Array:
    # combine_chunks copies even a single chunk; a shard read whole has one chunk per column
    return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()


def _every_row_has_a_true(mask: pa.ListArray, lengths: np.ndarray) -> bool:
    """Vectorized any() per row, on the unpacked bitmap; rows must be non-empty."""
    flat = pc.list_flatten(mask)
    if flat.null_count:
        return False
    bits = np.unpackbits(np.frombuffer(flat.buffers()[1], np.uint8), bitorder="little")
    bits = bits[flat.offset : flat.offset + len(flat)]
    starts = np.concatenate([[0], np.cumsum(lengths[:-1])])
    return bool(np.maximum.reduceat(bits, starts).all())


def _schema_problems(schema: pa.Schema) -> list[str]:
    problems = []
    for expected in SHARD_SCHEMA:
        index = schema.get_field_index(expected.name)
        if index < 0:
            problems.append(f"{expected.name}: column missing")
        elif not schema.field(index).type.equals(expected.type):
            problems.append(f"{expected.name}: type {schema.field(index).type} != {expected.type}")
    extra = set(schema.names) - set(SHARD_SCHEMA.names)
    if extra:
        problems.append(f"unexpected columns {sorted(extra)}")
    return problems


def _version_problems(column: dict[str, pa.Array]) -> list[str]:
    """ScoredSequence.policy_versions by column: both null (unknown) or first <= last."""
    first, last = column["first_policy_version"], column["last_policy_version"]
    if (
        not pc.all(pc.equal(pc.is_null(first), pc.is_null(last))).as_py()
        or not pc.all(pc.or_kleene(pc.less_equal(first, last), pc.is_null(first))).as_py()
    ):
        return ["first_policy_version, last_policy_version: both null or first <= last in every row"]
    return []


def _objective_problems(column: dict[str, pa.Array]) -> list[str]:
    """What a dpo or distill group lacks (core.scored_group.objective_problems, by column)."""
    objective = column["objective"]
    if objective.null_count == len(objective):
        return []
    names = objective.to_numpy(zero_copy_only=False)
    problems = []
    dpo = np.flatnonzero(names == "dpo")
    if len(dpo):
        if (column["group_size"].to_numpy()[dpo] != 2).any():
            problems.append("objective: a dpo group that is not a pair (group_size != 2)")
        else:
            first = dpo[column["sequence_index"].to_numpy()[dpo] == 0]
            scores = column["score"].to_numpy()
            if len(first) and first.max() + 1 < len(scores) and (scores[first] == scores[first + 1]).any():
                problems.append("score: a dpo pair with tied scores")
    distill = names == "distill"
    if distill.any() and column["teacher_logprobs"].is_null().to_numpy(zero_copy_only=False)[distill].any():
        problems.append("teacher_logprobs: null in a distill group")
    return problems


def _group_problems(column: dict[str, pa.Array], num_groups: int) -> list[str]:
    """Rows of a group are contiguous, numbered 0..n-1, as many as group_size, sharing group fields."""
    group_ids = column["group_id"].to_numpy(zero_copy_only=False)
    starts = np.flatnonzero(np.concatenate([[True], group_ids[1:] != group_ids[:-1]]))
    sizes = np.diff(np.append(starts, len(group_ids)))
    problems = []
    if len(set(group_ids[starts])) != len(starts):
        problems.append("group_id: rows of a group are not contiguous")
    elif len(starts) != num_groups:
        problems.append(f"{len(starts)} groups but the metadata says {num_groups}")
    expected_index = np.arange(len(group_ids)) - np.repeat(starts, sizes)
    if not np.array_equal(column["sequence_index"].to_numpy(), expected_index):
        problems.append("sequence_index: not 0..n-1 within each group")
    if not np.array_equal(column["group_size"].to_numpy(), np.repeat(sizes, sizes)):
        problems.append("group_size: differs from the number of rows of the group (a lost or extra row)")
    first_of_group = pa.array(np.repeat(starts, sizes))
    for name in GROUP_COLUMNS:
        values = column[name]
        if not values.equals(values.take(first_of_group)):
            problems.append(f"{name}: differs between rows of one group")
    return problems
