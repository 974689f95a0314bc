"""The rollout flow: items -> task runs in N lanes (N groups in flight) -> shards."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from prefect import flow, get_run_logger
from prefect.task_runners import ThreadPoolTaskRunner

from environments.base import Environment, Item, RolloutFailure
from core.scored_group import ScoredGroup
from flows.admission import Admission
from flows.rollout_report import RolloutStats, emit_shard_event, progress_artifact, publish_report, stats_card, stats_table
from inference.client import PolicyClient, PolicyServerAuthError, PolicyServerUnreachable
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
    max_policy_lag: bounded staleness k (flows.admission): a group starts sampling only if the
    trainer will train it at most k policy versions after the one it samples with, read from the
    trainer's position (progress/trainer.json) and every sampler's counts; about (k + 1) steps'
    groups then wait unconsumed. None: no bound (collecting data without a trainer).
    until_step: with max_policy_lag, sample only groups that steps up to this one will train, and
    end once the trainer has taken that step's groups (a pipeline phase's last step).
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
    open_ended = f"ends once the trainer has taken step {until_step}'s groups" if until_step else "runs until cancelled"
    progress = await progress_artifact(groups, run, open_ended)
    card = stats_card(run)  # failures by reason as they happen, not only at the end
    started_at = time.monotonic()

    # The writer leaves first (its exit flushes every stored group), then the admission's clients.
    async with (
        contextlib.AsyncExitStack() as clients,
        ShardWriter(storage, run, tokenizer=tokenizer, max_groups=shard_max_groups, max_age_s=shard_max_age_s) as writer,
    ):
        admission = None
        if max_policy_lag is not None:
            version_clients = [await clients.enter_async_context(PolicyClient(url, api_key=api_key)) for url in servers]

            async def served_version() -> int:
                return min(await asyncio.gather(*(client.weight_version() for client in version_clients)))

            async def flush_now() -> None:
                for url in await asyncio.to_thread(writer.flush):
                    emit_shard_event(url, run, None)

            admission = Admission(
                storage, run, max_lag=max_policy_lag, served_version=served_version, buffered=lambda: writer.pending_groups,
                flush=flush_now, sampler=sampler_name(), logger=log, last_step=until_step,
            )
            clients.push_async_callback(admission.close)
        def gone(spec: EnvSpec, error: Exception) -> None:
            log.error("environment %s left the run: %s", stats[spec.key].env, error)
            stats[spec.key].add(RolloutFailure.of(stats[spec.key].env, "get_item", error))

        items = ItemStream(specs, sources, groups, seed, admission=admission, on_gone=gone)

        async def store(spec: EnvSpec, results: Results) -> None:
            """Counts and buffers finished groups; a cancel cannot cut it short."""

            async def counted() -> None:
                for result in results:
                    stats[spec.key].add(result)
                    if admission is not None:
                        admission.finished(stored=isinstance(result, ScoredGroup))
                scored = [result for result in results if isinstance(result, ScoredGroup)]
                if scored:
                    for url in await asyncio.to_thread(writer.add_many, scored):
                        emit_shard_event(url, run, scored[0].env)
                    if admission is not None and admission.flush_due():
                        await flush_now()
                # Then the instance that handed out the items learns from them (a curriculum); its
                # bugs are logged, never a reason to lose a group already counted.
                try:
                    for group in scored:
                        await sources[spec.key].observe(group)
                    stats[spec.key].metrics = sources[spec.key].metrics()  # e.g. the level of a curriculum
                except Exception as error:
                    log.warning("env %s: observe/metrics failed: %s", stats[spec.key].env, error)
                await progress.update(sum(s.groups + s.failures for s in stats.values()))
                await card.show(lambda: stats_table(stats))  # the rows are built only when an update is due

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
    summary = await publish_report(stats, writer.written, seconds, run, storage, task_runs, card)
    log.info("rollout finished: %s", summary["totals"])
    return summary


class ItemStream:
    """The run's items, environments picked by weight, until `groups` were handed out (None:
    forever) or every environment ran out. Lanes share it; with an `admission` each item waits
    until a group may start sampling (bounded staleness, flows.admission)."""

    def __init__(self, specs: list[EnvSpec], sources: dict[str, Environment], groups: int | None, seed: int,
                 admission: Admission | None = None,
                 on_gone: Callable[[EnvSpec, Exception], None] | None = None):  # fmt: skip
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
                except Exception as error:  # a service gone, or a get_item bug: that environment leaves, the run goes on
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


def sampler_name() -> str:
    """This sampler's name in the run's progress: its flow run's id (a restarted flow is a new
    sampler; the old one's committed groups still count)."""
    from prefect.runtime import flow_run

    return str(flow_run.id or "") or uuid.uuid4().hex[:12]


def check_limits(max_concurrent_groups: int, server_concurrency: int | None, task_run_s: float) -> None:
    if max_concurrent_groups < 1:
        raise ValueError(f"max_concurrent_groups={max_concurrent_groups}: use 1 or more")
    if server_concurrency is not None and server_concurrency < 1:
        raise ValueError(f"server_concurrency={server_concurrency}: use 1 or more, or None for no server limit")
    if not task_run_s >= 0:
        raise ValueError(f"task_run_s={task_run_s}: use seconds >= 0 (0: a task run per group)")
