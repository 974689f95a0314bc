"""Multi-turn reference environment: guess a hidden number, told 'higher' or 'lower' each turn."""

from __future__ import annotations

import random
import re

from pydantic import Field

from environments.base import Environment, EnvironmentConfig, Item
from environments.scored_group import ScoredGroup, ScoredSequence

_NUMBER = re.compile(r"-?\d+")


class GuessNumberConfig(EnvironmentConfig):
    high: int = Field(default=20, ge=2, description="The hidden number is in 1..high.")
    turns: int = Field(default=3, ge=1, description="Guesses allowed per rollout.")


class GuessNumber(Environment):
    """Each rollout is one conversation: the model guesses, the environment answers, up to `turns`.

    Reward: 1.0 for a correct guess, discounted by 0.5 per extra turn; 0.0 if never found.
    """

    name = "guess_number"
    config_class = GuessNumberConfig

    async def setup(self) -> None:
        self.rng = random.Random(self.config.seed)
        self.count = 0

    async def get_item(self) -> Item:
        self.count += 1
        high = self.config.high
        return Item(
            id=f"{self.config.seed}-{self.count}",
            prompt=[{"role": "user", "content": f"Guess a number between 1 and {high}. {self.config.turns} tries left."}],
            answer=self.rng.randint(1, high),
        )

    def score(self, item: Item, completion: str) -> float:
        """Score of a single guess: 1.0 when it names the hidden number."""
        match = _NUMBER.search(completion)
        return 1.0 if match and int(match.group()) == item.answer else 0.0

    def gold_completion(self, item: Item) -> str:
        return str(item.answer)

    def reply(self, item: Item, guess: str, tries_left: int) -> str:
        match = _NUMBER.search(guess)
        if not match:
            return f"That is not a number. {tries_left} tries left."
        direction = "Too low." if int(match.group()) < item.answer else "Too high."
        return f"{direction} {tries_left} tries left."

    async def rollout(self, item: Item) -> ScoredSequence:
        session = self.chat(item.prompt)
        reward = 0.0
        for turn in range(self.config.turns):
            await session.sample(self.client, **self.sampling())
            guess = session.messages[-1]["content"]
            if self.score(item, guess) == 1.0:
                reward = 0.5**turn
                break
            if turn + 1 < self.config.turns:
                tries_left = self.config.turns - turn - 1
                session.add_messages([{"role": "user", "content": self.reply(item, guess, tries_left)}])
        return session.to_sequence(reward, extras={"turns": session.trajectory.turns})

    async def collect_trajectories(self, item: Item) -> ScoredGroup:
        rollouts = [self.rollout(item) for _ in range(self.config.group_size)]
        version, (sequences, errors) = await self.with_policy_version(self.gather_sequences(rollouts))
        return self.make_group(item, sequences, policy_version=version, errors=errors)
