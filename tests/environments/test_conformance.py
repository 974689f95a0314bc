"""The conformance suite can fail: each check against an environment that breaks exactly its rule;
and environments are checked when loaded, before anything samples."""

from __future__ import annotations

import asyncio
import random

import pytest

from environments.base import Environment, EnvironmentConfig
from environments.bundled.instant import Instant
from environments.conformance import run_checks
from environments.loading import EnvironmentLoadError, load_config, load_environment_class
from tasks.rollout import EnvSpec


class RandomScore(Instant):
    """Scores are not reward() of the conversation."""

    async def collect_trajectories(self, item):
        group = await super().collect_trajectories(item)
        group.sequences = [s.model_copy(update={"score": random.random()}) for s in group.sequences]
        return group


class RetokenizedText(Instant):
    """Stores an assistant message its tokens do not decode to."""

    async def collect_trajectories(self, item):
        group = await super().collect_trajectories(item)
        for sequence in group.sequences:
            sequence.messages = [*sequence.messages[:-1], {"role": "assistant", "content": "something else"}]
        return group


class WrongGold(Instant):
    def reward(self, item, messages):
        return 0.0 if messages[-1]["content"] == "42" else 1.0

    def gold_completion(self, item):
        return "42"


class Unnamed(Instant):
    name = "not a/partition"


@pytest.mark.integration
@pytest.mark.parametrize(
    ("environment", "failing"),
    [
        (Instant, set()),
        (RandomScore, {"scores are the reward", "evaluate is greedy"}),
        (RetokenizedText, {"tokens match messages"}),
        (WrongGold, {"gold answer scores top"}),
    ],
)
def test_each_check_fails_on_the_environment_that_breaks_it(policy_server, tiny_model_dir, environment, failing):
    results = asyncio.run(
        run_checks(environment, {"group_size": 2}, server_url=policy_server.base_url, tokenizer=str(tiny_model_dir))
    )
    assert {r.name for r in results if r.status == "failed"} == failing, [
        (r.name, r.detail) for r in results if r.status == "failed"
    ]


def test_environments_are_checked_when_loaded():
    with pytest.raises(EnvironmentLoadError, match="no installed environment has that name"):
        load_environment_class("no_such_env")
    with pytest.raises(EnvironmentLoadError, match="cannot import"):
        load_environment_class("no.such.module:Env")
    with pytest.raises(EnvironmentLoadError, match="not an Environment subclass"):
        load_environment_class("environments.base:EnvironmentConfig")
    with pytest.raises(EnvironmentLoadError, match="Environment does not implement"):
        load_environment_class("environments.base:Environment")
    with pytest.raises(EnvironmentLoadError, match=r"Unnamed.name: env name 'not a/partition'"):
        load_environment_class("tests.environments.test_conformance:Unnamed")
    assert load_environment_class("arithmetic") is load_environment_class("environments.bundled.arithmetic:Arithmetic")


def test_a_bad_config_is_refused_before_sampling_naming_the_field():
    arithmetic = load_environment_class("arithmetic")
    with pytest.raises(
        EnvironmentLoadError,
        match=r"max_operand: Input should be greater than or equal to 1.*fields of ArithmeticConfig",
    ):
        load_config(arithmetic, {"max_operand": 0})
    with pytest.raises(ValueError, match="group_sise: unknown field; check the spelling"):
        EnvSpec(import_path="arithmetic", config={"group_sise": 8})
    assert isinstance(load_config(arithmetic, {"max_operand": 3}), EnvironmentConfig)
    assert issubclass(arithmetic, Environment)
