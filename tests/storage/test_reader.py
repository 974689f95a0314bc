"""ShardReader on every backend: order, filters, hidden names, and exactly-once across a restart."""

from __future__ import annotations

import dataclasses
import logging
import random

import fsspec
import pytest

import storage.reader as reader_module
from clotho.testing.groups import make_group, make_groups
from storage.ledger import Ledger
from storage.reader import ShardReader, TokenizerMismatchError
from storage.writer import ShardWriter


def write_shards(root: str, count: int, groups_per_shard: int = 3, seed: int = 0, **fields) -> list:
    """`count` shards, one flush each; returns their groups in write order."""
    groups = make_groups(count * groups_per_shard, seed=seed, **fields)
    with ShardWriter(root, "run", tokenizer="tok", max_groups=groups_per_shard) as writer:
        for start in range(0, len(groups), groups_per_shard):
            writer.add_many(groups[start : start + groups_per_shard])
    return groups


def test_empty_run_has_no_shards(root: str) -> None:
    reader = ShardReader(root, "run")
    assert reader.new_shards() == []
    assert list(reader.groups()) == []


def test_reads_in_write_order_across_partitions(root: str) -> None:
    rng = random.Random(3)
    groups = [make_group(rng, env=rng.choice(["a", "b"]), policy_version=rng.randrange(3)) for _ in range(12)]
    with ShardWriter(root, "run", tokenizer="tok", max_groups=1) as writer:
        for group in groups:
            writer.add(group)
    reader = ShardReader(root, "run")
    shards = reader.new_shards()
    assert len(shards) == 12
    assert [s.shard_id for s in (shard.location for shard in shards)] == sorted(s.location.shard_id for s in shards)
    assert list(reader.groups()) == groups
    assert reader.new_shards() == []  # all consumed


def test_filters_by_env(root: str) -> None:
    rng = random.Random(4)
    groups = [make_group(rng, env=env, policy_version=v) for env in ("a", "b") for v in range(4)]
    with ShardWriter(root, "run", tokenizer="tok") as writer:
        writer.add_many(groups)
    only_a = ShardReader(root, "run", envs=["a"])
    assert [(g.env, g.policy_version) for g in only_a.groups()] == [("a", v) for v in range(4)]
    # Every policy version is handed out: staleness is the trainer's rule (trainer.data.is_stale).
    everything = ShardReader(root, "run")
    assert sorted((g.env, g.policy_version) for g in everything.groups()) == [(e, v) for e in "ab" for v in range(4)]


def test_ignores_hidden_and_stray_files(root: str) -> None:
    groups = write_shards(root, 1)
    fs, _ = fsspec.core.url_to_fs(root)
    partition = f"{root}/run/rollouts/env=gsm8k/policy_version=0"
    for name in ("_tmp.parquet", ".writing.parquet", "_SUCCESS", "notes.txt", "not-an-id.parquet"):
        with fsspec.open(f"{partition}/{name}", "wb") as file:
            file.write(b"partial garbage")
    with fsspec.open(f"{root}/run/rollouts/_staging/env=gsm8k/policy_version=0/x.parquet", "wb") as file:
        file.write(b"partial garbage")
    reader = ShardReader(root, "run")
    assert len(reader.new_shards()) == 1
    assert list(reader.groups()) == groups
    assert not fs.exists(f"{root}/run/_quarantine")  # ignored, not quarantined


def test_ledger_exactly_once_across_restart(root: str) -> None:
    first_groups = write_shards(root, 3, groups_per_shard=4, seed=1)
    trainer = ShardReader(root, "run", tokenizer="tok")
    stream = trainer.groups()
    consumed = [next(stream) for _ in range(6)]  # one shard and a half
    checkpoint = trainer.ledger.to_json()  # saved with the checkpoint after training on those 6
    stream.close()
    next_groups = write_shards(root, 2, groups_per_shard=4, seed=2)  # rollouts go on meanwhile

    resumed = ShardReader(root, "run", tokenizer="tok", ledger=Ledger.from_json(checkpoint))
    consumed += list(resumed.groups())
    assert [g.group_id for g in consumed] == [g.group_id for g in first_groups + next_groups]
    assert list(ShardReader(root, "run", ledger=Ledger.from_json(resumed.ledger.to_json())).groups()) == []


def test_batches_resume_a_partial_shard(root: str) -> None:
    groups = write_shards(root, 2, groups_per_shard=4, seed=5)
    reader = ShardReader(root, "run")
    stream = reader.groups()
    taken = [next(stream) for _ in range(3)]
    stream.close()
    resumed = ShardReader(root, "run", ledger=Ledger.from_dict(reader.ledger.to_dict()))
    batches = list(resumed.batches())
    assert [b.num_groups for b in batches] == [1, 4]
    assert taken + [g for b in batches for g in b.groups()] == groups
    assert resumed.ledger.partial == {} and len(resumed.ledger.consumed) == 2


def test_a_trainer_taking_a_few_groups_per_step_reads_each_shard_once(root: str, monkeypatch) -> None:
    groups = write_shards(root, 2, groups_per_shard=5, seed=6)
    reads: list[str] = []
    real_read_shard = reader_module.read_shard

    def counting_read_shard(fs, shard):
        reads.append(shard.name)
        return real_read_shard(fs, shard)

    monkeypatch.setattr(reader_module, "read_shard", counting_read_shard)
    first, second = [shard.name for shard in ShardReader(root, "run").new_shards()]
    reader = ShardReader(root, "run")
    taken = []
    for _ in range(4):  # steps of 3 groups, each abandoning the pass like trainer.data does
        for group in reader.groups():
            taken.append(group)
            if len(taken) % 3 == 0:
                break
    assert taken == groups
    assert reads.count(first) == 1  # steps 2 and 3 went on from the decoded shard
    assert reads.count(second) == 1  # read ahead during step 1, kept for step 2


def test_a_listed_shard_that_cannot_be_read_ends_the_pass_in_order(root: str, caplog) -> None:
    groups = write_shards(root, 2, groups_per_shard=2, seed=7)
    reader = ShardReader(root, "run")
    first, second = reader.new_shards()
    ghost = dataclasses.replace(first, path=first.path + ".gone", url=first.url + ".gone")
    with caplog.at_level(logging.INFO, logger="storage"):
        assert list(reader._read_ahead([ghost, second])) == []  # not `second` before `ghost`
    assert "listed but not readable (1 tries)" in caplog.text and ghost.url in caplog.text
    assert list(reader.groups()) == groups  # the next pass takes both, in order


def test_a_shard_written_after_its_partition_was_listed_is_read(root: str) -> None:
    """The trainer lists the run once when it starts (check_run_tokenizer); a shard written to the
    same partition afterwards must still be read. On S3, s3fs answered a read of it from that old
    listing (FileNotFoundError, no request), so the reader waited out the grace period and then
    passed it as never written: its groups were lost and the loop stalled (test_secrets, CI)."""
    from storage.layout import rollouts_url
    from storage.shard_file import find_shards

    groups = write_shards(root, 1, seed=10)
    assert len(find_shards(rollouts_url(root, "run"))[1]) == 1  # the partition is listed now
    later = make_groups(3, seed=11)
    # Another process's writer: its own filesystem instance, so this process's cache hears nothing.
    with ShardWriter(root, "run", tokenizer="tok", storage_options={"skip_instance_cache": True}) as writer:
        writer.add_many(later)
    reader = ShardReader(root, "run", grace_s=0.0)  # a shard it cannot read would be passed at once
    assert list(reader.groups()) == groups + later


def test_stream_follows_new_shards_until_idle(root: str) -> None:
    groups = write_shards(root, 2)
    reader = ShardReader(root, "run")
    # Idle for 2 s ends it: writing the later shard took over 0.2 s on a loaded CI machine.
    stream = reader.stream(poll_s=0.01, idle_timeout_s=2.0)
    seen = [next(stream) for _ in range(len(groups))]
    later = write_shards(root, 1, seed=9)
    seen += list(stream)
    assert seen == groups + later


def test_tokenizer_mismatch_is_an_error(root: str) -> None:
    write_shards(root, 1)
    with pytest.raises(TokenizerMismatchError, match="'tok' but this reader expects 'other'"):
        list(ShardReader(root, "run", tokenizer="other").groups())


def test_ledger_format_errors() -> None:
    assert Ledger.from_dict({}) == Ledger()  # nothing saved yet
    with pytest.raises(ValueError, match="ledger format"):
        Ledger.from_dict({"consumed": []})
    with pytest.raises(ValueError, match="both consumed and partial"):
        Ledger.from_dict({"format": 2, "watermark": "", "consumed": ["a"], "partial": {"a": 1}})
