"""The compare task's held-out split: evaluation problems are never handed out for training (RL
items or SFT demonstrations), whatever the seeds, and evaluate answers exactly those problems."""

from __future__ import annotations

import pytest

from environments.bundled.compare import Compare, split_pairs
from environments.bundled.sft import SFT


def test_the_split_keeps_both_orders_of_a_pair_on_one_side_and_is_the_same_every_time():
    training, held_out = split_pairs(9, 0.3)
    assert len(training) + len(held_out) == 90 and len(held_out) == 28
    assert not set(training) & set(held_out)
    assert all((b, a) in held_out for a, b in held_out) and all((b, a) in training for a, b in training)
    assert split_pairs(9, 0.3) == (training, held_out)
    assert split_pairs(9, 0.0) == (sorted(training + held_out), [])
    assert len(split_pairs(1, 0.3)[0]) == 2 and split_pairs(1, 0.3)[1] == []  # one pair: it is trained on
    assert len(split_pairs(2, 0.01)[1]) == 2  # above 0: at least one pair


@pytest.mark.parametrize("config", [{"seed": 0}, {"seed": 7, "which": "smaller"}, {"seed": 5, "pool": 8}])
async def test_training_items_never_come_from_the_held_out_problems(config, tiny_model_dir):
    _, held_out = split_pairs(9, 0.3)
    env = Compare(config, client=None, tokenizer=str(tiny_model_dir))
    await env.setup()
    pairs = {tuple((await env.get_item()).extras["pair"]) for _ in range(500)}
    assert not pairs & set(held_out)
    assert len(pairs) == (8 if "pool" in config else 62)  # every training problem comes up


async def test_sft_demonstrations_of_compare_are_training_problems(tiny_model_dir):
    _, held_out = split_pairs(9, 0.3)
    sft = SFT(
        {"env": "compare", "env_config": {"max_value": 9, "pool": 8, "seed": 5}},
        client=None,
        tokenizer=str(tiny_model_dir),
    )
    await sft.setup()
    items = [await sft.get_item() for _ in range(40)]
    assert not {tuple(item.extras["pair"]) for item in items} & set(held_out)
    assert len({item.answer for item in items}) == 8  # eight demonstrations, eight different answers


async def test_evaluation_answers_each_held_out_problem_once(tiny_model_dir):
    _, held_out = split_pairs(9, 0.3)
    twin = Compare({"seed": 1_000_003, "cycle": False}, client=None, tokenizer=str(tiny_model_dir))
    await twin.setup()
    asked = []
    while (item := await twin.get_eval_item()) is not None:
        asked.append(tuple(item.extras["pair"]))
    assert sorted(asked) == held_out
