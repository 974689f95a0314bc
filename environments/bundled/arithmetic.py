"""Single-turn reference environment: integer arithmetic questions with a verifiable answer."""

from __future__ import annotations

import random
from typing import Any, ClassVar

from pydantic import Field

from environments.answers import AnswerConfig, Reader, parse_number, read_answer
from environments.base import Environment, Item, final_answer


class ArithmeticConfig(AnswerConfig):
    max_operand: int = Field(default=20, ge=1, description="Operands are drawn from 0..max_operand.")
    operations: str = Field(
        default="+-", pattern=r"^[+\-*]+$", description="Operators to draw from, a subset of '+-*'."
    )
    pool: int | None = Field(
        default=None,
        ge=1,
        description="Draw from a fixed pool of this many problems (seeded), e.g. a few demonstrations; None: fresh problems.",
    )
    partial_credit: bool = Field(
        default=False,
        description="A wrong number still earns up to 0.5 the closer it is (a denser signal to learn from); exact answers always earn 1.",
    )


class Arithmetic(Environment):
    """'What is 7 + 5?' -> reward 1.0 if the answer read is right, else 0.0: the whole answer when it
    is a number, else a boxed or tagged one, what follows "the answer is", the number after the last
    "=" ("7 + 5 = 12"), else the last number (environments.answers)."""

    name = "arithmetic"
    config_class = ArithmeticConfig
    readers: ClassVar[tuple[Reader, ...]] = ("only", "boxed", "answer_tag", "answer_is", "after_equals", "last_number")

    async def setup(self) -> None:
        self.problems = [self.problem(self.rng) for _ in range(self.config.pool or 0)]

    def problem(self, rng: random.Random) -> tuple[int, int, str]:
        a, b = rng.randint(0, self.config.max_operand), rng.randint(0, self.config.max_operand)
        return a, b, rng.choice(self.config.operations)

    def new_item(self, rng: random.Random, index: int) -> dict[str, Any]:
        a, b, op = self.problems[index % len(self.problems)] if self.problems else self.problem(rng)
        return dict(
            prompt=[{"role": "user", "content": f"What is {a} {op} {b}? Give only the final answer."}],
            answer={"+": a + b, "-": a - b, "*": a * b}[op],
        )

    def reward(self, item: Item, messages: list[dict]) -> float:
        readers = self.config.readers or self.readers
        reading = read_answer(final_answer(messages), readers)
        formatted = self.config.format_reward if reading.formatted(readers) else 0.0
        value = parse_number(reading.text) if reading.text is not None else None
        if value is None:
            return formatted
        distance = float(abs(value - item.answer))
        if distance == 0 or not self.config.partial_credit:
            return float(distance == 0) + formatted
        return 0.5 * max(0.0, 1.0 - distance / (self.config.max_operand + 1)) + formatted

    def gold_completion(self, item: Item) -> str:
        return f"{item.answer}"
