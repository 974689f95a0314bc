"""Multi-turn reference environment: guess a hidden number, told 'higher' or 'lower' each turn."""

from __future__ import annotations

import random
import re
from typing import Any

from pydantic import Field

from environments.base import Environment, EnvironmentConfig, Item, prompt_messages
from environments.chat import ChatSession

_NUMBER = re.compile(r"-?\d+")


class GuessNumberConfig(EnvironmentConfig):
    high: int = Field(default=20, ge=2, description="The hidden number is in 1..high.")
    turns: int = Field(default=3, ge=1, description="Guesses allowed per rollout.")


def guessed(item: Item, text: str) -> bool:
    match = _NUMBER.search(text)
    return bool(match) and int(match.group()) == item.answer


class GuessNumber(Environment):
    """Each rollout is one conversation: the model guesses, the environment answers, up to `turns`.

    Reward: 1.0 for a correct guess, halved for every guess before it; 0.0 if never found.
    """

    name = "guess_number"
    config_class = GuessNumberConfig

    def new_item(self, rng: random.Random, index: int) -> dict[str, Any]:
        high = self.config.high
        return dict(
            prompt=[
                {"role": "user", "content": f"Guess a number between 1 and {high}. {self.config.turns} tries left."}
            ],
            answer=rng.randint(1, high),
        )

    def reward(self, item: Item, messages: list[dict]) -> float:
        guesses = [m["content"] for m in messages if m["role"] == "assistant"]
        for turn, guess in enumerate(guesses):
            if guessed(item, guess):
                return 0.5**turn
        return 0.0

    def gold_completion(self, item: Item) -> str:
        return str(item.answer)

    def reply(self, item: Item, guess: str, tries_left: int) -> str:
        match = _NUMBER.search(guess)
        if not match:
            return f"That is not a number. {tries_left} tries left."
        direction = "Too low." if int(match.group()) < item.answer else "Too high."
        return f"{direction} {tries_left} tries left."

    async def play(self, item: Item) -> ChatSession:
        session = self.chat(prompt_messages(item))
        for turn in range(self.config.turns):
            await session.sample(self.client, **self.sampling())
            guess = session.messages[-1]["content"]
            tries_left = self.config.turns - turn - 1
            if guessed(item, guess) or tries_left == 0:
                break
            session.add_messages([{"role": "user", "content": self.reply(item, guess, tries_left)}])
        return session
