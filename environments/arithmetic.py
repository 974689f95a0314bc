"""Single-turn reference environment: integer arithmetic questions with a verifiable answer."""

from __future__ import annotations

import random
import re

from pydantic import Field

from environments.base import Environment, EnvironmentConfig, Item
from environments.scored_group import ScoredGroup, ScoredSequence

_NUMBER = re.compile(r"-?\d+")


class ArithmeticConfig(EnvironmentConfig):
    max_operand: int = Field(default=20, ge=1, description="Operands are drawn from 0..max_operand.")
    operations: str = Field(default="+-", description="Operators to draw from, a subset of '+-*'.")


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
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        self.count += 1
        return Item(
            id=f"{self.config.seed}-{self.count}",
            prompt=[{"role": "user", "content": f"What is {a} {op} {b}? Give only the final answer."}],
            answer=answer,
        )

    def score(self, item: Item, completion: str) -> float:
        match = _NUMBER.search(completion)
        return 1.0 if match and int(match.group()) == item.answer else 0.0

    def gold_completion(self, item: Item) -> str:
        return f"{item.answer}"

    async def collect_trajectories(self, item: Item) -> ScoredGroup:
        version, (prompt_ids, completions) = await self.with_policy_version(self.sample_chat(item.prompt))
        sequences = []
        for c in completions:
            text = self.renderer.decode(c.token_ids)
            sequences.append(
                ScoredSequence.from_prompt(
                    prompt_ids,
                    c.token_ids,
                    c.logprobs,
                    score=self.score(item, text),
                    finish_reason=c.finish_reason,
                    messages=item.prompt + [{"role": "assistant", "content": text}],
                )
            )
        return self.make_group(item, sequences, policy_version=version)
