"""The shard index and the watermark ledger: exactly once across restarts, late arrivals, partly
consumed shards, old ledgers and old runs, a bounded ledger, and listings from the watermark on."""

from __future__ import annotations

import time

import fsspec
import pytest

import storage.index as index_module
from clotho.testing.groups import make_groups
from storage.index import IndexEntry, add_entry, check_clock, id_at, list_entries
from storage.layout import ShardLocation, new_shard_id
from storage.ledger import Ledger
from storage.reader import ShardReader
from storage.schema import groups_to_table
from storage.shard_file import write_shard
from storage.writer import ShardWriter


def write(root: str, count: int, per_shard: int = 2, seed: int = 0) -> list:
    groups = make_groups(count * per_shard, seed=seed)
    with ShardWriter(root, "run", tokenizer="tok", max_groups=per_shard) as writer:
        for start in range(0, len(groups), per_shard):
            writer.add_many(groups[start : start + per_shard])
    return groups


def write_late(root: str, shard_id: str, seed: int) -> list:
    """A shard published now under an id stamped earlier: a slow upload or a lagging clock."""
    groups = make_groups(2, seed=seed)
    fs, run_path = fsspec.core.url_to_fs(f"{root}/run")
    location = ShardLocation("gsm8k", 0, shard_id)
    add_entry(fs, run_path, location)
    write_shard(fs, f"{run_path}/rollouts/{location.name}", groups_to_table(groups, "tok"), f"{run_path}/_tmp")
    return groups


def test_late_arrival_behind_the_watermark_and_a_partial_shard_are_consumed_once(root: str) -> None:
    early = write(root, 2, seed=1)
    between = new_shard_id()  # stamped now, published after the next shards
    later = write(root, 2, seed=2)
    reader = ShardReader(root, "run")
    stream = reader.groups()
    taken = [next(stream) for _ in range(5)]  # the third shard is part-way through
    stream.close()
    saved = reader.ledger.to_json()
    late = write_late(root, between, seed=3)  # its id sorts before the shards already consumed

    resumed = ShardReader(root, "run", ledger=Ledger.from_json(saved))
    taken += list(resumed.groups())
    assert sorted(g.group_id for g in taken) == sorted(g.group_id for g in early + later + late)
    assert len(taken) == len({g.group_id for g in taken})  # none twice
    again = ShardReader(root, "run", ledger=Ledger.from_json(resumed.ledger.to_json()))
    assert list(again.groups()) == []


def test_the_ledger_is_a_watermark_bounded_by_what_is_in_flight(root: str) -> None:
    write(root, 30, per_shard=1)
    reader = ShardReader(root, "run", grace_s=0.0)  # no late arrivals allowed: nothing kept apart
    assert len(list(reader.groups())) == 30
    reader.new_shards()  # the next poll moves the watermark past them
    ledger = reader.ledger.to_dict()
    assert ledger["consumed"] == [] and ledger["partial"] == {}
    assert ledger["watermark"] > max(e.shard_id for e in list_entries(*fsspec.core.url_to_fs(f"{root}/run")))
    with_grace = ShardReader(root, "run")  # within the grace the ids stay listed: 30 of them
    list(with_grace.groups())
    with_grace.new_shards()
    assert len(with_grace.ledger.consumed) == 30 and len(with_grace.ledger.to_json()) < 2000


def test_an_entry_whose_shard_never_came_holds_the_pass_then_is_passed(root: str, monkeypatch) -> None:
    first = write(root, 1, seed=5)
    fs, run_path = fsspec.core.url_to_fs(f"{root}/run")
    add_entry(fs, run_path, ShardLocation("gsm8k", 0, new_shard_id()))  # its writer died here
    later = write(root, 1, seed=6)
    reader = ShardReader(root, "run")
    assert list(reader.groups()) == first  # in order: the missing one may still be on its way
    monkeypatch.setattr(time, "time", lambda real=time.time: real() + 2 * reader.grace_s)
    assert list(reader.groups()) == later


def test_listing_starts_at_the_watermark_bucket(root: str) -> None:
    fs, run_path = fsspec.core.url_to_fs(f"{root}/run")
    day = 1_780_000_000.0
    ids = [id_at(day + hours * 3600 + minutes * 60) + "-000000000000" for hours in range(5) for minutes in (0, 30)]
    for shard_id in ids:
        add_entry(fs, run_path, ShardLocation("gsm8k", 0, shard_id))
    assert [e.shard_id for e in list_entries(fs, run_path)] == ids
    assert [e.shard_id for e in list_entries(fs, run_path, after=ids[7])] == ids[7:]
    listed: list[str] = []
    real = index_module._children
    index_module._children = lambda fs, path, pattern=None: listed.append(path) or real(fs, path, pattern)
    try:
        list_entries(fs, run_path, after=ids[7])
    finally:
        index_module._children = real
    # The hours, then the 2 hours from ids[7]'s on, then their 3 minutes from ids[7]'s on (of 10).
    assert len(listed) == 1 + 2 + 3
    assert IndexEntry.parse("junk") is None and IndexEntry.parse(IndexEntry.of(ShardLocation("a", 3, ids[0])).file_name)


def test_a_writer_with_a_clock_far_off_the_storage_is_refused(tmp_path, monkeypatch) -> None:
    fs = fsspec.filesystem("file")
    assert abs(check_clock(fs, str(tmp_path))) < 1.0
    monkeypatch.setattr(time, "time", lambda real=time.time: real() + 600)
    with pytest.raises(RuntimeError, match=r"clock is \+600 s off the storage's.*synchronize the clock"):
        ShardWriter(f"file://{tmp_path}", "run", tokenizer="tok")


def test_a_stopped_writer_s_entry_with_no_shard_is_dropped_and_the_run_reads_whole_at_once(root: str) -> None:
    """A writer killed between a shard's entry and the shard: readers stop at that entry until the
    grace period passes. Where the run's one writer is known to have stopped (a reprocess job run
    again), drop_unpublished removes such entries at once and nothing else."""
    from storage.index import drop_unpublished

    first = write(root, 2, seed=1)
    fs, run_path = fsspec.core.url_to_fs(f"{root}/run")
    dead = ShardLocation("gsm8k", 0, new_shard_id())
    add_entry(fs, run_path, dead)  # its shard never written
    later = write(root, 1, seed=2)
    assert len(list(ShardReader(root, "run").groups())) == len(first)  # the pass ends at the dead entry
    assert drop_unpublished(fs, run_path, f"{root}/run/rollouts") == [IndexEntry.of(dead)]
    assert sorted(g.group_id for g in ShardReader(root, "run").groups()) == sorted(g.group_id for g in first + later)
    assert drop_unpublished(fs, run_path, f"{root}/run/rollouts") == [] and len(list_entries(fs, run_path)) == 3
