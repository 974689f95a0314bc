"""An environment that samples nothing: each item becomes the same valid group at once.

For measuring and testing what runs around environments (the rollout flow, Prefect, storage)
without a policy server: its groups cost no inference, so their timing is orchestration alone.
"""

from __future__ import annotations

from environments.base import Environment, EnvironmentConfig, Item
from environments.scored_group import ScoredGroup, ScoredSequence


class Instant(Environment):
    """Item ids count up from 1; every sequence is prompt [1, 2, 3], completion [4, 5], score 1."""

    name = "instant"
    config_class = EnvironmentConfig

    async def setup(self) -> None:
        self.count = 0

    async def get_item(self) -> Item:
        self.count += 1
        return Item(id=str(self.count), prompt=[{"role": "user", "content": "hi"}])

    def score(self, item: Item, completion: str) -> float:
        return 1.0

    async def collect_trajectories(self, item: Item) -> ScoredGroup:
        sequence = ScoredSequence.from_prompt([1, 2, 3], [4, 5], [-0.5, -0.5], score=1.0)
        return self.make_group(item, [sequence] * self.config.group_size, policy_version=0)
