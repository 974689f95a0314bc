"""Flow logic without a server: progress-artifact ordering, parameter checks (the real Prefect API is in test_rollout_flow)."""

import asyncio
import random

import pytest

import flows.rollout_report as report
from flows.rollout import check_batching


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
    assert len(sent) == 1  # once a second at most
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
