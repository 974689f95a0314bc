"""The conformance suite every environment inherits: subclass it and set environment_class."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import pyarrow.parquet as pq
import pytest

from environments.base import Environment, Item
from environments.scored_group import ScoredGroup
from inference.client import PolicyClient
from storage.schema import groups_to_table, table_to_groups


class EnvironmentConformance:
    """Items load, a group validates, it round-trips through Parquet, rewards are deterministic for
    a fixed completion, and the gold answer scores top. Runs against the live policy server."""

    environment_class: ClassVar[type[Environment]]
    config: ClassVar[dict[str, Any]] = {}

    @pytest.fixture
    async def env(self, policy_server, tiny_model_dir):
        async with PolicyClient(policy_server.base_url) as client:
            environment = self.environment_class(self.config, client=client, tokenizer=str(tiny_model_dir))
            await environment.setup()
            yield environment

    async def test_items_load(self, env):
        items = [await env.get_item() for _ in range(4)]
        assert all(isinstance(item, Item) for item in items)
        assert len({item.id for item in items}) == 4, "item ids must be unique"

    async def test_group_validates(self, env):
        group = await env.collect_trajectories(await env.get_item())
        assert isinstance(group, ScoredGroup)
        assert group.env == env.name
        assert 1 <= len(group.sequences) <= env.config.group_size
        group.check_limits(vocab_size=env.vocab_size, max_group_size=env.config.group_size)
        for sequence in group.sequences:
            assert len(sequence.tokens) == len(sequence.mask) == len(sequence.logprobs)
            assert not sequence.mask[0], "the prompt is never trained"
            assert all(lp == 0.0 for lp, m in zip(sequence.logprobs, sequence.mask) if not m)
            assert all(lp <= 0.0 for lp, m in zip(sequence.logprobs, sequence.mask) if m)

    async def test_group_round_trips_through_parquet(self, env, tmp_path):
        group = await env.collect_trajectories(await env.get_item())
        path = tmp_path / "group.parquet"
        pq.write_table(groups_to_table([group], tokenizer="tiny"), path)
        [restored] = table_to_groups(pq.read_table(path))
        # The shard schema stores logprobs and advantages as float32.
        float32 = lambda values: None if values is None else np.asarray(values, np.float32).tolist()  # noqa: E731
        for before, after in zip(group.sequences, restored.sequences, strict=True):
            assert after.logprobs == float32(before.logprobs)
            assert after.advantages == float32(before.advantages)
            before.logprobs, before.advantages = after.logprobs, after.advantages
        assert restored == group

    async def test_rewards_are_deterministic_for_a_fixed_completion(self, env):
        item = await env.get_item()
        completion = "I think the answer is 7, or maybe 12."
        assert env.score(item, completion) == env.score(item, completion)

    async def test_gold_answer_scores_top(self, env):
        item = await env.get_item()
        gold = env.gold_completion(item)
        if gold is None:
            pytest.skip(f"{self.environment_class.__name__} has no gold completion")
        assert env.score(item, gold) >= max(env.score(item, wrong) for wrong in ("", "no idea", "-99999"))
        assert env.score(item, gold) > env.score(item, "")
