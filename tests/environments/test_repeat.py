"""The generation-bound task of the peer bench: a row of digits to repeat, graded by position."""

from __future__ import annotations

import asyncio

import pytest

from environments.bundled.repeat import Repeat
from environments.testing import EnvironmentConformance


def test_the_reward_is_the_share_of_positions_the_answer_gets_right(tiny_model_dir) -> None:
    env = Repeat({"seed": 3, "digits": 4}, client=None, tokenizer=str(tiny_model_dir))
    asyncio.run(env.setup())
    item = asyncio.run(env.get_item())
    row = item.answer
    assert item.prompt[0]["content"] == f"Repeat these digits: {' '.join(row)}" and len(row) == 4
    said = lambda text: [*item.prompt, {"role": "assistant", "content": text}]  # noqa: E731
    assert env.reward(item, said(env.gold_completion(item))) == 1.0
    assert env.reward(item, said(row + "99999")) == 1.0  # digits past the row cost nothing
    wrong_last = row[:3] + str((int(row[3]) + 1) % 10)
    assert env.reward(item, said(f"sure: {', '.join(wrong_last)}")) == 0.75  # other characters are skipped
    assert env.reward(item, said(row[1:])) == sum(a == b for a, b in zip(row[1:], row)) / 4  # a shift is wrong
    assert env.reward(item, said("no digits ²")) == 0.0
    again = Repeat({"seed": 3, "digits": 4}, client=None, tokenizer=str(tiny_model_dir))
    asyncio.run(again.setup())
    assert asyncio.run(again.get_item()).answer == row  # seeded


@pytest.mark.integration
class TestRepeatConformance(EnvironmentConformance):
    environment_class = Repeat
    config = {"group_size": 3, "max_tokens": 8, "digits": 6}
