"""Single-turn reference environment: integer arithmetic questions with a verifiable answer.

With `held_out` above 0 the problems are split once, the same way for every instance and seed: a
share of them (both orders of a pair with the same operator together, so "3 * 7" is held out with
"7 * 3") is set aside for `evaluate` and never made by `new_item`."""

from __future__ import annotations

import hashlib
import random
from typing import Any, ClassVar

from pydantic import Field

from environments.answers import AnswerConfig, Reader, parse_number, read_answer
from environments.base import Environment, Item, final_answer

# The split's own salt: not the item stream's seed, so instances with different seeds agree on it.
_SPLIT_SALT = b"clotho-arith"


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
    held_out: float = Field(
        default=0.0,
        ge=0.0,
        lt=1.0,
        description="Share of the problems set aside for evaluate and never trained on (drawn by a hash of "
        "the pair and operator: the same split for every seed); 0: evaluate draws fresh problems from "
        "eval_seed's stream, which may repeat training problems.",
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

    def is_held_out(self, a: int, b: int, op: str) -> bool:
        """Whether the problem is in the held-out share: a hash of {a, b} and the operator."""
        if self.config.held_out == 0:
            return False
        key = f"{min(a, b)}{op}{max(a, b)}".encode()
        fraction = int.from_bytes(hashlib.blake2b(key, digest_size=8, salt=_SPLIT_SALT).digest(), "big") / 2**64
        return fraction < self.config.held_out

    def problem(self, rng: random.Random) -> tuple[int, int, str]:
        """A training problem (outside the held-out share)."""
        for _ in range(10_000):
            a, b = rng.randint(0, self.config.max_operand), rng.randint(0, self.config.max_operand)
            op = rng.choice(self.config.operations)
            if not self.is_held_out(a, b, op):
                return a, b, op
        raise ValueError(
            f"arithmetic: held_out {self.config.held_out} leaves (almost) no problem to train on with max_operand "
            f"{self.config.max_operand} and operations {self.config.operations!r}: lower held_out or widen the range"
        )

    def items(self, split: str) -> list[dict[str, Any]] | None:
        """ "eval" with held_out above 0: every held-out problem once, in an order seeded by
        eval_seed (evaluate's twin is seeded with it); else None (new_item's stream)."""
        if split != "eval" or self.config.held_out == 0:
            return None
        span = range(self.config.max_operand + 1)
        operations = dict.fromkeys(self.config.operations)
        held = [(a, b, op) for op in operations for a in span for b in span if self.is_held_out(a, b, op)]
        return [self.item(*problem) for problem in self.rng.sample(held, len(held))] or None

    def new_item(self, rng: random.Random, index: int) -> dict[str, Any]:
        return self.item(*(self.problems[index % len(self.problems)] if self.problems else self.problem(rng)))

    def item(self, a: int, b: int, op: str) -> dict[str, Any]:
        return dict(
            prompt=[{"role": "user", "content": f"What is {a} {op} {b}? Give only the final answer."}],
            answer={"+": a + b, "-": a - b, "*": a * b}[op],
            extras={"problem": [a, op, b]},
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
