"""The rollout flow: items -> collect_groups task runs, at most N groups in flight -> shards."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from prefect import flow, get_run_logger
from prefect.task_runners import ThreadPoolTaskRunner

from environments.base import Environment, Item, RolloutFailure
from environments.scored_group import ScoredGroup
from flows.rollout_report import RolloutStats, emit_shard_event, progress_artifact, publish_report
from inference.client import PolicyServerAuthError
from storage.checkpoints import latest_checkpoint
from storage.ledger import Ledger
from storage.reader import ShardReader
from storage.writer import ShardWriter
from tasks.rollout import EnvSpec, check_servers, collect_groups, ensure_server_limits, environment_for, hand_over_to, resolve_api_key

Results = list[ScoredGroup | RolloutFailure]


@flow(name="rollout", task_runner=ThreadPoolTaskRunner(max_workers=64))
async def rollout(
    environments: list[EnvSpec],
    servers: list[str],
    storage: str,
    run: str,
    tokenizer: str,
    groups: int | None = 64,
    max_concurrent_groups: int = 8,
    shard_max_groups: int = 64,
    shard_max_age_s: float = 30.0,
    max_policy_lag: int | None = None,
    seed: int = 0,
    distributed: bool = False,
    server_concurrency: int | None = None,
    groups_per_task: int = 1,
    api_key_secret: str | None = None,
) -> dict[str, Any]:
    """Maps collect_trajectories as Prefect task runs over the environments' items, at most
    `max_concurrent_groups` groups in flight, and stores every finished group in shards.

    environments: mixed by weight; each task run goes to the least busy of `servers`.
    groups: how many to collect; None runs until cancelled (Ctrl-C, the UI's Cancel), which keeps
    every finished group, once.
    groups_per_task: items of one environment per task run (1: a task run is a group in the UI).
    distributed: submit task runs to the flow's task runner (set a DaskTaskRunner with
    `rollout.with_options(task_runner=...)` to spread them over a cluster) instead of awaiting
    them on the flow's event loop, where they share one connection pool.
    server_concurrency: groups in flight per server across every flow that uses it (a Prefect
    global concurrency limit per server, visible and adjustable in the UI's Concurrency page).
    max_policy_lag: wait while the trainer lags more policy versions than this behind the oldest
    shard it has not consumed.
    api_key_secret: name of a Prefect Secret block holding the servers' API key; without it the
    key is $CLOTHO_API_KEY of the flow's process. A refused key stops the flow at once.
    """
    log = get_run_logger()
    check_limits(groups_per_task, max_concurrent_groups, server_concurrency)
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
    progress = await progress_artifact(groups)
    started_at = time.monotonic()

    async with ShardWriter(storage, run, tokenizer=tokenizer, max_groups=shard_max_groups, max_age_s=shard_max_age_s) as writer:

        async def store(spec: EnvSpec, results: Results) -> None:
            for result in results:
                stats[spec.key].add(result)
            scored = [result for result in results if isinstance(result, ScoredGroup)]
            if scored:
                for url in await asyncio.to_thread(writer.add_many, scored):
                    emit_shard_event(url, run, scored[0].env)
            await progress.update(sum(s.groups + s.failures for s in stats.values()))

        async def collect_and_store(spec: EnvSpec, items: list[Item], server: str) -> None:
            """One task run; its finished groups are stored even when a cancel lands meanwhile."""
            task = dict(spec=spec, items=items, server_url=server, tokenizer=tokenizer, server_limit=limits.get(server), api_key=api_key)
            handed_over: Results = []
            try:
                with hand_over_to(handed_over.extend):
                    results = await (submitted(task, handed_over) if distributed else collect_groups(**task))
            except asyncio.CancelledError:
                if handed_over:  # sampled and scored, maybe already Completed in the UI
                    await to_the_end(store(spec, handed_over))
                raise
            except PolicyServerAuthError:
                raise  # every group would be refused: stop the flow
            except Exception as error:  # retries exhausted (server unreachable): recorded failures
                results = [RolloutFailure(env=stats[spec.key].env, item_id=item.id, error=f"{type(error).__name__}: {error}") for item in items]
            await to_the_end(store(spec, results))

        async with InFlight(max_concurrent_groups, servers, writer, run) as in_flight:
            async for spec, items in item_batches(specs, sources, groups, groups_per_task, seed):
                if max_policy_lag is not None:
                    await wait_for_trainer(storage, run, max_policy_lag, poll_s=5.0, log=log)
                server = await in_flight.room_for(len(items))
                in_flight.start(collect_and_store(spec, items, server), server, len(items))
            log.info("all %s groups started; waiting for the last ones", in_flight.groups_started)
    seconds = time.monotonic() - started_at  # running groups and storing them; the report follows
    await progress.close()
    summary = await publish_report(stats, writer.written, seconds, run, storage, in_flight.task_runs)
    log.info("rollout finished: %s", summary["totals"])
    return summary


async def item_batches(
    specs: list[EnvSpec], sources: dict[str, Environment], groups: int | None, per_task: int, seed: int
) -> AsyncIterator[tuple[EnvSpec, list[Item]]]:
    """(environment, items of one task run) until `groups` items were handed out (None: forever)
    or every environment ran out; environments are picked by weight."""
    rng = random.Random(seed)
    live, handed_out = list(specs), 0
    while live and (groups is None or handed_out < groups):
        spec = rng.choices(live, weights=[s.weight for s in live])[0]
        items: list[Item] = []
        wanted = per_task if groups is None else min(per_task, groups - handed_out)
        while len(items) < wanted:
            item = await sources[spec.key].get_item()
            if item is None:
                live.remove(spec)
                break
            items.append(item)
        if items:
            handed_out += len(items)
            yield spec, items


class InFlight:
    """The task runs in flight: at most `limit` groups among them, each task run sent to the least
    busy server. Leaving the block waits for them all; a cancel or failure cancels the rest, and
    every finished group is still stored before the exception goes on."""

    def __init__(self, limit: int, servers: list[str], writer: ShardWriter, run: str):
        self.limit, self.writer, self.run = limit, writer, run
        self.busy = {server: 0 for server in servers}
        self.tasks: dict[asyncio.Task, tuple[str, int]] = {}
        self.task_runs = self.groups_started = 0

    async def room_for(self, groups: int) -> str:
        """Waits until `groups` more fit, flushing aged shards meanwhile; returns the server. A task
        run that failed (storage down, a refused key) stops the flow here, never silently."""
        while sum(self.busy.values()) + groups > self.limit:
            done, _ = await asyncio.wait(self.tasks, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                self._finished(task).result()
            for url in await asyncio.to_thread(self.writer.flush_if_due):
                emit_shard_event(url, self.run, None)
        return min(self.busy, key=self.busy.__getitem__)

    def start(self, work: Awaitable[None], server: str, groups: int) -> None:
        self.busy[server] += groups
        self.tasks[asyncio.ensure_future(work)] = (server, groups)
        self.task_runs += 1
        self.groups_started += groups

    def _finished(self, task: asyncio.Task) -> asyncio.Task:
        server, groups = self.tasks.pop(task)
        self.busy[server] -= groups
        return task

    async def __aenter__(self) -> InFlight:
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                for task in asyncio.as_completed(list(self.tasks)):
                    await task
        finally:
            # Cancelled (UI, Ctrl-C) or failed: groups still sampling are abandoned, never
            # half-written; finished ones are stored first (a second cancel cannot cut that short),
            # then the writer's exit flushes them.
            for task in self.tasks:
                task.cancel()
            await to_the_end(asyncio.gather(*self.tasks, return_exceptions=True))


async def submitted(task: dict[str, Any], handed_over: Results) -> Results:
    """A task run submitted to the flow's task runner (e.g. Dask workers). Cancelled, it hands over
    the groups of a run that already finished elsewhere; one still queued never starts."""
    future = collect_groups.submit(**task)
    try:
        await settled(future)
    except asyncio.CancelledError:
        if not future.wrapped_future.done():
            future.wrapped_future.cancel()
        elif not handed_over:
            with contextlib.suppress(Exception):
                handed_over.extend(future.result(timeout=0))
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


def check_limits(groups_per_task: int, max_concurrent_groups: int, server_concurrency: int | None) -> None:
    if max_concurrent_groups < 1:
        raise ValueError(f"max_concurrent_groups={max_concurrent_groups}: use 1 or more")
    if server_concurrency is not None and server_concurrency < 1:
        raise ValueError(f"server_concurrency={server_concurrency}: use 1 or more, or None for no server limit")
    if not 1 <= groups_per_task <= max_concurrent_groups:
        raise ValueError(f"groups_per_task={groups_per_task}: use 1..max_concurrent_groups ({max_concurrent_groups})")
    if server_concurrency is not None and groups_per_task > server_concurrency:
        raise ValueError(
            f"groups_per_task={groups_per_task} exceeds server_concurrency={server_concurrency}: a task run "
            "holds a slot per group, so it could never start; lower groups_per_task or raise server_concurrency"
        )


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
