"""The soak's graded groups (soak.graded): scored by the real graders as planned, a hang never scored."""

from __future__ import annotations

import pytest

from environments.base import Item
from environments.failures import InfraError
from soak.checks import misscored
from soak.graded import Graded, JudgeServer, planned


def planned_scores(grader: str, size: int = 4):
    return lambda item_id: [score for _, score in planned(item_id, size, grader)]


async def test_the_judge_scores_as_planned_and_a_hanging_judge_fails_the_group_as_infra(
    tiny_tokenizer, monkeypatch
) -> None:
    monkeypatch.setattr("environments.failures.INFRA_FIRST_WAIT_S", 0.05)
    judge = JudgeServer()
    try:
        env = Graded(
            {"grader": "judge", "judge_url": judge.url, "judge_timeout_s": 0.3}, client=None, tokenizer=tiny_tokenizer
        )
        await env.setup()
        item = Item(id="7-1", prompt="hi")
        group = await env.collect_trajectories(item)
        assert misscored([(item.id, group.scores)], planned_scores("judge")) == []
        assert len(set(group.scores)) > 1 and judge.requests == 4
        judge.hang(5.0)
        with pytest.raises(InfraError, match="could not be reached"):
            await env.collect_trajectories(item)
        assert judge.held >= 4
    finally:
        judge.stop()


async def test_the_sandbox_scores_the_correct_program_1_and_the_endless_loop_0(tiny_tokenizer) -> None:
    env = Graded({"grader": "sandbox", "group_size": 3}, client=None, tokenizer=tiny_tokenizer)
    await env.setup()
    item = Item(id="3-2", prompt="hi")
    group = await env.collect_trajectories(item)
    assert group.scores[:2] == [1.0, 0.0]
    assert misscored([(item.id, group.scores)], planned_scores("sandbox", 3)) == []


def test_a_score_other_than_planned_is_named() -> None:
    """What the soak counts as an infra failure scored as a reward: a correct answer scored 0."""
    right = planned_scores("sandbox")("5-9")
    assert misscored([("5-9", right)], planned_scores("sandbox")) == []
    assert misscored([("5-9", [0.0, *right[1:]])], planned_scores("sandbox")) == ["5-9 member 0: scored 0, must be 1"]
