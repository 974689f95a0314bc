"""Single-turn comparison: which of two numbers is larger (or smaller)? The answer is one of the
prompt's own numbers, so a small model can learn it by attending to them: the demo's RL task.

The problems are split once, the same way for every instance: a share of the pairs {a, b} (both
orders) is held out for `evaluate` (the "eval" split) and never made by `new_item`, so neither RL nor an SFT
warm start on this environment's gold answers ever sees an evaluation problem."""

from __future__ import annotations

import random
from typing import ClassVar, Literal

from pydantic import Field

from environments.answers import AnswerConfig, Reader, graded, number_matches
from environments.base import Environment, Item, final_answer

# The split's own seed: not the item stream's, so instances with different seeds agree on it.
_SPLIT_SEED = 20261203


class CompareConfig(AnswerConfig):
    max_value: int = Field(default=9, ge=1, description="Numbers are drawn from 0..max_value, two different ones.")
    which: Literal["larger", "smaller"] = Field(
        default="larger", description="Ask for the larger or the smaller number."
    )
    pool: int | None = Field(
        default=None,
        ge=1,
        description="Draw from a fixed pool of this many training problems (seeded), e.g. a few demonstrations, "
        "with as many different answers as the pool and the range allow; None: fresh training problems.",
    )
    held_out: float = Field(
        default=0.3,
        ge=0.0,
        lt=1.0,
        description="Share of the pairs {a, b} (both orders) set aside for evaluate and never trained on "
        "(at least one pair when above 0, and at least one pair is left to train on); 0: evaluate draws "
        "from the training problems.",
    )


def split_pairs(max_value: int, held_out: float) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(training problems, held-out problems): every ordered pair (a, b), a != b, in 0..max_value,
    with both orders of a pair on the same side; the same split for the same arguments."""
    pairs = [(a, b) for a in range(max_value + 1) for b in range(a + 1, max_value + 1)]
    random.Random(_SPLIT_SEED).shuffle(pairs)
    count = 0 if held_out == 0 else min(len(pairs) - 1, max(1, round(len(pairs) * held_out)))
    both_orders = lambda chosen: sorted([(a, b) for a, b in chosen] + [(b, a) for a, b in chosen])  # noqa: E731
    return both_orders(pairs[count:]), both_orders(pairs[:count])


class Compare(Environment):
    """'Which is larger, 3 or 7? Give only the number.' -> 1.0 if the answer read is the right number,
    else 0.0: the whole answer when it is a number, else a boxed or tagged one, what follows "the
    answer is", else the first number ("7 is larger than 3"; environments.answers)."""

    name = "compare"
    config_class = CompareConfig
    readers: ClassVar[tuple[Reader, ...]] = ("only", "boxed", "answer_tag", "answer_is", "first_number")

    async def setup(self) -> None:
        self.training, self.held_out = split_pairs(self.config.max_value, self.config.held_out)
        self.problems = self.diverse_pool(self.config.pool or 0)
        evaluation = self.held_out or self.training
        self.evaluation_order = self.rng.sample(evaluation, len(evaluation))

    def diverse_pool(self, size: int) -> list[tuple[int, int]]:
        """`size` training problems, each with an answer no earlier one has while answers remain: a
        few demonstrations that show every answer the task can have, not one answer many times."""
        pick = max if self.config.which == "larger" else min
        candidates = list(self.training)
        self.rng.shuffle(candidates)
        pool: list[tuple[int, int]] = []
        for problem in candidates:
            if len(pool) == size:
                break
            if pick(*problem) not in {pick(*p) for p in pool}:
                pool.append(problem)
        return pool + [self.rng.choice(self.training) for _ in range(size - len(pool))]

    def items(self, split: str) -> list[Item] | None:
        """ "eval": each held-out problem once, in an order seeded by eval_seed (evaluate's twin is
        seeded with it). "train" is made by new_item."""
        if split != "eval":
            return None
        return [self.item(a, b, f"{self.config.seed}-{n}") for n, (a, b) in enumerate(self.evaluation_order, 1)]

    def new_item(self, rng: random.Random, index: int) -> Item:
        a, b = self.problems[index % len(self.problems)] if self.problems else rng.choice(self.training)
        return self.item(a, b, f"{self.config.seed}-{index + 1}")

    def item(self, a: int, b: int, id: str) -> Item:
        pick = max if self.config.which == "larger" else min
        return Item(
            id=id,
            prompt=[{"role": "user", "content": f"Which is {self.config.which}, {a} or {b}? Give only the number."}],
            answer=pick(a, b),
            extras={"pair": [a, b]},
        )

    def reward(self, item: Item, messages: list[dict]) -> float:
        readers = self.config.readers or self.readers
        return graded(final_answer(messages), readers, number_matches(item.answer), self.config.format_reward)

    def gold_completion(self, item: Item) -> str:
        return f"{item.answer}"
