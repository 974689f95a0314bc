"""ShardWriter on every backend: when it flushes, where shards go, and that no finished group is lost."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from clotho.testing.groups import make_group, make_groups
from core.scored_group import ScoredGroup
from storage.filesystem import publish, resolve
from storage.inspection import verify
from storage.reader import ShardReader
from storage.writer import ShardWriter, estimated_bytes


def read_back(root: str) -> list[ScoredGroup]:
    return list(ShardReader(root, "run").groups())


def test_flushes_on_group_count(root: str) -> None:
    writer = ShardWriter(root, "run", tokenizer="tok", max_groups=3)
    groups = make_groups(7)
    written = [writer.add(group) for group in groups]
    assert [len(urls) for urls in written] == [0, 0, 1, 0, 0, 1, 0]
    assert written[2][0].startswith(f"{root}/run/rollouts/env=gsm8k/policy_version=0/")
    assert writer.pending_groups == 1
    assert len(writer.close()) == 1
    assert read_back(root) == groups


def test_a_batch_past_the_limit_is_split_into_shards_of_at_most_max_groups(root: str) -> None:
    writer = ShardWriter(root, "run", tokenizer="tok", max_groups=4)
    groups = make_groups(12)
    assert writer.add_many(groups[:2]) == []
    written = writer.add_many(groups[2:])  # 12 buffered: shards of 4, 4 and 4
    assert len(written) == 3 and writer.pending_groups == 0
    assert [check.groups for check in verify(f"{root}/run")] == [4, 4, 4]
    assert read_back(root) == groups


def test_flushes_on_bytes_and_age(root: str) -> None:
    groups = make_groups(3)
    by_bytes = ShardWriter(root, "run", tokenizer="tok", max_bytes=estimated_bytes(groups[0]) + 1)
    assert by_bytes.add(groups[0]) == []
    assert len(by_bytes.add(groups[1])) == 1
    by_age = ShardWriter(root, "run", tokenizer="tok", max_age_s=0.05)
    assert by_age.add(groups[2]) == []
    assert by_age.flush_if_due() == []
    time.sleep(0.06)
    assert len(by_age.flush_if_due()) == 1
    assert sorted(g.group_id for g in read_back(root)) == sorted(g.group_id for g in groups)


def test_one_shard_per_partition(root: str) -> None:
    rng = random.Random(0)
    groups = [make_group(rng, env=env, policy_version=v) for env in ("a", "b") for v in (0, 1) for _ in range(2)]
    with ShardWriter(root, "run", tokenizer="tok") as writer:
        writer.add_many(groups)
        urls = writer.flush()
    assert len(urls) == 4
    assert {url.split("/rollouts/")[1].rsplit("/", 1)[0] for url in urls} == {
        f"env={e}/policy_version={v}" for e in ("a", "b") for v in (0, 1)
    }
    assert sorted(g.group_id for g in read_back(root)) == sorted(g.group_id for g in groups)


def test_flushes_when_the_block_raises(root: str) -> None:
    groups = make_groups(2)
    with pytest.raises(KeyboardInterrupt), ShardWriter(root, "run", tokenizer="tok") as writer:
        writer.add_many(groups)
        raise KeyboardInterrupt
    assert read_back(root) == groups


async def test_flushes_when_the_task_is_cancelled(root: str) -> None:
    groups = make_groups(3)
    added = asyncio.Event()

    async def rollout_flow() -> None:
        async with ShardWriter(root, "run", tokenizer="tok") as writer:
            for group in groups:
                await asyncio.to_thread(writer.add, group)
            added.set()
            await asyncio.sleep(3600)  # waiting for more rollouts when the flow is cancelled

    task = asyncio.create_task(rollout_flow())
    await added.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert read_back(root) == groups


def test_shards_are_never_overwritten(root: str) -> None:
    fs, run = resolve(f"{root}/run")
    path = f"{run}/rollouts/x.parquet"
    publish(fs, path, b"first", f"{run}/_tmp")
    with pytest.raises(FileExistsError, match="never overwritten"):
        publish(fs, path, b"second", f"{run}/_tmp")
    assert fs.cat_file(path) == b"first"


def test_clear_errors(root: str) -> None:
    with pytest.raises(ValueError, match="tokenizer is empty"):
        ShardWriter(root, "run", tokenizer="")
    with pytest.raises(ValueError, match="max_groups is 0"):
        ShardWriter(root, "run", tokenizer="tok", max_groups=0)
    writer = ShardWriter(root, "run", tokenizer="tok")
    with pytest.raises(TypeError, match="expected a ScoredGroup"):
        writer.add({"env": "x"})  # type: ignore[arg-type]
    bad = make_group(random.Random(1), env="a/b")
    with pytest.raises(ValueError, match="cannot be a partition directory"):
        writer.add(bad)
    writer.close()
    with pytest.raises(RuntimeError, match="closed"):
        writer.add(make_group(random.Random(2)))
