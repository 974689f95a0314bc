"""The trainer's input: whole groups in shard order, stale ones skipped and counted, a clear timeout;
and its per-step metrics files."""

from __future__ import annotations

import threading
import time

import pytest

from core.scored_group import ScoredGroup, ScoredSequence
from storage.ledger import Ledger
from storage.reader import ShardReader
from tests.trainer.rollouts import write_shards
from trainer.data import DataTimeoutError, is_stale, next_step_groups
from trainer.metrics import MetricsLog, read_metrics


def group(item: int, version: int) -> ScoredGroup:
    sequences = [ScoredSequence.from_prompt([1, 2], [3, 4], [-0.5, -0.5], float(i)) for i in range(2)]
    return ScoredGroup(env="toy", item_id=str(item), sequences=sequences, policy_version=version)


def test_stale_means_more_than_max_staleness_versions_behind():
    assert not is_stale(4, policy_version=5, max_lag=1)
    assert is_stale(3, policy_version=5, max_lag=1)
    assert not is_stale(5, policy_version=5, max_lag=0)
    assert is_stale(4, policy_version=5, max_lag=0)


def test_stale_groups_are_consumed_counted_and_skipped(tmp_path):
    root = str(tmp_path)
    # Three groups a flush, one shard per policy version: 0 0 0 | 0 | 2 2 | 2 2 2.
    versions = [0, 0, 0, 0, 2, 2, 2, 2, 2]
    write_shards(root, "run", [group(i, v) for i, v in enumerate(versions)], groups_per_shard=3)
    reader = ShardReader(root, "run")

    groups, stale = next_step_groups(reader, 2, policy_version=1, max_lag=1, timeout_s=1)
    assert [g.item_id for g in groups] == ["0", "1"] and stale == []
    # At version 3, version-0 groups are 3 behind (> 1): items 2 and 3 are skipped.
    groups, stale = next_step_groups(reader, 3, policy_version=3, max_lag=1, timeout_s=1)
    assert [g.item_id for g in groups] == ["4", "5", "6"] and [g.item_id for g in stale] == ["2", "3"]

    # The ledger holds exactly what was handed out: three shards done, one group of the last.
    ledger = Ledger.from_json(reader.ledger.to_json())
    assert len(ledger.consumed) == 3 and list(ledger.partial.values()) == [1]
    resumed = ShardReader(root, "run", ledger=ledger)
    groups, _ = next_step_groups(resumed, 2, policy_version=3, max_lag=1, timeout_s=1)
    assert [g.item_id for g in groups] == ["7", "8"]


def test_missing_groups_time_out_with_the_fix(tmp_path):
    root = str(tmp_path)
    write_shards(root, "run", [group(0, 0)], groups_per_shard=1)
    started = time.monotonic()
    with pytest.raises(DataTimeoutError, match=r"1 of 2 groups .* are rollouts being written"):
        next_step_groups(ShardReader(root, "run"), 2, policy_version=0, max_lag=0, timeout_s=0.3, poll_s=0.05)
    assert time.monotonic() - started < 5


def test_groups_that_arrive_during_a_wait_are_taken_at_once_not_at_the_next_slow_poll(tmp_path):
    """The wait polls soon, then less often: groups written 0.1 s in are read well before the
    slowest poll interval (3 s here) would have come round."""
    root = str(tmp_path)
    write_shards(root, "run", [group(0, 0)], groups_per_shard=1)
    writer = threading.Timer(0.1, write_shards, (root, "run", [group(1, 0)]), {"groups_per_shard": 1})
    writer.start()
    started = time.monotonic()
    groups, _ = next_step_groups(ShardReader(root, "run"), 2, policy_version=0, max_lag=0, timeout_s=30, poll_s=3.0)
    waited = time.monotonic() - started
    writer.join()
    assert [g.item_id for g in groups] == ["0", "1"]
    assert waited < 1.5, waited  # a fixed 3 s poll: >= 3 s


def test_metrics_go_to_jsonl_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLog(tmp_path)
    log.write(1, {"loss": 0.5, "score_mean": 0.25})
    log.write(2, {"loss": 0.25, "score_mean": 0.5})
    log.close()
    rows = read_metrics(tmp_path)
    assert rows == [
        {"step": 1, "loss": 0.5, "score_mean": 0.25, "time": rows[0]["time"]},
        {"step": 2, "loss": 0.25, "score_mean": 0.5, "time": rows[1]["time"]},
    ]
    assert time.time() - 60 < rows[0]["time"] <= rows[1]["time"] <= time.time()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 0.5), (2, 0.25)]
