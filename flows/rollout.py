"""The rollout flow: items -> task runs in N lanes (N groups in flight) -> shards."""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

from prefect import flow, get_run_logger
from prefect.task_runners import ThreadPoolTaskRunner

from environments.base import Environment, Item, RolloutFailure
from environments.scored_group import ScoredGroup
from flows.rollout_report import RolloutStats, emit_shard_event, progress_artifact, publish_report
from inference.client import PolicyServerAuthError, PolicyServerUnreachable
from storage.checkpoints import latest_checkpoint
from storage.ledger import Ledger
from storage.reader import ShardReader
from storage.writer import ShardWriter
from storage.layout import split_run_url
from tasks.api_key import resolve_api_key
from tasks.rollout import EnvSpec, check_servers, collect_lane, collect_one, ensure_server_limits, environment_for, hand_over_to

Results = list[ScoredGroup | RolloutFailure]


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
    max_policy_lag: int | None = None,
    seed: int = 0,
    task_run_s: float = 10.0,
    distributed: bool = False,
    server_concurrency: int | None = None,
    api_key_secret: str | None = None,
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
    max_policy_lag: hand out no item while the trainer lags more policy versions than this behind
    the oldest shard it has not consumed.
    api_key_secret: name of a Prefect Secret block holding the servers' API key; without it the
    key is $CLOTHO_API_KEY of the flow's process. A refused key stops the flow at once.
    """
    log = get_run_logger()
    storage, run = split_run_url(run_url)
    check_limits(max_concurrent_groups, server_concurrency, task_run_s)
    if not environments or not servers:
        raise ValueError("rollout needs at least one environment and one server URL")
    specs = [spec if isinstance(spec, EnvSpec) else EnvSpec.model_validate(spec) for spec in environments]
    api_key = await resolve_api_key(api_key_secret)
    await check_servers(servers, api_key)
    # The flow's own instances hand out items (they own curriculum and data); on this loop the
    # task runs share them, so setup() runs once.
    sources = {spec.key: await environment_for(spec, servers[0], tokenizer, api_key) for spec in specs}
    stats = {spec.key: RolloutStats(env=sources[spec.key].name) for spec in specs}
    limits = await ensure_server_limits(servers, server_concurrency) if server_concurrency else {}
    lag = (lambda: wait_for_trainer(storage, run, max_policy_lag, poll_s=5.0, log=log)) if max_policy_lag is not None else None
    items = ItemStream(specs, sources, groups, seed, wait_for_trainer=lag)
    progress = await progress_artifact(groups)
    started_at = time.monotonic()

    async with ShardWriter(storage, run, tokenizer=tokenizer, max_groups=shard_max_groups, max_age_s=shard_max_age_s) as writer:

        async def store(spec: EnvSpec, results: Results) -> None:
            """Counts and buffers finished groups; a cancel cannot cut it short."""

            async def counted() -> None:
                for result in results:
                    stats[spec.key].add(result)
                scored = [result for result in results if isinstance(result, ScoredGroup)]
                if scored:
                    for url in await asyncio.to_thread(writer.add_many, scored):
                        emit_shard_event(url, run, scored[0].env)
                await progress.update(sum(s.groups + s.failures for s in stats.values()))

            await to_the_end(counted())

        async def lane(index: int, server: str) -> int:
            """Task runs one after another until the items run out; returns the task runs."""
            task_runs = 0
            task = dict(server_url=server, tokenizer=tokenizer, server_limit=limits.get(server), api_key=api_key)
            while not items.exhausted:
                try:
                    if distributed:
                        taken = await items.next()
                        if taken is None:
                            break
                        await submit_and_store(*taken, task)
                    else:
                        await collect_lane(lane=index, items=items, store=store, seconds=task_run_s, **task)
                except PolicyServerAuthError:
                    raise  # every group would be refused: stop the flow
                except PolicyServerUnreachable as error:  # retries exhausted; the group is a recorded failure
                    log.error("lane %d: %s unreachable after retries (%s); going on", index, server, error)
                task_runs += 1
            return task_runs

        async def submit_and_store(spec: EnvSpec, item: Item, task: dict[str, Any]) -> None:
            """One group as a task run on the flow's task runner; a cancel still stores it when it
            finished (a worker may have told Prefect Completed before the flow heard)."""
            handed_over: Results = []
            try:
                with hand_over_to(handed_over.append):
                    results = [await submitted(dict(spec=spec, item=item, **task), handed_over)]
            except asyncio.CancelledError:
                if handed_over:
                    await store(spec, handed_over)
                raise
            except PolicyServerUnreachable as error:
                results = [RolloutFailure.of(stats[spec.key].env, item.id, error)]
            await store(spec, results)

        lanes = [lane(index, servers[index % len(servers)]) for index in range(max_concurrent_groups)]
        task_runs = sum(await all_or_none(lanes, flush_aged_shards(writer, run)))
    seconds = time.monotonic() - started_at  # running groups and storing them; the report follows
    await progress.close()
    summary = await publish_report(stats, writer.written, seconds, run, storage, task_runs)
    log.info("rollout finished: %s", summary["totals"])
    return summary


class ItemStream:
    """The run's items, environments picked by weight, until `groups` were handed out (None:
    forever) or every environment ran out. Lanes share it; with `wait_for_trainer` it holds every
    lane back while the trainer lags too far (checked at most every LAG_CHECK_S)."""

    LAG_CHECK_S = 5.0

    def __init__(self, specs: list[EnvSpec], sources: dict[str, Environment], groups: int | None, seed: int,
                 wait_for_trainer: Callable[[], Awaitable[None]] | None = None):  # fmt: skip
        self.sources, self.groups = sources, groups
        self.rng = random.Random(seed)
        self.live = list(specs)
        self.handed_out = 0
        self.wait_for_trainer = wait_for_trainer
        self.lag_checked_at = -math.inf
        self.lock = asyncio.Lock()

    @property
    def exhausted(self) -> bool:
        return not self.live or (self.groups is not None and self.handed_out >= self.groups)

    async def next(self) -> tuple[EnvSpec, Item] | None:
        async with self.lock:
            if self.exhausted:
                return None
            if self.wait_for_trainer is not None and time.monotonic() - self.lag_checked_at >= self.LAG_CHECK_S:
                await self.wait_for_trainer()
                self.lag_checked_at = time.monotonic()
            while not self.exhausted:
                spec = self.rng.choices(self.live, weights=[s.weight for s in self.live])[0]
                item = await self.sources[spec.key].get_item()
                if item is None:
                    self.live.remove(spec)
                    continue
                self.handed_out += 1
                return spec, item
            return None


async def all_or_none(lanes: list[Awaitable[int]], background: Awaitable[None]) -> list[int]:
    """Runs the lanes to their end beside a background task. A failure or a cancel cancels every
    lane: groups still sampling are abandoned, never half-written; finished ones are stored first
    (store() runs to its end), then the writer's exit flushes them."""
    tasks = [asyncio.ensure_future(lane) for lane in lanes]
    helper = asyncio.ensure_future(background)
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in [*tasks, helper]:
            task.cancel()
        await to_the_end(asyncio.gather(*tasks, helper, return_exceptions=True))


async def flush_aged_shards(writer: ShardWriter, run: str) -> None:
    """Writes a shard once its oldest group reached the writer's max age, also while no group ends."""
    while True:
        await asyncio.sleep(1.0)
        if writer.due():
            for url in await asyncio.to_thread(writer.flush_if_due):
                emit_shard_event(url, run, None)


async def submitted(task: dict[str, Any], handed_over: Results) -> ScoredGroup | RolloutFailure:
    """A task run submitted to the flow's task runner (e.g. Dask workers). Cancelled, it hands over
    the group of a run that already finished elsewhere; one still queued never starts."""
    future = collect_one.submit(**task)
    try:
        await settled(future)
    except asyncio.CancelledError:
        if not future.wrapped_future.done():
            future.wrapped_future.cancel()
        elif not handed_over:
            with contextlib.suppress(Exception):
                handed_over.append(future.result(timeout=0))
        raise
    return future.result()


async def settled(future) -> None:
    """Waits for a task-runner future without parking a thread on it (the default executor has
    only a handful of threads, which would cap the groups in flight)."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def wake() -> None:
        if not done.done():
            done.set_result(None)

    future.add_done_callback(lambda _: loop.call_soon_threadsafe(wake))
    await done


async def to_the_end(awaitable):
    """Awaits `awaitable` to completion even if the caller is cancelled meanwhile, then passes the
    cancel on: storing groups that already finished must not be cut short by Ctrl-C."""
    task = asyncio.ensure_future(awaitable)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.done():
                raise  # the awaitable itself was cancelled
            cancelled = True
            continue
        if cancelled:
            raise asyncio.CancelledError
        return result


def check_limits(max_concurrent_groups: int, server_concurrency: int | None, task_run_s: float) -> None:
    if max_concurrent_groups < 1:
        raise ValueError(f"max_concurrent_groups={max_concurrent_groups}: use 1 or more")
    if server_concurrency is not None and server_concurrency < 1:
        raise ValueError(f"server_concurrency={server_concurrency}: use 1 or more, or None for no server limit")
    if not task_run_s >= 0:
        raise ValueError(f"task_run_s={task_run_s}: use seconds >= 0 (0: a task run per group)")


async def wait_for_trainer(storage: str, run: str, max_policy_lag: int, poll_s: float, log) -> None:
    """Back-pressure: while the oldest shard the trainer has not consumed was sampled more than
    max_policy_lag versions before the newest checkpoint, new groups would only pile up stale data."""
    while True:
        checkpoint = await asyncio.to_thread(latest_checkpoint, storage, run)
        if checkpoint is None:
            return
        ledger = Ledger.from_dict(checkpoint.manifest.get("ledger") or {})
        reader = ShardReader(storage, run, ledger=ledger)
        pending = await asyncio.to_thread(reader.new_shards)
        if not pending:
            return
        oldest = min(shard.policy_version for shard in pending)
        if checkpoint.policy_version - oldest <= max_policy_lag:
            return
        log.info(
            "waiting for the trainer: checkpoint %d, oldest unconsumed shard from policy %d (max lag %d)",
            checkpoint.policy_version, oldest, max_policy_lag,
        )  # fmt: skip
        await asyncio.sleep(poll_s)
