"""Environments that return bad output, one kind each, for the rollout flow's reliability tests.

Each samples a real group from the policy server first (so the flow, the server and the failure
path all run as in a real run), then breaks it in one way. `Good` is the control: the default
single-turn group. All hand out `items` items, then None, so a run's counts are exact.
"""

from __future__ import annotations

import asyncio
import math

from pydantic import Field

from core.scored_group import ScoredGroup, ScoredSequence
from environments.base import DroppedByEnvironment, Environment, EnvironmentConfig, Item, prompt_messages

# 10 MiB of int32 token ids in one group.
HUGE_GROUP_TOKENS = 10 * 2**20 // 4


class FiniteConfig(EnvironmentConfig):
    items: int = Field(default=2, ge=1, description="Items handed out before get_item returns None.")


class Finite(Environment):
    """`items` items, each a short prompt; a reward of 1 for any answer."""

    config_class = FiniteConfig

    async def setup(self) -> None:
        self.count = 0

    async def get_item(self) -> Item | None:
        if self.count >= self.config.items:
            return None
        self.count += 1
        return Item(id=f"{self.name}-{self.count}", prompt="Say one word.")

    def reward(self, item: Item, messages: list[dict]) -> float:
        return 1.0

    async def sampled(self, item: Item) -> list[ScoredSequence]:
        prompt_ids, completions = await self.sample_chat(prompt_messages(item))
        return [self.scored_completion(item, prompt_ids, completion) for completion in completions]


class Good(Finite):
    """The control: the inherited single-turn collect_trajectories."""

    name = "good"


class RaggedMask(Finite):
    """One sequence's mask is a token short."""

    name = "bad_ragged"

    async def collect_trajectories(self, item: Item) -> ScoredGroup:
        sequences = await self.sampled(item)
        sequences[0] = sequences[0].model_copy(update={"mask": sequences[0].mask[:-1]})
        return self.make_group(item, sequences)


class NanScore(Finite):
    """The reward function returns NaN."""

    name = "bad_nan"

    def reward(self, item: Item, messages: list[dict]) -> float:
        return math.nan


class EmptyGroup(Finite):
    """Samples, then returns a group of no sequences."""

    name = "bad_empty"

    async def collect_trajectories(self, item: Item) -> ScoredGroup:
        await self.sampled(item)
        return self.make_group(item, [])


class OutOfVocabulary(Finite):
    """The last token of one sequence is an id past the tokenizer's vocabulary (a sequence
    tokenized by another tokenizer)."""

    name = "bad_vocab"

    async def collect_trajectories(self, item: Item) -> ScoredGroup:
        sequences = await self.sampled(item)
        tokens = sequences[-1].tokens[:-1] + [self.vocab_size + 100]
        sequences[-1] = sequences[-1].model_copy(update={"tokens": tokens})
        return self.make_group(item, sequences)


class RaisingReward(Finite):
    """The reward function has a bug."""

    name = "bad_raise"

    def reward(self, item: Item, messages: list[dict]) -> float:
        return {"answers": []}["answer"][0]  # KeyError: 'answer'


class Dropping(Finite):
    """Its own filter drops every group (as Atropos environments drop a group whose scores are all
    equal): no error, recorded under a reason that says it was the environment's choice."""

    name = "bad_dropping"

    async def collect_trajectories(self, item: Item) -> ScoredGroup:
        raise DroppedByEnvironment("every score of the group was equal; this environment's filter keeps no such group")


class Hang(Finite):
    """Samples, then waits for something that never comes (a tool call without a timeout)."""

    name = "bad_hang"

    async def collect_trajectories(self, item: Item) -> ScoredGroup:
        await self.sampled(item)
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


class Huge(Finite):
    """Samples, then prepends 10 MiB of token ids to the first sequence's prompt."""

    name = "bad_huge"

    async def collect_trajectories(self, item: Item) -> ScoredGroup:
        sequences = await self.sampled(item)
        first = sequences[0]
        padding = HUGE_GROUP_TOKENS - sum(len(sequence.tokens) for sequence in sequences)
        sequences[0] = first.model_copy(
            update={
                "tokens": [1] * padding + first.tokens,
                "mask": [False] * padding + first.mask,
                "logprobs": [0.0] * padding + first.logprobs,
            }
        )
        return self.make_group(item, sequences)


class RaisingGetItem(Finite):
    """Hands out one item, then get_item raises: the environment leaves the run, the run goes on."""

    name = "bad_get_item"

    async def get_item(self) -> Item | None:
        if self.count >= 1:
            raise RuntimeError("the item source broke")
        return await super().get_item()


class RaisingObserve(Finite):
    """Its groups are fine; learning from them (observe) raises after they are stored."""

    name = "bad_observe"

    async def observe(self, group: ScoredGroup) -> None:
        raise RuntimeError("the curriculum broke")


# Each bad environment, the failure reason its groups are recorded with, and a phrase of the
# error naming the field or limit and the fix.
BAD_OUTPUTS = {
    RaggedMask: ("ragged", "mask: length"),
    NanScore: ("non-finite", "score: nan is not finite; return a finite reward"),
    EmptyGroup: ("empty", "a group needs at least one sequence"),
    OutOfVocabulary: ("out-of-vocab", "tokenize with the policy's tokenizer"),
    RaisingReward: ("exception", "KeyError: 'answer'"),
    Dropping: ("dropped-by-environment", "this environment's filter keeps no such group"),
    Hang: ("timeout", "raise group_timeout_s"),
    Huge: ("too-large", "raise max_group_tokens"),
}
