"""Flow logic without a server: progress-artifact ordering, parameter checks (the real Prefect API is in test_rollout_flow)."""

import asyncio
import random

import pytest

import flows.rollout_report as report
from flows.rollout import WeightedItems, checked_specs


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
    sent: list[str] = []

    async def update(artifact_id, data):
        sent.append(data)

    monkeypatch.setattr(report, "update_artifact_data", update)
    progress = report.Progress("artifact", total=None)  # runs until cancelled: a count, no percent
    for done in range(1, 50):
        await progress.update(done)
    assert len(sent) == 1  # once every PROGRESS_INTERVAL_S at most
    await progress.close()
    assert len(sent) == 2 and progress._sent == 49
    assert sent[-1] == "**49 groups done**, open-ended: runs until cancelled"


def test_limits_are_checked_naming_the_parameter():
    specs = [{"import_path": "arithmetic"}]
    assert [spec.import_path for spec in checked_specs(specs, ["http://s"], 8, None, 10.0)] == ["arithmetic"]
    checked_specs(specs, ["http://s"], 8, 4, 0.0)
    with pytest.raises(ValueError, match="server_concurrency=0"):
        checked_specs(specs, ["http://s"], 8, 0, 10.0)
    with pytest.raises(ValueError, match="max_concurrent_groups=0"):
        checked_specs(specs, ["http://s"], 0, None, 10.0)
    with pytest.raises(ValueError, match="task_run_s=-1"):
        checked_specs(specs, ["http://s"], 8, None, -1)
    with pytest.raises(ValueError, match="at least one environment and one server URL"):
        checked_specs(specs, [], 8, None, 10.0)


class Finite:
    """An item source with `left` items, then None."""

    def __init__(self, name: str, left: int):
        self.name, self.left, self.count = name, left, 0

    async def get_item(self):
        if self.count == self.left:
            return None
        self.count += 1
        await asyncio.sleep(0)  # a real get_item may await: lanes must not get the same item twice
        return type("Item", (), {"id": f"{self.name}-{self.count}"})()


class Spec:
    def __init__(self, key: str, weight: float):
        self.key, self.weight = key, weight


async def drain(stream: WeightedItems, lanes: int = 4) -> list[tuple[str, str]]:
    taken = []

    async def lane():
        while (next_ := await stream.next()) is not None:
            taken.append((next_[0].key, next_[1].id))

    await asyncio.gather(*(lane() for _ in range(lanes)))
    return taken


async def test_the_item_stream_hands_out_exactly_the_groups_asked_for_mixed_by_weight():
    specs = [Spec("a", 3.0), Spec("b", 1.0)]
    stream = WeightedItems(specs, {"a": Finite("a", 10**6), "b": Finite("b", 10**6)}, groups=400, seed=0)
    taken = await drain(stream)
    assert len(taken) == 400 and len(set(taken)) == 400 and stream.exhausted
    share_a = sum(key == "a" for key, _ in taken) / 400
    assert 0.65 < share_a < 0.85, share_a  # weight 3:1


async def test_the_item_stream_ends_when_every_environment_ran_out():
    stream = WeightedItems(
        [Spec("a", 1.0), Spec("b", 1.0)], {"a": Finite("a", 2), "b": Finite("b", 5)}, groups=None, seed=0
    )
    assert sorted(i for _, i in await drain(stream)) == ["a-1", "a-2", "b-1", "b-2", "b-3", "b-4", "b-5"]


async def test_the_item_stream_admits_every_item_and_gives_back_the_place_of_none():
    class Counting:
        acquired = given_back = 0

        async def acquire(self):
            Counting.acquired += 1
            await asyncio.sleep(0.01)
            return True

        def finished(self, stored):
            assert not stored
            Counting.given_back += 1

    stream = WeightedItems([Spec("a", 1.0)], {"a": Finite("a", 10)}, groups=None, seed=0, admission=Counting())
    assert len(await drain(stream, lanes=3)) == 10
    # One admission per item, and one for the call that found none left, given back.
    assert (Counting.acquired, Counting.given_back) == (11, 1)


async def test_environment_metrics_are_columns_of_the_stats_table(monkeypatch):
    tables = []

    class Card:
        async def show(self, table, force=False):
            tables.append(table)

    async def markdown(**_):
        pass

    monkeypatch.setattr(report, "stats_card", lambda run: Card())
    monkeypatch.setattr(report, "create_markdown_artifact", markdown)
    leveled = report.RolloutStats(env="reasoning_gym", metrics={"curriculum level": 2.0, "groups": -1.0})
    plain = report.RolloutStats(env="arithmetic")
    assert leveled.row()["curriculum level"] == 2.0 and leveled.row()["groups"] == 0  # a stat's own column wins
    summary = await report.publish_report({"a": leveled, "b": plain}, [], 1.0, "run", "memory://x")
    assert tables == [summary["environments"]]
    assert [list(row) for row in tables[0]] == [list(leveled.row())] * 2  # every row has every column
    assert tables[0][1]["curriculum level"] is None
