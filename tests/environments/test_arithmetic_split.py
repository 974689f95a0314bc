"""The arithmetic task's held-out split: a share of its problems (both orders of a pair with one
operator together) that training never sees, the same for every seed, each answered once by evaluate."""

from __future__ import annotations

import pytest

from environments.bundled.arithmetic import Arithmetic


async def problems(env: Arithmetic, count: int) -> set[tuple]:
    return {tuple((await env.get_item()).extras["problem"]) for _ in range(count)}


async def eval_problems(env: Arithmetic) -> list[tuple]:
    asked = []
    while (item := await env.get_eval_item()) is not None:
        asked.append(tuple(item.extras["problem"]))
    return asked


@pytest.mark.parametrize("seed", [0, 7])
async def test_training_never_meets_a_held_out_problem_and_evaluation_meets_each_once(seed, tiny_model_dir):
    config = {"max_operand": 9, "operations": "+*", "held_out": 0.3, "seed": seed, "cycle": False}
    env = Arithmetic(config, client=None, tokenizer=str(tiny_model_dir))
    await env.setup()
    held_out = await eval_problems(env)
    assert len(held_out) == len(set(held_out))
    assert 0.2 * 200 < len(held_out) < 0.4 * 200  # 2 operators x 100 ordered pairs
    assert all((b, op, a) in held_out for a, op, b in held_out)  # both orders on one side
    trained = await problems(env, 2000)
    assert not trained & set(held_out)
    assert len(trained) + len(held_out) == 200  # every other problem comes up in training
    twin = Arithmetic({**config, "seed": seed + 1}, client=None, tokenizer=str(tiny_model_dir))
    await twin.setup()
    other = await eval_problems(twin)
    assert sorted(other) == sorted(held_out) and other != held_out  # the same split, its own order


async def test_no_split_by_default_and_a_clear_error_when_nothing_is_left_to_train_on(tiny_model_dir):
    env = Arithmetic({"max_operand": 3}, client=None, tokenizer=str(tiny_model_dir))
    await env.setup()
    assert env.items("eval") is None
    greedy = Arithmetic(
        {"max_operand": 1, "operations": "+", "held_out": 0.99}, client=None, tokenizer=str(tiny_model_dir)
    )
    await greedy.setup()
    assert len(await eval_problems(greedy)) == 4  # 0+0, 0+1, 1+0, 1+1: all held out
    with pytest.raises(ValueError, match="held_out 0.99 leaves"):
        await greedy.get_item()
