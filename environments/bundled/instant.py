"""An environment that samples nothing: each item becomes the same valid group at once.

For measuring and testing what runs around environments (the rollout flow, Prefect, storage)
without inference: its groups cost no sampling, so their timing is orchestration alone (plus the
policy-version read every group gets).
"""

from __future__ import annotations

import random

from core.scored_group import ScoredGroup, ScoredSequence
from environments.base import Environment, EnvironmentConfig, Item


class Instant(Environment):
    """Item ids count up from 1; every sequence is prompt [1, 2, 3], completion [4, 5], score 1."""

    name = "instant"
    config_class = EnvironmentConfig

    async def setup(self) -> None:
        self.completion_text = self.tokenizer.decode([4, 5], skip_special_tokens=True)

    def new_item(self, rng: random.Random, index: int) -> Item:
        return Item(id=str(index + 1), prompt=[{"role": "user", "content": "hi"}])

    def reward(self, item: Item, messages: list[dict]) -> float:
        return 1.0

    async def collect_trajectories(self, item: Item) -> ScoredGroup:
        messages = [*item.prompt, {"role": "assistant", "content": self.completion_text}]
        sequence = ScoredSequence.from_prompt(
            [1, 2, 3], [4, 5], [-0.5, -0.5], score=self.reward(item, messages), messages=messages
        )
        return self.make_group(item, [sequence] * self.config.group_size)
