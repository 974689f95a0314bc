"""A multi-step OpenEnv environment that ends episodes itself: type the word the seed picks, three
attempts. OpenEnv's own style (Action/Observation/State types, an Environment subclass, the server
app), with the adapter's two hooks an environment brings when the defaults do not fit it:

    config {"environment": "environments.adapters.examples.openenv_spell:SpellEnvironment",
            "parse": "environments.adapters.examples.openenv_spell:parse_action",
            "render": "environments.adapters.examples.openenv_spell:render_observation"}

Reward: 1.0 for the step that types the word, else 0.0; the episode is done then, or after the
third attempt.
"""

from __future__ import annotations

import random
from typing import Any
from uuid import uuid4

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

WORDS = ("amber", "cloud", "maple", "piano", "river", "stone", "tiger", "velvet")
ATTEMPTS = 3


class SpellAction(Action):
    """The word as the agent typed it."""

    word: str = Field(..., description="The typed word")


class SpellObservation(Observation):
    """The target word and how the last attempt went."""

    target: str = Field(default="", description="The word to type")
    feedback: str = Field(default="", description="What the environment says about the last attempt")
    attempts_left: int = Field(default=ATTEMPTS, description="Attempts before the episode ends")


class SpellState(State):
    target: str = Field(default="", description="The word this episode asks for")
    attempts_left: int = Field(default=ATTEMPTS, description="Attempts before the episode ends")


class SpellEnvironment(Environment):
    """The seed picks the word; each step is one attempt."""

    SUPPORTS_CONCURRENT_SESSIONS: bool = True

    def __init__(self):
        super().__init__()
        self._state = SpellState(episode_id=str(uuid4()))

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> SpellObservation:
        target = random.Random(seed).choice(WORDS)
        self._state = SpellState(episode_id=episode_id or str(uuid4()), target=target, attempts_left=ATTEMPTS)
        return SpellObservation(target=target, feedback="Type the word.", attempts_left=ATTEMPTS)

    def step(self, action: SpellAction, timeout_s: float | None = None, **kwargs: Any) -> SpellObservation:  # type: ignore[override]
        state = self._state
        state.step_count += 1
        state.attempts_left -= 1
        correct = action.word.strip().lower() == state.target
        feedback = "Correct." if correct else f"Not {action.word.strip()[:40]!r}."
        return SpellObservation(
            target=state.target,
            feedback=feedback,
            attempts_left=state.attempts_left,
            done=correct or state.attempts_left == 0,
            reward=1.0 if correct else 0.0,
        )

    @property
    def state(self) -> SpellState:
        return self._state


def parse_action(text: str) -> SpellAction:
    """The policy's text -> the action: its first line is the typed word."""
    return SpellAction(word=text.strip().split("\n", 1)[0])


def render_observation(observation: dict[str, Any]) -> str:
    """An observation's fields -> the user turn the policy reads."""
    return (
        f"{observation['feedback']} Spell the word '{observation['target']}' "
        f"({observation['attempts_left']} attempts left)."
    )


app = create_app(SpellEnvironment, SpellAction, SpellObservation, env_name="spell", max_concurrent_envs=16)
