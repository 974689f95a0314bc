"""Flow logic without a server: progress-artifact ordering, parameter checks (the real Prefect API is in test_rollout_flow)."""

import asyncio
import random

import pytest

import flows.rollout_report as report
from flows.rollout import check_limits, item_batches


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
    check_limits(4, 8, None)
    check_limits(4, 8, 4)
    with pytest.raises(ValueError, match="groups_per_task=0"):
        check_limits(0, 8, None)
    with pytest.raises(ValueError, match="use 1..max_concurrent_groups"):
        check_limits(9, 8, None)
    with pytest.raises(ValueError, match="exceeds server_concurrency=2"):
        check_limits(4, 8, 2)
    with pytest.raises(ValueError, match="server_concurrency=0"):
        check_limits(1, 8, 0)
    with pytest.raises(ValueError, match="max_concurrent_groups=0"):
        check_limits(1, 0, None)


class Finite:
    """An item source with `left` items, then None."""

    def __init__(self, name: str, left: int):
        self.name, self.left, self.count = name, left, 0

    async def get_item(self):
        if self.count == self.left:
            return None
        self.count += 1
        return type("Item", (), {"id": f"{self.name}-{self.count}"})()


class Spec:
    def __init__(self, key: str, weight: float):
        self.key, self.weight = key, weight


async def batches(specs, sources, groups, per_task, seed=0):
    return [(spec.key, [item.id for item in items]) async for spec, items in item_batches(specs, sources, groups, per_task, seed)]


async def test_item_batches_hand_out_exactly_the_groups_asked_for_mixed_by_weight():
    specs = [Spec("a", 3.0), Spec("b", 1.0)]
    sources = {"a": Finite("a", 10**6), "b": Finite("b", 10**6)}
    handed = await batches(specs, sources, groups=400, per_task=3)
    assert sum(len(ids) for _, ids in handed) == 400
    assert all(len(ids) == 3 for _, ids in handed[:-1]) and len(handed[-1][1]) == 400 - 3 * (len(handed) - 1)
    share_a = sum(len(ids) for key, ids in handed if key == "a") / 400
    assert 0.65 < share_a < 0.85, share_a  # weight 3:1
    all_ids = [i for _, ids in handed for i in ids]
    assert len(all_ids) == len(set(all_ids))


async def test_item_batches_stop_when_every_environment_ran_out():
    specs = [Spec("a", 1.0), Spec("b", 1.0)]
    handed = await batches(specs, {"a": Finite("a", 2), "b": Finite("b", 5)}, groups=None, per_task=2)
    assert sorted(i for _, ids in handed for i in ids) == ["a-1", "a-2", "b-1", "b-2", "b-3", "b-4", "b-5"]
