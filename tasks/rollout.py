"""Prefect tasks of the rollout flow: collect_trajectories calls as task runs (lanes of groups, or a group each)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import json
import re
import time
import weakref
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Protocol

from prefect import get_client, task
from prefect.cache_policies import NO_CACHE
from prefect.concurrency.asyncio import concurrency
from pydantic import BaseModel, Field, model_validator

from core.scored_group import ScoredGroup
from environments.base import Environment, Item, RolloutFailure
from environments.chat import load_tokenizer
from environments.loading import load_config, load_environment_class
from inference.client import PolicyClient, PolicyServerAuthError, PolicyServerUnreachable


class EnvSpec(BaseModel):
    """Which environment to run, how, and its share of the groups in a mixed run. Checked when
    made: the environment imports, its name is a valid partition and its config validates."""

    import_path: str = Field(
        description="'module.path:ClassName' of an Environment subclass, or the name an installed package gives it."
    )
    config: dict[str, Any] = Field(default_factory=dict, description="The environment's config fields.")
    weight: float = Field(default=1.0, gt=0, description="Relative share of groups in a mixed run.")

    @model_validator(mode="after")
    def _loads(self) -> EnvSpec:
        load_config(load_environment_class(self.import_path), self.config)  # raises naming the field
        return self

    @property
    def key(self) -> str:
        return f"{self.import_path}|{json.dumps(self.config, sort_keys=True)}"


@functools.lru_cache(maxsize=8)
def cached_tokenizer(path: str):
    """Tokenizers are read-only after loading: one per process, shared by every task."""
    return load_tokenizer(path)


def build_environment(spec: EnvSpec, server_url: str, tokenizer: str, api_key: str | None = None) -> Environment:
    env_class = load_environment_class(spec.import_path)
    client = PolicyClient(server_url, api_key=api_key)
    return env_class(load_config(env_class, spec.config), client=client, tokenizer=cached_tokenizer(tokenizer))


# One environment per (spec, server, tokenizer) and event loop: its HTTP client belongs to the loop.
# On the flow's loop (the default) every task run shares one instance and its connections; where a
# task runner gives each run a fresh loop (Dask), entries go away with their loop.
_environments: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple, Environment]]
_environments = weakref.WeakKeyDictionary()


async def environment_for(spec: EnvSpec, server_url: str, tokenizer: str, api_key: str | None = None) -> Environment:
    per_loop = _environments.setdefault(asyncio.get_running_loop(), {})
    key = (spec.key, server_url, tokenizer, api_key)
    if key not in per_loop:
        env = await asyncio.to_thread(
            build_environment, spec, server_url, tokenizer, api_key
        )  # imports, loads a tokenizer
        await env.setup()
        per_loop[key] = env
    return per_loop[key]


# Where a task run on the flow's own event loop hands its results the moment it has them. Prefect
# records the task run Completed before the call returns to the flow; a cancel landing in between
# (Ctrl-C, the UI's Cancel) would otherwise lose groups the UI already shows as finished.
_hand_over: contextvars.ContextVar[Callable[[ScoredGroup | RolloutFailure], None] | None] = contextvars.ContextVar(
    "clotho_hand_over", default=None
)


@contextlib.contextmanager
def hand_over_to(receive: Callable[[ScoredGroup | RolloutFailure], None]) -> Iterator[None]:
    """Task runs started inside this block, where the task runner keeps the context (threads),
    pass their group to `receive` as soon as it is scored, before Prefect finishes the task run."""
    token = _hand_over.set(receive)
    try:
        yield
    finally:
        _hand_over.reset(token)


def _receiver() -> Callable[[ScoredGroup | RolloutFailure], None] | None:
    # A function, not the ContextVar itself, in the task's code: Dask pickles the task function by
    # value and a ContextVar cannot be pickled; this function pickles by reference.
    return _hand_over.get()


def _retry_unless_refused(task, task_run, state) -> bool:
    """Retry an unreachable server; never a refused key (the same key is refused again)."""
    return not isinstance(state.data, PolicyServerAuthError)


class ItemSource(Protocol):
    """What a lane takes its items from (flows.rollout.WeightedItems)."""

    async def next(self) -> tuple[EnvSpec, Item] | None: ...


Store = Callable[[EnvSpec, list[ScoredGroup | RolloutFailure]], Awaitable[None]]


def _lane_run_name(parameters: dict[str, Any]) -> str:
    host = parameters["server_url"].split("://", 1)[-1].strip("/")
    return f"lane {parameters['lane']} @ {host}"


# Both sampling tasks: an unreachable server is retried after a pause, results stay in memory
# (they are the flow's to store), nothing is cached.
SAMPLING_TASK = dict(
    retries=2,
    retry_delay_seconds=[2, 10],
    retry_condition_fn=_retry_unless_refused,
    cache_policy=NO_CACHE,
    persist_result=False,
)


@task(name="sample-lane", task_run_name=_lane_run_name, **SAMPLING_TASK)
async def sample_lane(
    lane: int,
    items: ItemSource,
    store: Store,
    server_url: str,
    tokenizer: str,
    seconds: float = 10.0,
    server_limit: str | None = None,
    api_key: str | None = None,
) -> list[str]:
    """One lane's groups, one after another: items from `items` until about `seconds` of sampling
    passed (at least one group) or the items ran out; each group is stored by `store` the moment
    it is scored, so nothing a task run finished waits for the task run to end. Returns the ids of
    the items it stored, in order.

    Prefect's bookkeeping costs a task run the same whatever it holds: a lane's task run spans
    many short groups, or one group of `seconds` or more. Runs on the flow's event loop (its
    arguments are the flow's own objects). A group whose server is unreachable is recorded as a
    failure and the task run raised, so Prefect retries it after a pause; a refused API key is
    raised without retries; anything else is a recorded RolloutFailure.
    """
    started, stored = time.monotonic(), []
    while not stored or time.monotonic() - started < seconds:
        taken = await items.next()
        if taken is None:
            break
        spec, item = taken
        env = await environment_for(spec, server_url, tokenizer, api_key)
        try:
            async with concurrency(server_limit, occupy=1, strict=True) if server_limit else contextlib.nullcontext():
                result = await env.sample_group(item)
        except PolicyServerUnreachable as error:
            await store(spec, [RolloutFailure.of(env.name, item.id, error)])
            raise
        await store(spec, [result])
        stored.append(item.id)
    return stored


@task(name="sample-item", task_run_name="{spec.import_path}:{item.id}", **SAMPLING_TASK)
async def sample_item(
    spec: EnvSpec,
    item: Item,
    server_url: str,
    tokenizer: str,
    server_limit: str | None = None,
    api_key: str | None = None,
) -> ScoredGroup | RolloutFailure:
    """One item's group, as the task run a flow submits to its task runner (Dask workers, threads).

    An unreachable server is raised so Prefect retries the task with backoff; a refused API key is
    raised without retries; anything else an environment raises becomes a recorded
    RolloutFailure, never a crashed flow. With `server_limit` the group holds a slot of that
    Prefect global concurrency limit while it runs, so every flow and deployment sampling from one
    server shares its capacity. Where the task runner keeps the flow's context (threads), the group
    is also handed to the flow's `hand_over_to` receiver before Prefect finishes the task run.
    """
    env = await environment_for(spec, server_url, tokenizer, api_key)
    async with concurrency(server_limit, occupy=1, strict=True) if server_limit else contextlib.nullcontext():
        result = await env.sample_group(item)
    if (receive := _receiver()) is not None:
        receive(result)
    return result


async def check_servers(servers: list[str], api_key: str | None) -> None:
    """Fails now, naming the server and the option, when a server refuses the key; any other
    failure (unreachable: it may be starting) is left to the task runs' retries."""
    for server in servers:
        async with PolicyClient(server, api_key=api_key, max_retries=0) as client:
            try:
                await client.weight_version()
            except PolicyServerAuthError:
                raise
            except Exception:  # noqa: BLE001 - unreachable for now: groups retry with backoff
                pass


def server_limit_name(server_url: str) -> str:
    """The Prefect global concurrency limit of one policy server, e.g. 'inference-127.0.0.1-8000'."""
    host_port = server_url.split("://", 1)[-1].strip("/").split("/", 1)[0]
    return "inference-" + re.sub(r"[^A-Za-z0-9.-]", "-", host_port)


async def ensure_server_limits(servers: list[str], slots: int) -> dict[str, str]:
    """Creates or resizes one global concurrency limit per server; returns server URL -> limit name."""
    names = {server: server_limit_name(server) for server in servers}
    async with get_client() as client:
        for name in names.values():
            await client.upsert_global_concurrency_limit_by_name(name, slots)
    return names
