"""Single-turn reference environment: integer arithmetic questions with a verifiable answer."""

from __future__ import annotations

import random
import re

from pydantic import Field

from environments.base import Environment, EnvironmentConfig, Item, final_answer

_NUMBER = re.compile(r"-?\d+")


class ArithmeticConfig(EnvironmentConfig):
    max_operand: int = Field(default=20, ge=1, description="Operands are drawn from 0..max_operand.")
    operations: str = Field(default="+-", pattern=r"^[+\-*]+$", description="Operators to draw from, a subset of '+-*'.")


class Arithmetic(Environment):
    """'What is 7 + 5?' -> reward 1.0 if the first integer in the answer is right, else 0.0."""

    name = "arithmetic"
    config_class = ArithmeticConfig

    async def setup(self) -> None:
        self.rng = random.Random(self.config.seed)
        self.count = 0

    async def get_item(self) -> Item:
        a, b = self.rng.randint(0, self.config.max_operand), self.rng.randint(0, self.config.max_operand)
        op = self.rng.choice(self.config.operations)
        self.count += 1
        return Item(
            id=f"{self.config.seed}-{self.count}",
            prompt=[{"role": "user", "content": f"What is {a} {op} {b}? Give only the final answer."}],
            answer={"+": a + b, "-": a - b, "*": a * b}[op],
        )

    def reward(self, item: Item, messages: list[dict]) -> float:
        match = _NUMBER.search(final_answer(messages))
        return 1.0 if match and int(match.group()) == item.answer else 0.0

    def gold_completion(self, item: Item) -> str:
        return f"{item.answer}"
