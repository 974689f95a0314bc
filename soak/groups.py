"""The soak's environment: groups that differ from each other, cost little, and leave a journal.

`environments.bundled.instant:Instant` makes every group the same (one completion, equal scores): its
groups have zero advantages, so a trainer fed one twice, or in another order, ends with the same
weights. Here each item's prompt, completions and scores come from a generator seeded by the item
id (`{seed}-{n}`), so a step that trains other groups, or a group twice, lands on other weights.

`sample_tokens > 0` samples the completions from the policy server instead (real requests in
flight when a server is killed or reloaded); `delay_s` stands for sampling time otherwise.
`journal` names a local file the environment appends `item_id time` to for every group it
finished, before the flow stores it: after a kill, the journal's groups that no shard holds are
exactly the finished-but-uncommitted ones the kill lost.
"""

from __future__ import annotations

import asyncio
import os
import random
import time

from pydantic import Field

from core.scored_group import ScoredGroup, ScoredSequence
from environments.base import Environment, EnvironmentConfig, Item

# Token ids inside the tiny model's vocabulary (512), clear of the special ids at the bottom.
LOWEST_TOKEN, HIGHEST_TOKEN = 3, 500
# About the tiny random model's own logprob of a token (-ln 512): importance ratios stay near 1.
SAMPLER_LOGPROB = -6.2


class DistinctConfig(EnvironmentConfig):
    sample_tokens: int = Field(
        default=0, ge=0, description="Sample completions of this many tokens from the server (0: draw them)."
    )
    delay_s: float = Field(default=0.0, ge=0.0, description="Seconds each group takes when nothing is sampled.")
    journal: str | None = Field(
        default=None, description="Local file to append 'item_id unix_time' to per finished group."
    )


class Distinct(Environment):
    """Item ids are `{seed}-{n}`, n from 1; a drawn group is a pure function of its item id."""

    name = "distinct"
    config_class = DistinctConfig

    async def setup(self) -> None:
        self.count = 0

    async def get_item(self) -> Item:
        self.count += 1
        return Item(id=f"{self.config.seed}-{self.count}", prompt=[{"role": "user", "content": "hi"}])

    def reward(self, item: Item, messages: list[dict]) -> float:
        return 0.0  # the scores are drawn with the completions (collect_trajectories)

    async def collect_trajectories(self, item: Item) -> ScoredGroup:
        if self.config.sample_tokens:
            prompt = draw_prompt(random.Random(item.id))
            completions = await self.client.complete(
                prompt,
                n=self.config.group_size,
                max_tokens=self.config.sample_tokens,
                min_tokens=self.config.sample_tokens,
                temperature=1.0,
            )
            return self.finished(item, scored(item.id, prompt, [(c.token_ids, c.logprobs) for c in completions]))
        if self.config.delay_s:
            await asyncio.sleep(self.config.delay_s)
        return self.finished(item, draw_group(item.id, self.config.group_size).sequences)

    def finished(self, item: Item, sequences: list[ScoredSequence], errors: list[str] | None = None) -> ScoredGroup:
        """The item's group, recorded in the journal before the flow stores it."""
        group = self.make_group(item, sequences, errors=errors)
        if self.config.journal:
            self.record(item.id)
        return group

    def record(self, item_id: str) -> None:
        # One write of a whole line with O_APPEND: a kill leaves whole lines only.
        line = f"{item_id} {time.time():.3f}\n".encode()
        descriptor = os.open(self.config.journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(descriptor, line)
        finally:
            os.close(descriptor)


def draw_prompt(rng: random.Random) -> list[int]:
    return [rng.randint(LOWEST_TOKEN, HIGHEST_TOKEN) for _ in range(rng.randint(3, 6))]


def scored(item_id: str, prompt: list[int], completions: list[tuple[list[int], list[float]]]) -> list[ScoredSequence]:
    """The sequences of a group: scores differ within it (member 0 scores 1, member 1 scores 0,
    the rest are drawn), so its advantages do."""
    scores = planned_scores(item_id, len(completions))
    return [
        ScoredSequence.from_prompt(prompt, tokens, logprobs, score)
        for (tokens, logprobs), score in zip(completions, scores, strict=True)
    ]


def planned_scores(item_id: str, group_size: int) -> list[float]:
    """The scores of `item_id`'s group: member 0 scores 1, member 1 scores 0, the rest are drawn."""
    rng = random.Random(f"{item_id} scores")
    return [1.0 if member == 0 else 0.0 if member == 1 else rng.random() for member in range(group_size)]


def draw_group(item_id: str, group_size: int, env: str = "distinct") -> ScoredGroup:
    """The group of `item_id` drawn without inference: the same every time."""
    rng = random.Random(item_id)
    prompt = draw_prompt(rng)
    completions = []
    for _ in range(group_size):
        tokens = [rng.randint(LOWEST_TOKEN, HIGHEST_TOKEN) for _ in range(rng.randint(2, 6))]
        completions.append((tokens, [SAMPLER_LOGPROB] * len(tokens)))
    return ScoredGroup(env=env, item_id=item_id, sequences=scored(item_id, prompt, completions), policy_version=0)


def read_journal(path: str | os.PathLike) -> dict[str, float]:
    """item id -> when its group finished, from a journal (missing file: none finished)."""
    try:
        text = open(path).read()
    except FileNotFoundError:
        return {}
    finished = {}
    for line in text.splitlines():
        item_id, _, when = line.partition(" ")
        if when:
            finished[item_id] = float(when)
    return finished
