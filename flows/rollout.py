"""The rollout flow: items -> task runs in N lanes (N groups in flight) -> shards."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import uuid
from collections.abc import Callable
from typing import Any

import anyio
from prefect import flow, get_run_logger
from prefect.task_runners import ThreadPoolTaskRunner

from core.scored_group import ScoredGroup
from environments.base import Environment, Item, RolloutFailure
from flows.admission import Admission
from flows.group_store import GroupStore, Results
from inference.client import PolicyServerAuthError, PolicyServerUnreachable
from storage.layout import split_run_url
from storage.models import local_model
from tasks.api_key import resolve_api_key
from tasks.rollout import (
    EnvSpec,
    check_servers,
    ensure_server_limits,
    environment_for,
    hand_over_to,
    sample_item,
    sample_lane,
)


@flow(name="rollout", task_runner=ThreadPoolTaskRunner(max_workers=64))
async def rollout(
    environments: list[EnvSpec],
    servers: list[str],
    run_url: str,
    tokenizer: str,
    groups: int | None = 64,
    max_concurrent_groups: int = 8,
    shard_max_groups: int = 64,
    shard_max_age_s: float = 30.0,
    max_lag: int | None = None,
    seed: int = 0,
    task_run_s: float = 10.0,
    distributed: bool = False,
    server_concurrency: int | None = None,
    api_key_secret: str | None = None,
    until_step: int | None = None,
) -> dict[str, Any]:
    """Maps collect_trajectories over the environments' items as Prefect task runs in
    `max_concurrent_groups` lanes, a group sampling in each at all times, and stores every finished
    group in shards.

    environments: mixed by weight. servers: the lanes are spread over them.
    run_url: STORAGE_URL/RUN, where the shards go (and the trainer's checkpoints are read from).
    groups: how many to collect; None runs until cancelled (Ctrl-C, the UI's Cancel), which keeps
    every finished group, once.
    task_run_s: a lane's task run samples groups one after another for about this long, so
    Prefect's per-task-run cost is paid once per this many seconds of sampling, not per group;
    groups longer than that get a task run each (0: always a task run per group).
    distributed: each group is a task run submitted to the flow's task runner (set a
    DaskTaskRunner with `rollout.with_options(task_runner=...)` to spread them over a cluster)
    instead of lanes on the flow's event loop, which share one connection pool.
    server_concurrency: groups in flight per server across every flow that uses it (a Prefect
    global concurrency limit per server, visible and adjustable in the UI's Concurrency page).
    max_lag: bounded staleness k (flows.admission): a group starts sampling only if the
    trainer will train it at most k policy versions after the one it samples with, read from the
    trainer's position (progress/trainer.json) and every sampler's counts; about (k + 1) steps'
    groups then wait unconsumed. None: no bound (collecting data without a trainer).
    until_step: with max_lag, sample only groups that steps up to this one will train, and
    end once the trainer has taken that step's groups (a pipeline phase's last step).
    api_key_secret: name of a Prefect Secret block holding the servers' API key; without it the
    key is $CLOTHO_API_KEY of the flow's process. A refused key stops the flow at once.
    """
    log = get_run_logger()
    storage, run = split_run_url(run_url)
    tokenizer = await asyncio.to_thread(local_model, tokenizer)  # a model in storage: this host's copy
    specs = checked_specs(environments, servers, max_concurrent_groups, server_concurrency, task_run_s)
    api_key = await resolve_api_key(api_key_secret)
    await check_servers(servers, api_key)
    # The flow's own instances hand out items (curriculum, data); its task runs share them: one setup().
    sources = {spec.key: await environment_for(spec, servers[0], tokenizer, api_key) for spec in specs}
    limits = await ensure_server_limits(servers, server_concurrency) if server_concurrency else {}
    async with GroupStore.open(
        storage,
        run,
        sources,
        tokenizer=tokenizer,
        groups=groups,
        shard_max_groups=shard_max_groups,
        shard_max_age_s=shard_max_age_s,
        servers=servers,
        api_key=api_key,
        max_lag=max_lag,
        until_step=until_step,
        sampler=sampler_name(),
        log=log,
    ) as store:
        items = WeightedItems(specs, sources, groups, seed, admission=store.admission, on_gone=store.gone)
        lanes = Lanes(items, store, dict(tokenizer=tokenizer, api_key=api_key), limits, distributed, task_run_s, log)
        task_runs = await lanes.run(servers, max_concurrent_groups)
    summary = await store.report(task_runs)
    log.info("rollout finished: %s", summary["totals"])
    return summary


@dataclasses.dataclass
class Lanes:
    """The flow's lanes: each samples a group at all times, in task runs one after another, until
    the items run out; every finished group goes to the store the moment it is scored."""

    items: WeightedItems
    store: GroupStore
    task: dict[str, Any]  # the collect task's arguments every lane shares (tokenizer, API key)
    limits: dict[str, str]  # each server's global concurrency limit, if any
    distributed: bool  # a task run per group on the flow's task runner, or lanes on this loop
    task_run_s: float
    log: Any

    async def run(self, servers: list[str], count: int) -> int:
        """`count` lanes spread over the servers, beside the writer's aged-shard flush; returns the
        task runs. A failure or a cancel cancels every lane: groups still sampling are abandoned,
        never half-written; finished ones are stored first (GroupStore.store is shielded), then
        the writer's exit flushes them."""
        task_runs: list[int] = []

        async def lane(index: int) -> None:
            task_runs.append(await self.lane(index, servers[index % len(servers)]))

        try:
            async with anyio.create_task_group() as beside:
                beside.start_soon(self.store.flush_aged)
                async with anyio.create_task_group() as lanes:
                    for index in range(count):
                        lanes.start_soon(lane, index)
                beside.cancel_scope.cancel()
        except BaseExceptionGroup as errors:
            raise first_error(errors) from None  # what a lane raised, not the task group's wrapping
        return sum(task_runs)

    async def lane(self, index: int, server: str) -> int:
        """Task runs one after another until the items run out; returns the task runs."""
        task = dict(server_url=server, server_limit=self.limits.get(server), **self.task)
        task_runs = 0
        while not self.items.exhausted:
            try:
                if not self.distributed:
                    await sample_lane(
                        lane=index, items=self.items, store=self.store.store, seconds=self.task_run_s, **task
                    )
                elif not await self.submit_one(task):
                    break
            except PolicyServerAuthError:
                raise  # every group would be refused: stop the flow
            except PolicyServerUnreachable as error:  # retries exhausted; the group is a recorded failure
                self.log.error("lane %d: %s unreachable after retries (%s); going on", index, server, error)
            task_runs += 1
        return task_runs

    async def submit_one(self, task: dict[str, Any]) -> bool:
        """The next item's group as a task run on the flow's task runner; False when the items ran
        out. A cancel still stores the group when it finished (a worker may have told Prefect
        Completed before the flow heard)."""
        taken = await self.items.next()
        if taken is None:
            return False
        spec, item = taken
        handed_over: Results = []
        try:
            with hand_over_to(handed_over.append):
                results = [await on_task_runner(dict(spec=spec, item=item, **task), handed_over)]
        except asyncio.CancelledError:
            if handed_over:
                await self.store.store(spec, handed_over)
            raise
        except PolicyServerUnreachable as error:
            results = [RolloutFailure.of(self.store.stats[spec.key].env, item.id, error)]
        await self.store.store(spec, results)
        return True


class WeightedItems:
    """The run's items, environments picked by weight, until `groups` were handed out (None:
    forever) or every environment ran out. Lanes share it; with an `admission` each item waits
    until a group may start sampling (bounded staleness, flows.admission)."""

    def __init__(
        self,
        specs: list[EnvSpec],
        sources: dict[str, Environment],
        groups: int | None,
        seed: int,
        admission: Admission | None = None,
        on_gone: Callable[[EnvSpec, Exception], None] | None = None,
    ):
        self.sources, self.groups = sources, groups
        self.on_gone = on_gone  # told when an environment's get_item fails (it leaves the stream)
        self.rng = random.Random(seed)
        self.live = list(specs)
        self.handed_out = 0
        self.admission = admission
        self.lock = asyncio.Lock()

    @property
    def exhausted(self) -> bool:
        return not self.live or (self.groups is not None and self.handed_out >= self.groups)

    async def next(self) -> tuple[EnvSpec, Item] | None:
        async with self.lock:
            if self.exhausted:
                return None
            if self.admission is not None and not await self.admission.acquire():
                self.live = []  # the trainer has all it will train
                return None
            while not self.exhausted:
                spec = self.rng.choices(self.live, weights=[s.weight for s in self.live])[0]
                try:
                    item = await self.sources[spec.key].get_item()
                # A service gone, or a get_item bug: that environment leaves, the run goes on.
                except Exception as error:  # noqa: BLE001
                    self.live.remove(spec)
                    if self.on_gone is not None:
                        self.on_gone(spec, error)
                    continue
                if item is None:
                    self.live.remove(spec)
                    continue
                self.handed_out += 1
                return spec, item
            if self.admission is not None:
                self.admission.finished(stored=False)
            return None


async def on_task_runner(task: dict[str, Any], handed_over: Results) -> ScoredGroup | RolloutFailure:
    """A task run submitted to the flow's task runner (e.g. Dask workers). Cancelled, it hands over
    the group of a run that already finished elsewhere; one still queued never starts."""
    future = sample_item.submit(**task)
    try:
        await task_runner_done(future)
    except asyncio.CancelledError:
        if not future.wrapped_future.done():
            future.wrapped_future.cancel()
        elif not handed_over:
            with contextlib.suppress(Exception):
                handed_over.append(future.result(timeout=0))
        raise
    return future.result()


async def task_runner_done(future) -> None:
    """Waits for a task-runner future without parking a thread on it (the default executor has
    only a handful of threads, which would cap the groups in flight)."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def wake() -> None:
        if not done.done():
            done.set_result(None)

    future.add_done_callback(lambda _: loop.call_soon_threadsafe(wake))
    await done


def sampler_name() -> str:
    """This sampler's name in the run's progress: its flow run's id (a restarted flow is a new
    sampler; the old one's committed groups still count)."""
    from prefect.runtime import flow_run

    return str(flow_run.id or "") or uuid.uuid4().hex[:12]


def first_error(errors: BaseExceptionGroup) -> BaseException:
    """The first error in a task group's (nested) exception group: the one that cancelled the rest."""
    while isinstance(errors, BaseExceptionGroup):
        errors = errors.exceptions[0]
    return errors


def checked_specs(
    environments: list[EnvSpec | dict],
    servers: list[str],
    max_concurrent_groups: int,
    server_concurrency: int | None,
    task_run_s: float,
) -> list[EnvSpec]:
    """The flow's arguments checked, each error naming the argument and the fix; the environments as EnvSpecs."""
    if max_concurrent_groups < 1:
        raise ValueError(f"max_concurrent_groups={max_concurrent_groups}: use 1 or more")
    if server_concurrency is not None and server_concurrency < 1:
        raise ValueError(f"server_concurrency={server_concurrency}: use 1 or more, or None for no server limit")
    if not task_run_s >= 0:
        raise ValueError(f"task_run_s={task_run_s}: use seconds >= 0 (0: a task run per group)")
    if not environments or not servers:
        raise ValueError("rollout needs at least one environment and one server URL")
    return [spec if isinstance(spec, EnvSpec) else EnvSpec.model_validate(spec) for spec in environments]
