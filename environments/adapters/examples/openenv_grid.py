"""An OpenEnv environment in OpenEnv's own style whose action is not a message: a move with a
direction and a number of steps on a 5 x 5 grid, as upstream grid_world_env's (an enum field)
and connect4_env's (an int) are. Its server, like those two, takes one session at a time
(`create_app` with no concurrency). For the adapter's tests and as an example:

    config {"environment": "environments.adapters.examples.openenv_grid:GridEnvironment"}
    uvicorn environments.adapters.examples.openenv_grid:app --port 8000; config {"environment": "http://127.0.0.1:8000"}

The adapter needs no parse for it: the action's JSON schema (from step's annotation, or the
server's /schema) asks the policy for a JSON object and reads one.
"""

from __future__ import annotations

from typing import Any, Literal
from uuid import uuid4

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

GOAL = (4, 4)
MOVES = {"up": (0, 1), "down": (0, -1), "left": (-1, 0), "right": (1, 0)}


class StepAction(Action):
    direction: Literal["up", "down", "left", "right"] = Field(description="Where to move.")
    steps: int = Field(default=1, ge=1, le=2, description="How many cells (1 or 2).")


class GridObservation(Observation):
    x: int = 0
    y: int = 0
    message: str = ""


class GridEnvironment(Environment):
    """Start at (0, 0); -0.1 a move, +1 on reaching (4, 4), which ends the episode."""

    def __init__(self):
        super().__init__()
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self.x = self.y = 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GridObservation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        self.x = self.y = 0
        return GridObservation(x=0, y=0, message=f"You are at (0, 0). Reach {GOAL}.", done=False, reward=0.0)

    def step(self, action: StepAction, timeout_s: float | None = None, **kwargs: Any) -> GridObservation:  # type: ignore[override]
        self._state.step_count += 1
        dx, dy = MOVES[action.direction]
        self.x = min(4, max(0, self.x + dx * action.steps))
        self.y = min(4, max(0, self.y + dy * action.steps))
        done = (self.x, self.y) == GOAL
        message = f"You are at ({self.x}, {self.y})." + (" You reached the goal." if done else f" Reach {GOAL}.")
        return GridObservation(x=self.x, y=self.y, message=message, done=done, reward=1.0 if done else -0.1)

    @property
    def state(self) -> State:
        return self._state


app = create_app(GridEnvironment, StepAction, GridObservation, env_name="grid")
