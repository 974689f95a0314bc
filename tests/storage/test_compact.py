"""Compaction merges small shards without losing or duplicating a row, and finishes if interrupted."""

from __future__ import annotations

import random

import fsspec
import pytest

from clotho.testing.groups import make_group
from storage.compact import compact
from storage.inspection import verify
from storage.reader import ShardReader
from storage.shard_file import find_shards, read_shard
from storage.writer import ShardWriter


def write_small_shards(root: str) -> list:
    rng = random.Random(21)
    groups = [make_group(rng, env=env, policy_version=v) for _ in range(5) for env in ("a", "b") for v in (0, 1)]
    with ShardWriter(root, "run", tokenizer="tok", max_groups=1) as writer:  # 20 one-group shards
        for group in groups:
            writer.add(group)
    return groups


def by_partition(groups: list) -> dict:
    partitions: dict = {}
    for group in groups:
        partitions.setdefault((group.env, group.policy_version), []).append(group)
    return partitions


def test_compaction_keeps_every_row_once(root: str) -> None:
    groups = write_small_shards(root)
    before = len(ShardReader(root, "run").new_shards())
    merged = compact(f"{root}/run", target_bytes=10**9)
    after = ShardReader(root, "run").new_shards()
    assert before == 20 and len(after) == 4 == len(merged)  # one shard per partition
    assert all(m.rows == 5 * 4 for m in merged)
    read = list(ShardReader(root, "run").groups())
    assert sorted(g.group_id for g in read) == sorted(g.group_id for g in groups)  # none lost, none twice
    assert by_partition(read) == by_partition(groups)  # same rows, order kept within each partition
    assert all(not check.problems for check in verify(f"{root}/run"))
    assert compact(f"{root}/run", target_bytes=10**9) == []  # nothing left to merge


def test_target_bytes_bounds_the_merge(root: str) -> None:
    write_small_shards(root)
    partition = f"{root}/run/rollouts/env=a/policy_version=0"
    _, shards = find_shards(partition)
    size = {s.url: s.size for s in shards}
    target = 2 * max(size.values())
    merged = compact(partition, target_bytes=target)
    assert merged and all(len(m.sources) >= 2 and sum(size[u] for u in m.sources) <= target for m in merged)
    _, after = find_shards(partition)
    assert len(after) == len(shards) - sum(len(m.sources) - 1 for m in merged)


def test_interrupted_compaction_is_finished_by_the_next(root: str) -> None:
    groups = write_small_shards(root)
    fs, shards = find_shards(f"{root}/run")
    partition = [s for s in shards if s.env == "a" and s.policy_version == 1]
    saved = {s.path: fs.cat_file(s.path) for s in partition}
    compact(f"{root}/run/rollouts/env=a/policy_version=1", target_bytes=10**9)
    for path, data in list(saved.items())[:2]:  # as if it crashed after writing, mid-way through deleting
        fs.pipe_file(path, data)
    compact(f"{root}/run", target_bytes=10**9)
    read = list(ShardReader(root, "run").groups())
    assert sorted(g.group_id for g in read) == sorted(g.group_id for g in groups)


def test_reader_skips_a_merge_of_consumed_shards(root: str) -> None:
    groups = write_small_shards(root)
    trainer = ShardReader(root, "run")
    assert len(list(trainer.groups())) == len(groups)
    compact(f"{root}/run", target_bytes=10**9)
    assert list(trainer.groups()) == []  # the merged shards hold nothing new
    assert len(trainer.ledger.consumed) == 20 + 4


def test_reader_refuses_a_merge_of_partly_consumed_shards(root: str) -> None:
    write_small_shards(root)
    trainer = ShardReader(root, "run", envs=["a"])
    stream = trainer.groups()
    next(stream)
    stream.close()
    compact(f"{root}/run", target_bytes=10**9)
    with pytest.raises(RuntimeError, match="do not compact partitions a trainer is still consuming"):
        list(trainer.groups())


def test_merged_shard_has_its_sources_in_metadata(root: str) -> None:
    write_small_shards(root)
    fs, before = find_shards(f"{root}/run/rollouts/env=b/policy_version=0")
    [merged] = compact(f"{root}/run/rollouts/env=b/policy_version=0", target_bytes=10**9)
    _, [shard] = find_shards(merged.url)
    assert read_shard(fs, shard).schema.metadata[b"clotho.compacted_from"].decode().count("parquet") == len(before)
    assert not any(fsspec.core.url_to_fs(s.url)[0].exists(s.path) for s in before)
