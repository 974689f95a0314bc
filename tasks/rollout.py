"""Prefect tasks of the rollout flow: collect_trajectories calls as task runs (one or more items each)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import json
import re
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from prefect import get_client, task
from prefect.concurrency.asyncio import concurrency
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, Field

from environments.base import Environment, Item, RolloutFailure, load_environment_class
from environments.chat import load_tokenizer
from environments.scored_group import ScoredGroup
from inference.client import PolicyClient


class EnvSpec(BaseModel):
    """Which environment to run, how, and its share of the groups in a mixed run."""

    import_path: str = Field(description="'module.path:ClassName' of an Environment subclass.")
    config: dict[str, Any] = Field(default_factory=dict, description="The environment's config fields.")
    weight: float = Field(default=1.0, gt=0, description="Relative share of groups in a mixed run.")

    @property
    def key(self) -> str:
        return f"{self.import_path}|{json.dumps(self.config, sort_keys=True)}"


@functools.lru_cache(maxsize=8)
def cached_tokenizer(path: str):
    """Tokenizers are read-only after loading: one per process, shared by every task."""
    return load_tokenizer(path)


def build_environment(spec: EnvSpec, server_url: str, tokenizer: str) -> Environment:
    env_class = load_environment_class(spec.import_path)
    return env_class(spec.config, client=PolicyClient(server_url), tokenizer=cached_tokenizer(tokenizer))


# One environment per (spec, server, tokenizer) and event loop: its HTTP client belongs to the loop.
# On the flow's loop (the default) every task run shares one instance and its connections; where a
# task runner gives each run a fresh loop (Dask), entries go away with their loop.
_environments: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[str, str, str], Environment]]
_environments = weakref.WeakKeyDictionary()


async def environment_for(spec: EnvSpec, server_url: str, tokenizer: str) -> Environment:
    per_loop = _environments.setdefault(asyncio.get_running_loop(), {})
    key = (spec.key, server_url, tokenizer)
    if key not in per_loop:
        env = build_environment(spec, server_url, tokenizer)
        await env.setup()
        per_loop[key] = env
    return per_loop[key]


# Where a task run on the flow's own event loop hands its results the moment it has them. Prefect
# records the task run Completed before the call returns to the flow; a cancel landing in between
# (Ctrl-C, the UI's Cancel) would otherwise lose groups the UI already shows as finished.
_hand_over: contextvars.ContextVar[Callable[[list], None] | None] = contextvars.ContextVar(
    "clotho_hand_over", default=None
)


@contextlib.contextmanager
def _set_within(var: contextvars.ContextVar, value: Any) -> Iterator[None]:
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def hand_over_to(receive: Callable[[list], None]) -> contextlib.AbstractContextManager[None]:
    """Task runs awaited inside this block (same event loop) pass their results to `receive` as
    soon as sampling and scoring finish, before Prefect finishes the task run."""
    return _set_within(_hand_over, receive)


def _receiver() -> Callable[[list], None] | None:
    # A function, not the ContextVar itself, in the task's code: Dask pickles the task function by
    # value and a ContextVar cannot be pickled; this function pickles by reference.
    return _hand_over.get()


# Where a task run on the flow's own event loop takes a slot for each of its groups: a group samples
# only while it holds one of the flow's max_concurrent_groups slots, and gives it back the moment its
# sampling and scoring end. The flow starts task runs ahead of free slots, so a task run's start
# (Prefect's bookkeeping) overlaps other groups' sampling and a slot never waits for it; a task run
# of several items never holds idle slots for items still waiting or already done.
_slot: contextvars.ContextVar[Callable[[], contextlib.AbstractAsyncContextManager] | None] = contextvars.ContextVar(
    "clotho_slot", default=None
)


def slots_from(slot: Callable[[], contextlib.AbstractAsyncContextManager]) -> contextlib.AbstractContextManager[None]:
    """Task runs awaited inside this block hold `slot()` around each group they sample."""
    return _set_within(_slot, slot)


def _slot_maker() -> Callable[[], contextlib.AbstractAsyncContextManager] | None:
    return _slot.get()  # a function for Dask's pickling, as _receiver


def _task_run_name(parameters: dict[str, Any]) -> str:
    """'environments.arithmetic:Arithmetic:0-17', or '...:0-17 +3' for a task run of 4 groups."""
    items = parameters["items"]
    more = f" +{len(items) - 1}" if len(items) > 1 else ""
    return f"{parameters['spec'].import_path}:{items[0].id}{more}"


@task(
    name="collect-groups",
    task_run_name=_task_run_name,
    retries=2,
    retry_delay_seconds=[2, 10],
    cache_policy=NO_CACHE,
    persist_result=False,
)
async def collect_groups(
    spec: EnvSpec, items: list[Item], server_url: str, tokenizer: str, server_limit: str | None = None
) -> list[ScoredGroup | RolloutFailure]:
    """Inference and scoring of each item into one group; the items' groups are sampled concurrently.

    How many items a task run takes is the flow's choice (flows.rollout.TaskRunSizer): one each for
    groups that sample for 10 s or more, so a task run is a group in the UI; several for shorter
    groups, which divide Prefect's per-task cost (flows.rollout.AUTO_TASK_RUN_GROUP_SECONDS gives it)
    among them.

    An unreachable server is raised so Prefect retries the task with backoff; anything else an
    environment raises becomes a recorded RolloutFailure, never a crashed flow. With `server_limit`
    each group holds a slot of that Prefect global concurrency limit while it runs, so every flow
    and deployment sampling from one server shares its capacity.
    """
    env = await environment_for(spec, server_url, tokenizer)

    slot = _slot_maker()

    async def one(item: Item) -> ScoredGroup | RolloutFailure:
        async with slot() if slot is not None else contextlib.nullcontext():
            return await env.safe_collect(item)

    async def collect() -> list[ScoredGroup | RolloutFailure]:
        results = await asyncio.gather(*(one(item) for item in items), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result  # the server is unreachable: retry the task run
        if (receive := _receiver()) is not None:
            receive(list(results))
        return list(results)

    if server_limit is None:
        return await collect()
    async with concurrency(server_limit, occupy=len(items), strict=True):
        return await collect()


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
