"""Shard layout: Hive partition paths, time-sortable ids, name checks."""

from __future__ import annotations

import pytest

from storage.layout import (
    ShardLocation,
    is_hidden,
    new_shard_id,
    parse_shard_name,
    rollouts_url,
    shard_url,
)


def test_shard_url_is_hive_partitioned() -> None:
    shard_id = new_shard_id(1_700_000_000_123_456_789)
    assert shard_id.startswith("20231114T221320.123456789Z-")
    assert shard_url("s3://bucket/runs/", "run1", "gsm8k", 7, shard_id) == (
        f"s3://bucket/runs/run1/rollouts/env=gsm8k/policy_version=7/{shard_id}.parquet"
    )
    assert rollouts_url("/data", "run1") == "/data/run1/rollouts"


def test_shard_ids_sort_by_time() -> None:
    times = [1_000_000_000, 999_999_999_999, 1_700_000_000_000_000_001, 1_700_000_000_000_000_010]
    ids = [new_shard_id(t) for t in times]
    assert sorted(ids) == ids
    assert len(set(new_shard_id(5) for _ in range(100))) == 100  # random part keeps equal times apart


def test_parse_round_trips_and_rejects_strays() -> None:
    location = ShardLocation("chess-v2", 12, new_shard_id())
    assert parse_shard_name(location.name) == location
    assert parse_shard_name("env=a/policy_version=x/" + location.shard_id + ".parquet") is None
    assert parse_shard_name("env=a/" + location.shard_id + ".parquet") is None
    assert parse_shard_name("env=a/policy_version=1/notes.parquet") is None


@pytest.mark.parametrize("env", ["a/b", "env=x", "", "_hidden", ".dot", "a b", "x" * 129])
def test_env_names_that_cannot_be_partitions_are_refused(env: str) -> None:
    with pytest.raises(ValueError, match="cannot be a partition directory"):
        shard_url("/r", "run", env, 0, new_shard_id())


def test_run_and_version_checks() -> None:
    with pytest.raises(ValueError, match="run name"):
        rollouts_url("/r", "a/b")
    with pytest.raises(ValueError, match="policy_version"):
        shard_url("/r", "run", "e", -1, new_shard_id())
    with pytest.raises(ValueError, match="shard id"):
        shard_url("/r", "run", "e", 0, "x")


def test_hidden_names() -> None:
    assert is_hidden("_quarantine/rollouts/env=a/policy_version=1/x.parquet")
    assert is_hidden("env=a/policy_version=1/.x.parquet")
    assert not is_hidden("env=a/policy_version=1/x.parquet")
