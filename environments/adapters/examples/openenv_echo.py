"""An OpenEnv echo environment in OpenEnv's own style, as `openenv init echo` scaffolds it (models,
environment and server app of the template in one file), for the adapter's tests and as an example.

Run in process by the adapter:
    config {"environment": "environments.adapters.examples.openenv_echo:EchoEnvironment"}
or as an OpenEnv server (in .venv-env-openenv), used by its URL:
    uvicorn environments.adapters.examples.openenv_echo:app --port 8000
    config {"environment": "http://127.0.0.1:8000"}

The adapter's defaults fit it: the policy's whole text is the action's `message`, and the
observation's `echoed_message` is the next user turn. Reward, as in the template: 0.1 per character.
"""

from __future__ import annotations

from typing import Any
from uuid import uuid4

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class EchoAction(Action):
    """Action for the Echo environment - just a message to echo."""

    message: str = Field(..., description="Message to echo back")


class EchoObservation(Observation):
    """Observation from the Echo environment - the echoed message."""

    echoed_message: str = Field(default="", description="The echoed message")
    message_length: int = Field(default=0, description="Length of the echoed message")


class EchoEnvironment(Environment):
    """Echoes back whatever message it receives; never ends an episode by itself."""

    # Every instance keeps its own state, so a server may run several sessions at once.
    SUPPORTS_CONCURRENT_SESSIONS: bool = True

    def __init__(self):
        super().__init__()
        self._state = State(episode_id=str(uuid4()), step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> EchoObservation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return EchoObservation(echoed_message="Echo environment ready!", message_length=0, done=False, reward=0.0)

    def step(self, action: EchoAction, timeout_s: float | None = None, **kwargs: Any) -> EchoObservation:  # type: ignore[override]
        self._state.step_count += 1
        message = action.message
        return EchoObservation(
            echoed_message=message,
            message_length=len(message),
            done=False,
            reward=len(message) * 0.1,  # the template's reward: longer messages score higher
            metadata={"original_message": message, "step": self._state.step_count},
        )

    @property
    def state(self) -> State:
        return self._state


# The server app, as the template's server/app.py makes it; room for a group of episodes at once
# (the template's default of one session would refuse a group's second episode).
app = create_app(EchoEnvironment, EchoAction, EchoObservation, env_name="echo", max_concurrent_envs=16)
