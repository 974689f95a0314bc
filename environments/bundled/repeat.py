"""Repeat a row of digits: long completions with a graded reward, the peer bench's generation-bound task.

"Repeat these digits: 3 8 1 ... 5" (`digits` of them, seeded). The reward is the share of the
row's positions that the answer's digits, read in order (anything else skipped), get right: a
model that writes many digits earns about a tenth by chance, one that copies earns up to 1.0.
Answers are long (a row of 48 digits is about 96 tokens), so sampling, not the update, is most of a
step's cost, and they vary in length as the model learns to stop where the row ends.
"""

from __future__ import annotations

import random
from typing import Any

from pydantic import Field

from environments.base import Environment, EnvironmentConfig, Item, final_answer


class RepeatConfig(EnvironmentConfig):
    digits: int = Field(default=48, ge=1, description="Digits in the row to repeat.")
    max_tokens: int = Field(
        default=128, ge=1, description="Most tokens sampled per answer (a row of n digits takes about 2n)."
    )


class Repeat(Environment):
    """'Repeat these digits: 3 8 1 5' -> the share of the four positions the answer's digits match."""

    name = "repeat"
    config_class = RepeatConfig

    def new_item(self, rng: random.Random, index: int) -> dict[str, Any]:
        row = "".join(str(rng.randrange(10)) for _ in range(self.config.digits))
        return dict(prompt=[{"role": "user", "content": f"Repeat these digits: {' '.join(row)}"}], answer=row)

    def reward(self, item: Item, messages: list[dict]) -> float:
        written = [character for character in final_answer(messages) if character in "0123456789"]
        return sum(map(str.__eq__, written, item.answer)) / len(item.answer)

    def gold_completion(self, item: Item) -> str:
        return " ".join(item.answer)
