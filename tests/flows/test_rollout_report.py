"""Flow logic without a server: progress-artifact ordering, parameter checks (the real Prefect API is in test_rollout_flow)."""

import asyncio
import random

import pytest

import flows.rollout_report as report
from flows.rollout import TaskRunSizer, check_batching


async def test_concurrent_updates_never_leave_the_bar_behind(monkeypatch):
    sent: list[float] = []

    async def slow_update(artifact_id, progress, description):
        await asyncio.sleep(random.Random(progress).uniform(0, 0.01))  # API calls finish out of order
        sent.append(progress)

    monkeypatch.setattr(report, "update_progress_artifact", slow_update)
    progress = report.Progress("artifact", total=6)
    await asyncio.gather(*(progress.update(done) for done in range(1, 7)))
    await progress.close()
    assert sent[-1] == 100.0
    assert sent == sorted(sent), "an older count landed after a newer one"


async def test_throttled_updates_are_flushed_on_close(monkeypatch):
    sent: list[float] = []

    async def update(artifact_id, progress, description):
        sent.append(progress)

    monkeypatch.setattr(report, "update_progress_artifact", update)
    progress = report.Progress("artifact", total=None)  # runs until cancelled: percent stays 0
    for done in range(1, 50):
        await progress.update(done)
    assert len(sent) == 1  # once every PROGRESS_INTERVAL_S at most
    await progress.close()
    assert len(sent) == 2 and progress._sent == 49


def test_groups_per_task_is_checked_against_the_concurrency_it_must_fit():
    check_batching(4, 8, None)
    check_batching(4, 8, 4)
    with pytest.raises(ValueError, match="groups_per_task=0"):
        check_batching(0, 8, None)
    with pytest.raises(ValueError, match="use 1..max_concurrent_groups"):
        check_batching(9, 8, None)
    with pytest.raises(ValueError, match="exceeds server_concurrency=2"):
        check_batching(4, 8, 2)
    check_batching(None, 8, 2)  # auto: sized within the limits
    with pytest.raises(ValueError, match="server_concurrency=0"):
        check_batching(None, 8, 0)


def test_auto_task_runs_cover_about_ten_seconds_of_sampling():
    # Task runs that hold their slots (or a Dask worker) whole start with one group each.
    held = TaskRunSizer(None, max_concurrent_groups=8)
    assert held.size() == 1
    sizer = TaskRunSizer(None, max_concurrent_groups=8, per_group_slots=True)
    assert sizer.size() == 8  # nothing timed yet: the first wave in one task run
    for _ in range(20):
        sizer.observe(1.6)  # 128-token groups on a 2-core CPU host
    assert sizer.size() == 7  # ceil(10 / 1.6)
    for _ in range(20):
        sizer.observe(2.2)
    assert sizer.size() == 5
    for _ in range(20):
        sizer.observe(16.0)  # long samples: Prefect's cost is already small against them
    assert sizer.size() == 1
    for _ in range(20):
        sizer.observe(0.05)
    assert sizer.size() == 8  # capped at the groups in flight: each group frees its own slot
    for _ in range(20):
        held.observe(0.05)
    assert held.size() == 4  # at most half: task runs that hold their slots keep overlapping
    assert TaskRunSizer(None, max_concurrent_groups=8, server_concurrency=2).cap == 2
    assert TaskRunSizer(None, max_concurrent_groups=8, server_concurrency=2, per_group_slots=True).cap == 2
    assert TaskRunSizer(None, max_concurrent_groups=1).cap == 1


def test_a_fixed_size_ignores_timings():
    sizer = TaskRunSizer(3, max_concurrent_groups=8)
    sizer.observe(0.01)
    assert sizer.size() == 3
