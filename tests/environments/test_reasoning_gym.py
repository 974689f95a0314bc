"""The reasoning-gym environment: the answer tag scored by each dataset's own scorer, items that
survive JSON, a curriculum that follows the reward, and the conformance suite against the live server."""

from __future__ import annotations

import asyncio
import json

import pytest
import reasoning_gym

from environments.bundled.reasoning_gym import CHUNK, ReasoningGym, ReasoningGymItem, from_json, to_json
from environments.loading import EnvironmentLoadError, load_config
from environments.testing import EnvironmentConformance


def environment(tiny_model_dir, **config) -> ReasoningGym:
    env = ReasoningGym(config, client=None, tokenizer=str(tiny_model_dir))
    asyncio.run(env.setup())
    return env


def answered(env: ReasoningGym, item: ReasoningGymItem, text: str) -> float:
    return env.reward(item, item.prompt + [{"role": "assistant", "content": text}])


def stored(item: ReasoningGymItem) -> ReasoningGymItem:
    """The item as a shard keeps it and reprocessing rebuilds it."""
    return ReasoningGymItem.model_validate(json.loads(item.model_dump_json()))


@pytest.mark.parametrize(
    "dataset, partial",
    [("basic_arithmetic", "{answer}.0"), ("chain_sum", "x {answer}"), ("leg_counting", "{answer} legs")],
)
def test_the_answer_tag_is_scored_by_the_datasets_own_scorer(tiny_model_dir, dataset, partial) -> None:
    env = environment(tiny_model_dir, dataset=dataset, seed=5)
    item = stored(asyncio.run(env.get_item()))
    entry = from_json(item.entry)
    assert item.answer == entry["answer"] and entry["question"] in item.prompt[-1]["content"]
    assert "<answer>" in item.prompt[0]["content"]  # the prompt asks for the tag
    scorer = reasoning_gym.create_dataset(dataset, size=1, seed=0)
    assert answered(env, item, f"Thinking... {env.gold_completion(item)}") == 1.0
    assert answered(env, item, "<answer>no idea</answer>") == 0.0
    assert answered(env, item, str(item.answer)) == 0.0  # the right answer, but no tag
    # Partial credit where the dataset gives it: the score is score_answer's, not an exact match.
    text = partial.format(answer=item.answer)
    assert answered(env, item, f"<answer>{text}</answer>") == scorer.score_answer(text, entry)
    assert 0.0 < scorer.score_answer(text, entry) < 1.0


def test_entries_keep_their_types_through_json(tiny_model_dir) -> None:
    entry = {"grid": ((1, 2), (3, 4)), "by_number": {1: [("a", None)]}, "plain": {"x": [1.5, True]}}
    assert from_json(json.loads(json.dumps(to_json(entry)))) == entry
    # ARC compares the parsed answer with the entry's tuple-of-tuples grid: plain JSON would break it.
    env = environment(tiny_model_dir, dataset="arc_agi", curriculum=False)
    item = stored(asyncio.run(env.get_item()))
    assert answered(env, item, env.gold_completion(item)) == 1.0


def test_unknown_names_and_bad_settings_are_refused_naming_the_fix() -> None:
    with pytest.raises(EnvironmentLoadError, match="no dataset 'basic_arithmatic'; e.g. basic_arithmetic"):
        load_config(ReasoningGym, {"dataset": "basic_arithmatic"})
    with pytest.raises(EnvironmentLoadError, match="no dataset 'sudokus'.*sudoku"):
        load_config(ReasoningGym, {"dataset": "sudokus"})
    with pytest.raises(EnvironmentLoadError, match=r"sets \['min_terms'\], which the curriculum controls"):
        load_config(ReasoningGym, {"dataset": "chain_sum", "dataset_kwargs": {"min_terms": 3}})
    with pytest.raises(EnvironmentLoadError, match="unexpected keyword argument 'colour'"):
        load_config(ReasoningGym, {"dataset": "chain_sum", "dataset_kwargs": {"colour": 3}})
    with pytest.raises(EnvironmentLoadError, match="has no reasoning-gym curriculum; set curriculum: false"):
        load_config(ReasoningGym, {"dataset": "gsm_symbolic"})
    with pytest.raises(EnvironmentLoadError, match="lower_below 0.5 must be below raise_above 0.5"):
        load_config(ReasoningGym, {"lower_below": 0.5, "raise_above": 0.5})


def test_the_level_rises_after_high_rewards_and_falls_after_low_ones(tiny_model_dir) -> None:
    env = environment(tiny_model_dir, dataset="basic_arithmetic", window=3, raise_above=0.75, lower_below=0.25)

    def most_terms(item: ReasoningGymItem) -> int:  # the upper bound of the level's num_terms range
        return from_json(item.entry)["metadata"]["difficulty"]["num_terms"][1]

    easy = asyncio.run(env.get_item())
    assert (easy.level, most_terms(easy)) == (0, 2)
    for _ in range(2):
        env.record(0, [1.0, 1.0, 0.0, 1.0])
    assert env.metrics()["curriculum level"] == 0.0  # the window is not full yet
    env.record(0, [1.0, 1.0, 1.0, 1.0])
    assert env.metrics() == {"curriculum level": 1.0, "level mean reward": 0.0}
    for _ in range(3):
        env.record(1, [1.0] * 4)
    env.record(0, [0.0] * 4)  # a group drawn before the change does not count against level 2
    harder = asyncio.run(env.get_item())
    assert (harder.level, most_terms(harder)) == (2, 4)
    assert answered(env, stored(harder), env.gold_completion(harder)) == 1.0

    for _ in range(3):
        env.record(2, [0.0, 0.0, 0.0, 0.5])
    assert env.metrics()["curriculum level"] == 1.0
    assert asyncio.run(env.get_item()).level == 1
    for _ in range(6):  # middling rewards: the level holds
        env.record(1, [0.5] * 4)
    assert env.metrics() == {"curriculum level": 1.0, "level mean reward": 0.5}


def test_the_curriculum_stops_below_a_level_reasoning_gym_cannot_build(tiny_model_dir) -> None:
    env = environment(tiny_model_dir, dataset="caesar_cipher", window=1)  # its level 2 overshoots rotation's limit
    for _ in range(5):
        env.record(env.curriculum.level, [1.0])
    assert (env.curriculum.level, env.curriculum.top) == (1, 1)


def test_without_the_curriculum_the_dataset_kwargs_set_the_difficulty(tiny_model_dir) -> None:
    env = environment(
        tiny_model_dir, dataset="chain_sum", curriculum=False, window=1, dataset_kwargs={"min_terms": 5, "max_terms": 5}
    )
    env.record(0, [1.0])
    items = [env.new_item(env.rng, index) for index in range(CHUNK - 1, CHUNK + 2)]  # into the next chunk
    assert {item.level for item in items} == {0} and len({item.id for item in items}) == 3
    assert all(from_json(item.entry)["metadata"]["num_terms"] == 5 for item in items)
    assert len({item.prompt[-1]["content"] for item in items}) == 3


@pytest.mark.integration
class TestBasicArithmeticConformance(EnvironmentConformance):
    environment_class = ReasoningGym
    config = {"dataset": "basic_arithmetic", "group_size": 3, "max_tokens": 8}


@pytest.mark.integration
class TestLegCountingConformance(EnvironmentConformance):
    environment_class = ReasoningGym
    config = {"dataset": "leg_counting", "group_size": 2, "max_tokens": 8}
