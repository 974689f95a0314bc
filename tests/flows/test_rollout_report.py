"""The progress artifact's update ordering (logic only; the real Prefect API is in test_rollout_flow)."""

import asyncio
import random

import flows.rollout_report as report


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
