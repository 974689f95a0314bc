"""Single-turn comparison: which of two numbers is larger (or smaller)? The answer is one of the
prompt's own numbers, so a small model can learn it by attending to them: the demo's RL task."""

from __future__ import annotations

import random
import re
from typing import Literal

from pydantic import Field

from environments.base import Environment, EnvironmentConfig, Item, final_answer

_NUMBER = re.compile(r"-?\d+")


class CompareConfig(EnvironmentConfig):
    max_value: int = Field(default=9, ge=1, description="Numbers are drawn from 0..max_value, two different ones.")
    which: Literal["larger", "smaller"] = Field(default="larger", description="Ask for the larger or the smaller number.")
    pool: int | None = Field(
        default=None,
        ge=1,
        description="Draw from a fixed pool of this many problems (seeded), e.g. a few demonstrations, "
        "with as many different answers as the pool and the range allow; None: fresh problems.",
    )


class Compare(Environment):
    """'Which is larger, 3 or 7? Give only the number.' -> 1.0 if the first integer of the answer
    is the right one, else 0.0."""

    name = "compare"
    config_class = CompareConfig

    async def setup(self) -> None:
        self.rng = random.Random(self.config.seed)
        self.count = 0
        self.problems = self.diverse_pool(self.config.pool or 0)

    def diverse_pool(self, size: int) -> list[tuple[int, int]]:
        """`size` problems, each with an answer no earlier one has while answers remain: a few
        demonstrations that show every answer the task can have, not one answer many times."""
        pick = max if self.config.which == "larger" else min
        candidates = [(a, b) for a in range(self.config.max_value + 1) for b in range(self.config.max_value + 1) if a != b]
        self.rng.shuffle(candidates)
        pool: list[tuple[int, int]] = []
        for problem in candidates:
            if len(pool) == size:
                break
            if pick(*problem) not in {pick(*p) for p in pool}:
                pool.append(problem)
        return pool + [self.problem() for _ in range(size - len(pool))]

    def problem(self) -> tuple[int, int]:
        a, b = self.rng.sample(range(self.config.max_value + 1), 2)
        return a, b

    async def get_item(self) -> Item:
        a, b = self.problems[self.count % len(self.problems)] if self.problems else self.problem()
        self.count += 1
        pick = max if self.config.which == "larger" else min
        return Item(
            id=f"{self.config.seed}-{self.count}",
            prompt=[{"role": "user", "content": f"Which is {self.config.which}, {a} or {b}? Give only the number."}],
            answer=pick(a, b),
        )

    def reward(self, item: Item, messages: list[dict]) -> float:
        match = _NUMBER.search(final_answer(messages))
        return float(match is not None and int(match.group()) == item.answer)

    def gold_completion(self, item: Item) -> str:
        return f"{item.answer}"
