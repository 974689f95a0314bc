"""OpenEnv environments as a clotho environment: any OpenEnv Environment class or server, played by
the policy turn by turn into one token-exact sequence per episode.

    clotho env serve environments.adapters.openenv:OpenEnv      (from .venv-env-openenv)
    config {"environment": "my_env.server.my_environment:MyEnvironment"}   in process
    config {"environment": "http://127.0.0.1:8000"}                        an OpenEnv server

How an episode becomes a sequence:
- An item is one seed; its group is group_size episodes, each reset with that seed (`reset(seed,
  episode_id)`), so the group's sequences start from the same state and compare fairly.
- Every observation is a user turn: `render(observation)` of its fields as OpenEnv's server sends
  them (serialize_observation: reward, done and metadata apart). In process the adapter serializes
  the same way, so one render function serves both modes; metadata never leaves an OpenEnv server,
  so render does not see it in either.
- Every policy turn is sampled from the exact ids so far (ChatSession: sampled ids trained,
  observations untrained); `parse(text)` makes it the action that `step` takes. The episode ends
  when an observation says done, or after max_turns actions; the sequence ends on the model's own
  last token, the observation after the last action is never shown to it.

Rewards: each step's reward is kept on the assistant message whose action earned it (its "reward"
key), and the score is the return sum(discount**t * reward_t). `reward(item, messages)` computes it
from those messages: an OpenEnv reward comes out of the environment's state, which the text alone
cannot replay, so the conversation carries what the environment said, and the conformance check,
`clotho reprocess ... rescore` (with another discount, say) and this adapter all read the same
numbers.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
import random
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, get_type_hints

import httpx
from openenv.core.client_types import StepResult
from openenv.core.env_server.interfaces import Environment as OpenEnvEnvironment
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction
from openenv.core.env_server.serialization import deserialize_action, serialize_observation
from openenv.core.env_server.types import Action
from openenv.core.generic_client import GenericEnvClient
from pydantic import Field, ValidationError
from websockets.exceptions import ConnectionClosedOK

from core.imports import load_attribute
from core.scored_group import ScoredGroup, ScoredSequence
from environments.adapters.openenv_session import Capacity, SchemaAction, server_error
from environments.base import Environment, EnvironmentConfig, Item, prompt_messages
from environments.chat import ChatSession, Messages

URL_SCHEMES = ("http://", "https://", "ws://", "wss://")
log = logging.getLogger(__name__)


class OpenEnvConfig(EnvironmentConfig):
    environment: str = Field(
        description="The OpenEnv environment: the import path 'module:Class' of an Environment subclass "
        "(one instance per episode, in this process) or the URL of an OpenEnv server (one WebSocket "
        "session per episode, through OpenEnv's GenericEnvClient)."
    )
    parse: str | None = Field(
        default=None,
        description="Import path of parse(text) -> Action or dict: the policy's turn as the action. "
        "Default: from the action's JSON schema (the class step() is annotated with, or a server's /schema): "
        "an action of one string field takes the whole text; any other, the first JSON object in the text "
        "(or, for one field, the bare value), with the schema in a system message. Without a schema: the "
        "whole text as `message`.",
    )
    render: str | None = Field(
        default=None,
        description="Import path of render(observation: dict) -> str: an observation's fields as the user "
        "turn. Default: its text fields (names with 'text' or 'message'), one per line.",
    )
    system_prompt: str | None = Field(
        default=None, description="A system message before the first observation, e.g. the action format."
    )
    max_turns: int = Field(default=4, ge=1, description="Most actions per episode; one not done by then is cut.")
    discount: float = Field(
        default=1.0, ge=0.0, le=1.0, description="The score is sum(discount**t * reward_t); 1.0 sums the rewards."
    )
    max_concurrent_episodes: int | None = Field(
        default=None,
        ge=1,
        description="Most episodes open at once. None: as many as the environment takes; an OpenEnv server "
        "that refuses a session for capacity (max_concurrent_envs, 1 in `openenv init`'s app) sets the limit "
        "to its own, and the refused episode waits for a slot.",
    )


def message_action(text: str) -> dict[str, Any]:
    """The parse without a schema: the whole text as the action's `message`."""
    return {"message": text}


def text_fields(observation: dict[str, Any]) -> str:
    """The default render: a tool call's result (or error) for an MCP environment's observation;
    else the observation's string fields named with 'text' or 'message', in field order, one per
    line; the whole observation as JSON when it has none."""
    if "tool_name" in observation and ("result" in observation or "error" in observation):
        shown = observation.get("error") or observation.get("result")
        return shown if isinstance(shown, str) else json.dumps(shown, sort_keys=True, default=str)
    texts = [
        value for name, value in observation.items() if isinstance(value, str) and ("text" in name or "message" in name)
    ]
    return "\n".join(texts) if texts else json.dumps(observation, sort_keys=True)


def accepted(method: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments `method` takes (OpenEnv's server filters reset's the same way, so an
    environment whose reset takes no seed still resets)."""
    parameters = inspect.signature(method).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return kwargs
    return {name: value for name, value in kwargs.items() if name in parameters}


def as_step_result(payload: dict[str, Any]) -> StepResult[dict[str, Any]]:
    return StepResult(
        observation=payload.get("observation", {}), reward=payload.get("reward"), done=bool(payload.get("done"))
    )


def annotated_action(env_class: type[OpenEnvEnvironment]) -> type[Action] | None:
    """The Action subclass the class's `step` is annotated with, if any."""
    try:
        found = get_type_hints(env_class.step).get("action")
    except Exception:  # noqa: BLE001 - an annotation that does not resolve names no class either
        found = None
    return found if isinstance(found, type) and issubclass(found, Action) and found is not Action else None


def is_mcp(env_class: type[OpenEnvEnvironment]) -> bool:
    """An MCP environment: its actions are tool calls (CallToolAction), step not annotated."""
    return issubclass(env_class, MCPEnvironment) and annotated_action(env_class) is None


class InProcessEpisode:
    """One instance of an OpenEnv Environment class, on a thread of its own: as OpenEnv's server
    runs a session, a synchronous environment neither blocks the event loop nor changes threads,
    and one that overrides reset_async/step_async is awaited instead."""

    def __init__(self, env_class: type[OpenEnvEnvironment]):
        self.env_class = env_class
        self.executor = ThreadPoolExecutor(max_workers=1)
        self.env: OpenEnvEnvironment | None = None

    async def run(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(
            self.executor, functools.partial(function, *args, **kwargs)
        )

    def overrides(self, name: str) -> bool:
        return getattr(self.env_class, name) is not getattr(OpenEnvEnvironment, name)

    async def reset(self, **kwargs: Any) -> StepResult[dict[str, Any]]:
        self.env = await self.run(self.env_class)
        if self.overrides("reset_async"):
            observation = await self.env.reset_async(**accepted(self.env.reset_async, kwargs))
        else:
            observation = await self.run(self.env.reset, **accepted(self.env.reset, kwargs))
        return as_step_result(serialize_observation(observation))

    async def step(self, action: Action | dict[str, Any]) -> StepResult[dict[str, Any]]:
        if isinstance(action, dict):  # an MCP environment's tool calls and listings as OpenEnv's server reads them
            action = deserialize_action(action, Action if is_mcp(self.env_class) else self.action_class())
        if self.overrides("step_async"):
            observation = await self.env.step_async(action)
        else:
            observation = await self.run(self.env.step, action)
        return as_step_result(serialize_observation(observation))

    def action_class(self) -> type[Action]:
        """The Action subclass `step` is annotated with, for a parse that returns a dict."""
        found = annotated_action(self.env_class)
        if found is None:
            raise TypeError(
                f"parse returned a dict, but {self.env_class.__name__}.step(action) is annotated with "
                f"{found!r}, not an Action subclass; annotate it or give a parse that returns the Action"
            )
        return found

    async def close(self) -> None:
        try:
            if self.env is not None:
                await self.run(self.env.close)
        finally:
            self.executor.shutdown(wait=False)


class ServerEpisode:
    """One session of an OpenEnv server, through OpenEnv's own GenericEnvClient (plain dicts: no
    package of the environment's is needed on this side; an Action is sent as its model_dump)."""

    def __init__(self, url: str):
        self.client = GenericEnvClient(base_url=url)

    async def reset(self, **kwargs: Any) -> StepResult[dict[str, Any]]:
        return await self.client.reset(**kwargs)

    async def step(self, action: Action | dict[str, Any]) -> StepResult[dict[str, Any]]:
        return await self.client.step(action)

    async def close(self) -> None:
        await self.client.close()


class OpenEnv(Environment):
    """An OpenEnv environment, one episode per sequence; see the module docstring."""

    name = "openenv"
    config_class = OpenEnvConfig

    async def setup(self) -> None:
        config = self.config
        self.rng = random.Random(config.seed)
        self.count = 0
        self.render: Callable[[dict[str, Any]], str] = (
            load_attribute(config.render, "render") if config.render else text_fields
        )
        self.capacity = Capacity(config.max_concurrent_episodes)
        if config.environment.startswith(URL_SCHEMES):
            self.env_class = None
            schema = await self.check_server(config.environment)
        else:
            self.env_class = load_attribute(config.environment, "environment")
            if not (isinstance(self.env_class, type) and issubclass(self.env_class, OpenEnvEnvironment)):
                raise ValueError(
                    f"environment {config.environment!r} is not an OpenEnv Environment subclass "
                    "(openenv.core.env_server.interfaces.Environment); name the class, or an OpenEnv server's URL"
                )
            action = CallToolAction if is_mcp(self.env_class) else annotated_action(self.env_class)
            schema = action.model_json_schema() if action is not None else None
        # An MCP environment's action is a tool call: its tools are listed to the policy each episode.
        self.mcp = bool(schema) and {"tool_name", "arguments"} <= set(schema.get("properties", {}))
        self.schema_action = SchemaAction(schema) if schema and not config.parse else None
        self.parse: Callable[[str], Action | dict[str, Any]] = (
            load_attribute(config.parse, "parse") if config.parse else self.schema_action or message_action
        )

    async def check_server(self, url: str) -> dict[str, Any] | None:
        """GET /health, then the action's JSON schema from /schema (None where it has none)."""
        if not url.startswith(("http://", "https://")):
            return None  # a ws:// URL: the first episode's connection says whether it answers
        try:
            async with httpx.AsyncClient(timeout=10.0) as http:
                (await http.get(url.rstrip("/") + "/health")).raise_for_status()
                schema = await http.get(url.rstrip("/") + "/schema")
        except httpx.HTTPError as error:
            raise ConnectionError(f"OpenEnv server {url}: GET /health failed ({error!r}); is it running?") from None
        return schema.json().get("action") if schema.status_code == 200 else None

    async def get_item(self) -> Item:
        self.count += 1
        system = self.config.system_prompt or (self.schema_action.instructions() if self.schema_action else None)
        prompt = [{"role": "system", "content": system}] if system else []
        return Item(id=f"{self.config.seed}-{self.count}", prompt=prompt, extras={"seed": self.rng.randrange(2**31)})

    def reward(self, item: Item, messages: Messages) -> float:
        """The episode's return: the rewards stored on its assistant messages, discounted by turn."""
        actions = [message for message in messages if message.get("role") == "assistant"]
        return sum(
            self.config.discount**turn * float(message.get("reward") or 0.0) for turn, message in enumerate(actions)
        )

    async def collect_trajectories(self, item: Item) -> ScoredGroup:
        sequences, errors = await self.gather_sequences([self.episode(item) for _ in range(self.config.group_size)])
        return self.make_group(item, sequences, errors=errors)

    # ---- one episode ---------------------------------------------------------------------------
    def observation_message(self, result: StepResult[dict[str, Any]]) -> dict[str, str]:
        content = self.render(result.observation)
        if not isinstance(content, str):
            raise TypeError(f"render returned {type(content).__name__}; return the user turn's text (str)")
        return {"role": "user", "content": content}

    async def episode(self, item: Item) -> ScoredSequence:
        episode_id = f"{item.id}-{uuid.uuid4().hex[:8]}"
        wait, refusals = 0.05, 0
        while True:  # a server at capacity: wait for a slot of the (learned) limit, then again
            async with self.capacity.slot():
                episode = (
                    ServerEpisode(self.config.environment)
                    if self.env_class is None
                    else InProcessEpisode(self.env_class)
                )
                try:
                    result = await episode.reset(seed=item.extras["seed"], episode_id=episode_id)
                except Exception as error:
                    await self.close(episode)
                    # A full server answers CAPACITY_REACHED and closes; the close can come first.
                    refused = server_error(error) or (
                        ("CAPACITY_REACHED", "") if isinstance(error, ConnectionClosedOK) else None
                    )
                    if refused is None or refused[0] != "CAPACITY_REACHED":
                        raise
                    self.capacity.refused(refused[1])
                    refusals += 1
                else:
                    try:
                        session, ended = await self.run_episode(episode, item, episode_id, result)
                    finally:
                        await self.close(episode)
                    break
            await asyncio.sleep(wait)
            wait = min(2 * wait, 1.0)
        extras = {"turns": session.trajectory.turns, "episode_id": episode_id, **ended}
        if refusals:
            extras["capacity_refusals"] = refusals  # the server was full; the episode waited for a session
        return session.to_sequence(self.reward(item, session.messages), extras=extras)

    async def tools_text(self, episode: InProcessEpisode | ServerEpisode) -> str:
        """The MCP environment's tools (OpenEnv's ListToolsAction), for the policy to call by name."""
        listed = await episode.step({"type": "list_tools"})
        lines = [
            f"- {tool.get('name')}({json.dumps(tool.get('input_schema') or tool.get('inputSchema') or {}, sort_keys=True)}): "
            f"{(tool.get('description') or '').strip().splitlines()[0] if tool.get('description') else ''}"
            for tool in listed.observation.get("tools", [])
        ]
        return "Tools you can call (tool_name, arguments):\n" + "\n".join(lines)

    async def close(self, episode: InProcessEpisode | ServerEpisode) -> None:
        """Closing an episode that is over is not part of it: a failure there is logged, not raised."""
        try:
            await episode.close()
        except Exception as error:  # noqa: BLE001 - the episode is over; its close may fail any way
            log.warning("closing an OpenEnv episode: %s: %s", type(error).__name__, error)

    async def run_episode(
        self, episode: InProcessEpisode | ServerEpisode, item: Item, episode_id: str, result: StepResult[dict[str, Any]]
    ) -> tuple[ChatSession, dict[str, Any]]:
        """The episode from its reset: an action per turn until the environment is done, max_turns,
        an action the environment refuses (invalid: the episode ends there, that turn earning
        nothing), or the server closing the session (its normal end of an episode)."""
        if result.done:
            raise RuntimeError(
                f"episode {episode_id}: the environment was done at reset (seed {item.extras['seed']}); no action to sample"
            )
        first = self.observation_message(result)
        if self.mcp and not self.config.parse:
            first["content"] += "\n\n" + await self.tools_text(episode)
        session = self.chat(prompt_messages(item) + [first])
        for turn in range(self.config.max_turns):
            await session.sample(self.client, **self.sampling())
            try:
                result = await episode.step(self.parse(session.messages[-1]["content"]))
            except ValidationError as error:  # in process: the action model refused the parsed fields
                session.messages[-1]["reward"] = 0.0
                return session, {
                    "done": False,
                    "invalid_action": f"{error.error_count()} errors: {error.errors()[0]['msg']}",
                }
            except RuntimeError as error:
                answered = server_error(error)
                if answered is None or answered[0] != "VALIDATION_ERROR":
                    raise
                session.messages[-1]["reward"] = 0.0
                return session, {"done": False, "invalid_action": answered[1]}
            except ConnectionClosedOK:  # the server ended the session: the episode's end, not a failure
                session.messages[-1]["reward"] = 0.0
                return session, {"done": True, "closed_by_server": True}
            session.messages[-1]["reward"] = float(result.reward or 0.0)  # what this action earned
            if result.done or turn == self.config.max_turns - 1:
                break
            session.add_messages([self.observation_message(result)])
        return session, {"done": result.done}
