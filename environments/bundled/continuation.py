"""Base-model completion: no chat template, the model continues a raw text prefix.

Items are arithmetic progressions written out, "7, 10, 13, 16,"; the model continues the text and
the reward is 1.0 when its continuation starts with the next term (" 19"), else 0.0. The prompt is
the tokenizer's encoding of the prefix itself (Environment.complete_text): a base model's task,
which mixes with chat environments in one run (each group records how its tokens were made: this
one's `chat_template` is "none").
"""

from __future__ import annotations

import random
import re
from typing import Any

from pydantic import Field

from core.scored_group import ScoredGroup
from environments.base import Environment, EnvironmentConfig, Item, final_answer

_FIRST_NUMBER = re.compile(r"^\s*(-?\d+)")


class ContinuationConfig(EnvironmentConfig):
    terms: int = Field(default=4, ge=2, description="Terms of the progression shown.")
    max_start: int = Field(default=20, ge=0, description="The first term is in 0..max_start.")
    max_step: int = Field(default=5, ge=1, description="The common difference is in 1..max_step.")


class Continuation(Environment):
    """'7, 10, 13, 16,' -> 1.0 when the raw completion starts with the next term (' 19'), else 0.0."""

    name = "continuation"
    config_class = ContinuationConfig

    def new_item(self, rng: random.Random, index: int) -> dict[str, Any]:
        start, step = rng.randint(0, self.config.max_start), rng.randint(1, self.config.max_step)
        terms = [start + step * i for i in range(self.config.terms)]
        return dict(
            prompt=", ".join(map(str, terms)) + ",",  # a text prefix, not messages
            answer=start + step * self.config.terms,
        )

    def reward(self, item: Item, messages: list[dict]) -> float:
        match = _FIRST_NUMBER.match(final_answer(messages))
        return float(match is not None and int(match.group(1)) == item.answer)

    def gold_completion(self, item: Item) -> str:
        return f" {item.answer}"

    async def collect_trajectories(self, item: Item) -> ScoredGroup:
        prompt_ids, completions = await self.complete_text(item.prompt)
        group = self.make_group(item, [self.scored_completion(item, prompt_ids, c) for c in completions])
        return group.model_copy(update={"chat_template": "none"})
