"""The shard schema: every ScoredGroup field round-trips, and broken invariants are caught."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from clotho.testing.groups import make_group, make_groups
from core.sampling import Sampling
from core.scored_group import SCHEMA_VERSION, InvalidGroupError, ScoredGroup, ScoredSequence
from storage.schema import (
    METADATA_SCHEMA_VERSION,
    METADATA_TOKENIZER,
    SHARD_SCHEMA,
    SchemaVersionError,
    ShardFormatError,
    groups_to_table,
    table_to_groups,
)
from storage.shard_checks import check_table
from storage.shard_file import decode, encode


def test_every_field_round_trips_through_parquet() -> None:
    groups = make_groups(12, seed=1)
    table = decode(encode(groups_to_table(groups, "Qwen/Qwen2.5-0.5B")), "test://shard")
    back = table_to_groups(table)
    assert back == groups  # pydantic equality: every field of every group and sequence
    for before, after in zip(groups, back, strict=True):
        assert after.created_at == before.created_at  # bit for bit, through a nanosecond timestamp
        assert after.model_dump() == before.model_dump()
    assert table.schema.metadata[METADATA_SCHEMA_VERSION] == str(SCHEMA_VERSION).encode()
    assert table.schema.metadata[METADATA_TOKENIZER] == b"Qwen/Qwen2.5-0.5B"
    assert table.schema.remove_metadata().equals(SHARD_SCHEMA)


def test_one_row_per_sequence_with_group_fields_repeated() -> None:
    groups = make_groups(3, seed=2, size=5)
    table = groups_to_table(groups, "tok")
    assert table.num_rows == 15
    assert table.column("group_id").to_pylist() == [g.group_id for g in groups for _ in range(5)]
    assert table.column("sequence_index").to_pylist() == list(range(5)) * 3
    assert table.column("env").to_pylist() == ["gsm8k"] * 15


def test_logprobs_are_stored_as_float32() -> None:
    sequence = ScoredSequence.from_prompt([1, 2], [3], [-0.1], score=1.0)
    group = ScoredGroup(env="e", item_id="i", sequences=[sequence])
    table = groups_to_table([group], "tok")
    check_table(table)  # no advantages anywhere: an all-null column is valid
    back = table_to_groups(table)[0]
    assert back.sequences[0].logprobs == [0.0, 0.0, float(np.float32(-0.1))]
    assert back.sequences[0].advantages is None


DATA = Path(__file__).parent / "data"


def test_objective_round_trips_and_a_bad_one_is_named() -> None:
    groups = make_groups(2, seed=8)
    groups[0].objective = "sft"
    table = groups_to_table(groups, "tok")
    assert [g.objective for g in table_to_groups(table)] == ["sft", None]
    bad = table.set_column(
        table.schema.get_field_index("objective"),
        SHARD_SCHEMA.field("objective"),
        pa.array(["dance"] * table.num_rows, pa.string()),
    )
    with pytest.raises(ShardFormatError, match="objective: a value outside"):
        check_table(bad)
    with pytest.raises(ValueError, match="objective"):
        ScoredGroup(**{**groups[1].model_dump(), "objective": "dance"})


def _tampered(column: str, values: list) -> pa.Table:
    table = groups_to_table(make_groups(2, seed=3, size=2), "tok")
    index = table.schema.get_field_index(column)
    return table.set_column(index, SHARD_SCHEMA.field(column), pa.array(values, SHARD_SCHEMA.field(column).type))


def test_invariants_lengths_must_match() -> None:
    table = groups_to_table(make_groups(2, seed=3, size=2), "tok")
    mask = table.column("mask").to_pylist()
    mask[1] = mask[1] + [True]
    with pytest.raises(ShardFormatError, match="mask: length differs from tokens"):
        check_table(_tampered("mask", mask))
    logprobs = table.column("logprobs").to_pylist()
    logprobs[0] = logprobs[0][:-1]
    with pytest.raises(ShardFormatError, match="logprobs: length differs from tokens"):
        check_table(_tampered("logprobs", logprobs))


@pytest.mark.parametrize(
    ("column", "change", "message"),
    [
        ("tokens", lambda v: [[-1] + v[0][1:]] + v[1:], "negative token id"),
        ("logprobs", lambda v: [[float("nan")] + v[0][1:]] + v[1:], "logprobs: NaN or inf"),
        ("mask", lambda v: [[False] * len(v[0])] + v[1:], "no trained token"),
        ("mask", lambda v: v[:2] + [[False] * len(v[2])] + v[3:], "no trained token"),
        ("score", lambda v: [float("inf")] + v[1:], "score: NaN or inf"),
        ("finish_reason", lambda v: ["timeout"] + v[1:], "finish_reason"),
        ("sequence_index", lambda v: [1] + v[1:], "sequence_index"),
        ("group_size", lambda v: [3] + v[1:], "group_size"),
        ("item_id", lambda v: ["other"] + v[1:], "item_id: differs between rows of one group"),
    ],
)
def test_invariants_each_rule(column, change, message) -> None:
    table = groups_to_table(make_groups(2, seed=3, size=2), "tok")
    with pytest.raises(ShardFormatError, match=message):
        check_table(_tampered(column, change(table.column(column).to_pylist())))


def test_a_lost_row_is_caught() -> None:
    table = groups_to_table(make_groups(2, seed=4, size=3), "tok")
    with pytest.raises(ShardFormatError, match="group_size"):
        check_table(table.slice(1))


def test_a_slice_at_a_group_boundary_is_valid() -> None:
    groups = make_groups(3, seed=4, size=3)
    table = groups_to_table(groups, "tok").slice(3)  # offsets into every buffer, bit offsets for mask
    metadata = {**table.schema.metadata, b"clotho.num_groups": b"2"}
    check_table(table.replace_schema_metadata(metadata))
    assert table_to_groups(table) == groups[1:]


def test_missing_column_and_wrong_type_are_named() -> None:
    table = groups_to_table(make_groups(1, seed=5), "tok")
    with pytest.raises(ShardFormatError, match="score: column missing"):
        check_table(table.drop_columns(["score"]))
    wrong = table.set_column(
        table.schema.get_field_index("tokens"),
        "tokens",
        table.column("tokens").cast(pa.list_(pa.int64())),
    )
    with pytest.raises(ShardFormatError, match="tokens: type"):
        check_table(wrong)


def test_other_schema_version_is_not_corruption() -> None:
    table = groups_to_table(make_groups(1, seed=6), "tok")
    newer = table.replace_schema_metadata({**table.schema.metadata, METADATA_SCHEMA_VERSION: b"99"})
    with pytest.raises(SchemaVersionError, match="99"):
        check_table(newer)
    with pytest.raises(SchemaVersionError):
        table_to_groups(newer)


def test_a_shard_of_an_older_schema_version_is_refused_with_the_fix() -> None:
    # Written by clotho at schema version 5 (commit 87eabbe). Until a release, no code reads older
    # formats: the shard is refused by name, not read with guessed fields.
    with pytest.raises(SchemaVersionError, match="test://v5: shard schema version 5 != .*clotho version that wrote it"):
        decode((DATA / "schema-v5.parquet").read_bytes(), "test://v5")


def test_missing_metadata_is_a_format_error() -> None:
    table = groups_to_table(make_groups(1, seed=6), "tok").replace_schema_metadata(None)
    with pytest.raises(ShardFormatError, match="metadata"):
        check_table(table)


def test_clear_errors_for_bad_inputs() -> None:
    group = make_group(random.Random(7))
    with pytest.raises(ValueError, match="tokenizer is empty"):
        groups_to_table([group], "")
    with pytest.raises(ValueError, match="groups is empty"):
        groups_to_table([], "tok")
    group.extras["when"] = object()
    with pytest.raises(ValueError, match="extras is not JSON-serializable"):
        groups_to_table([group], "tok")


def test_sampling_round_trips_per_sequence() -> None:
    hot = Sampling(temperature=1.25, logprobs_mode="processed_logprobs")
    truncated = Sampling(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, logprobs_mode="raw_logprobs")
    sequences = [
        ScoredSequence.from_prompt([1, 2], [3], [-0.5], score=1.0, sampling=sampling)
        for sampling in (hot, truncated, None)
    ]
    group = ScoredGroup(env="e", item_id="i", sequences=sequences)
    table = groups_to_table([group], "tok")
    check_table(table)
    [back] = table_to_groups(decode(encode(table), "test://sampling"), validated=True)
    assert [s.sampling for s in back.sequences] == [hot, truncated, None]


def test_policy_versions_round_trip_and_a_backwards_range_is_named() -> None:
    spans = ScoredSequence.from_prompt([1, 2], [3, 4], [-0.5, -0.25], score=1.0, policy_versions=(4, 6))
    once = ScoredSequence.from_prompt([1, 2], [5], [-0.5], score=0.0, policy_versions=(5, 5))
    group = ScoredGroup(env="e", item_id="i", policy_version=4, sequences=[spans, once])
    table = groups_to_table([group], "tok")
    [back] = table_to_groups(decode(encode(table), "test://versions"))
    assert [s.policy_versions for s in back.sequences] == [(4, 6), (5, 5)] and back.policy_versions == (4, 6)
    first = table.schema.get_field_index("first_policy_version")
    backwards = table.set_column(first, "first_policy_version", pa.array([7, 5], pa.int64()))
    with pytest.raises(ShardFormatError, match="first_policy_version, last_policy_version"):
        check_table(backwards)
    half = table.set_column(first, "first_policy_version", pa.array([None, 5], pa.int64()))
    with pytest.raises(ShardFormatError, match="both null or first <= last"):
        check_table(half)
    with pytest.raises(InvalidGroupError, match=r"sequences\[0\].policy_versions: \(3, 2\) is not \(first, last\)"):
        ScoredGroup(
            env="e",
            item_id="i",
            sequences=[ScoredSequence.from_prompt([1], [2], [-0.1], score=0.0, policy_versions=(3, 2))],
        )


def _pair(scores=(1.0, 0.0), **fields) -> ScoredGroup:
    sequences = [ScoredSequence.from_prompt([1, 2], [3, 4], [-0.5, -0.25], score=score, **fields) for score in scores]
    return ScoredGroup(env="e", item_id="i", sequences=sequences, objective="dpo")


def test_reference_and_teacher_logprobs_round_trip_as_float32() -> None:
    pair = _pair(ref_logprobs=[0.0, 0.0, -0.1, -0.2])
    distill = ScoredGroup(
        env="e",
        item_id="j",
        objective="distill",
        sequences=[
            ScoredSequence.from_prompt([1], [5, 6], [-1.0, -2.0], score=0.0, teacher_logprobs=[0.0, -0.3, -0.7])
        ],
    )
    table = groups_to_table([pair, distill], "tok")
    check_table(table)
    back = table_to_groups(table)
    assert back[0].sequences[1].ref_logprobs == [0.0, 0.0, float(np.float32(-0.1)), float(np.float32(-0.2))]
    assert back[0].sequences[0].teacher_logprobs is None
    assert back[1].sequences[0].teacher_logprobs == [0.0, float(np.float32(-0.3)), float(np.float32(-0.7))]
    assert [g.objective for g in back] == ["dpo", "distill"]


def test_bad_preference_pairs_and_distillation_groups_are_named() -> None:
    from core.scored_group import InvalidGroupError, preference_pair

    with pytest.raises(InvalidGroupError, match="dpo pair with tied scores"):
        _pair(scores=(0.5, 0.5))
    with pytest.raises(InvalidGroupError, match="dpo needs a pair, this group has 3"):
        ScoredGroup(env="e", item_id="i", objective="dpo", sequences=_pair().sequences + _pair().sequences[:1])
    with pytest.raises(InvalidGroupError, match=r"teacher_logprobs: unset in a distill group"):
        ScoredGroup(env="e", item_id="i", objective="distill", sequences=_pair().sequences)
    with pytest.raises(InvalidGroupError, match=r"teacher_logprobs: length 3 != len\(tokens\) 4"):
        _pair(teacher_logprobs=[0.0, 0.0, -1.0])
    with pytest.raises(InvalidGroupError, match="ref_logprobs: contains NaN"):
        _pair(ref_logprobs=[0.0, 0.0, float("nan"), 0.0])
    assert preference_pair(_pair(scores=(0.0, 1.0))) == (1, 0)
    tie = ScoredSequence.from_prompt([1], [2], [-0.5], score=0.5)
    assert preference_pair(ScoredGroup(env="e", item_id="i", sequences=[tie, tie, tie])) is None
    # The same rules on a shard's columns: a tie written by other code is refused on read.
    table = groups_to_table([_pair()], "tok")
    tied = table.set_column(
        table.schema.get_field_index("score"), SHARD_SCHEMA.field("score"), pa.array([0.5, 0.5], pa.float64())
    )
    with pytest.raises(ShardFormatError, match="score: a dpo pair with tied scores"):
        check_table(tied)
