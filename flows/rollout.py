"""The rollout flow: keep N groups in flight across environments and servers, store them as shards."""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from typing import Any

from prefect import flow, get_run_logger
from prefect.task_runners import ThreadPoolTaskRunner

from environments.base import Environment, Item, RolloutFailure
from environments.scored_group import ScoredGroup
from flows.rollout_report import RolloutStats, emit_shard_event, progress_artifact, publish_report
from storage.checkpoints import latest_checkpoint
from storage.ledger import Ledger
from storage.reader import ShardReader
from storage.writer import ShardWriter
from tasks.rollout import EnvSpec, collect_groups, ensure_server_limits, environment_for, hand_over_to, slots_from


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


def check_batching(groups_per_task: int | None, max_concurrent_groups: int, server_concurrency: int | None) -> None:
    if max_concurrent_groups < 1:
        raise ValueError(f"max_concurrent_groups={max_concurrent_groups}: use 1 or more")
    if server_concurrency is not None and server_concurrency < 1:
        raise ValueError(f"server_concurrency={server_concurrency}: use 1 or more, or None for no server limit")
    if groups_per_task is None:
        return  # sized by TaskRunSizer within the same bounds
    if not 1 <= groups_per_task <= max_concurrent_groups:
        raise ValueError(
            f"groups_per_task={groups_per_task}: use 1..max_concurrent_groups ({max_concurrent_groups})"
        )
    if server_concurrency is not None and groups_per_task > server_concurrency:
        raise ValueError(
            f"groups_per_task={groups_per_task} exceeds server_concurrency={server_concurrency}: a task run "
            "holds a slot per group, so it could never start; lower groups_per_task or raise server_concurrency"
        )


# Prefect's bookkeeping of one task run costs 7-9 ms of latency and 23-34 ms of CPU between the
# flow's process and the Prefect server (bench/bench_rollout.py, README), whatever the task run holds. Groups
# that sample for a minute on GPUs make that nothing; groups of a second on a CPU host that also runs
# the model make it several percent of the machine. By default (groups_per_task=None) a task run
# takes as many groups as cover AUTO_TASK_RUN_GROUP_SECONDS of sampling between them: 128-token
# groups of 2 s on a 2-core host get 5 per task run, groups of 10 s or more a task run each.
AUTO_TASK_RUN_GROUP_SECONDS = 10.0


class TaskRunSizer:
    """Groups per task run: `fixed`, or auto: enough that their sampling times add up to `target_s`
    (a moving average of the last groups), within a cap.

    With `per_group_slots` (task runs on the flow's loop, where each group takes and frees a slot
    of its own and the flow starts the next task run ahead of free slots) the cap is every group in
    flight (within `server_concurrency`), and a task run takes that many until a group has been
    timed: the first wave is one or two task runs. Otherwise a task run holds its slots (or its Dask
    worker) until its last group ends, so the cap is half the groups in flight, which keeps task
    runs overlapping, and the first task runs take one group each. Long groups get a task run each
    from the first one timed on.
    """

    def __init__(self, fixed: int | None, max_concurrent_groups: int, server_concurrency: int | None = None,
                 target_s: float = AUTO_TASK_RUN_GROUP_SECONDS, per_group_slots: bool = False):  # fmt: skip
        self.fixed, self.target_s = fixed, target_s
        share = max_concurrent_groups if per_group_slots else max_concurrent_groups // 2
        self.cap = max(1, min(share, server_concurrency or max_concurrent_groups))
        self.first = self.cap if per_group_slots else 1
        self.mean_s: float | None = None

    def observe(self, seconds: float) -> None:
        """One group's sampling time."""
        self.mean_s = seconds if self.mean_s is None else 0.8 * self.mean_s + 0.2 * seconds

    def size(self) -> int:
        if self.fixed is not None:
            return self.fixed
        if self.mean_s is None:
            return self.first
        return max(1, min(self.cap, math.ceil(self.target_s / max(self.mean_s, 1e-3))))


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
    groups_per_task: int | None = None,
) -> dict[str, Any]:
    """Maps collect_trajectories as Prefect tasks over items, `max_concurrent_groups` in flight.

    Inference is I/O-bound, so by default groups are sampled in async task runs awaited on the
    flow's event loop, sharing one connection pool; a task run may hold several groups (Prefect's
    cost per task run: see AUTO_TASK_RUN_GROUP_SECONDS). With distributed=True task runs are
    submitted to the flow's task runner instead (set a DaskTaskRunner with
    `rollout.with_options(task_runner=...)` to spread them over a cluster).
    server_concurrency: groups in flight per server across every flow that uses it, enforced by a
    Prefect global concurrency limit per server (visible and adjustable in the UI's Concurrency page).
    groups_per_task: items of one environment per task run. The default (None) sizes task runs from
    the groups' sampling time: after the first wave, a task run per group when groups take 10 s
    or more, more per task run for shorter ones (see TaskRunSizer); 1 always keeps a task run per group.
    groups=None runs until cancelled. Environments are mixed by weight; each task run goes to the
    least busy server. Finished groups are buffered into shards (flushed by size or age, and on exit).
    """
    log = get_run_logger()
    if not environments or not servers:
        raise ValueError("rollout needs at least one environment and one server URL")
    check_batching(groups_per_task, max_concurrent_groups, server_concurrency)
    specs = [spec if isinstance(spec, EnvSpec) else EnvSpec.model_validate(spec) for spec in environments]
    # The flow's own environment instances hand out items (they own curriculum and sampling).
    sources: dict[str, Environment] = {}
    for spec in specs:
        # The same cached instance the task runs on this loop use: setup() (data loading) runs once.
        sources[spec.key] = await environment_for(spec, servers[0], tokenizer)
    stats = {spec.key: RolloutStats(env=sources[spec.key].name) for spec in specs}
    limits = await ensure_server_limits(servers, server_concurrency) if server_concurrency else {}
    busy = {server: 0 for server in servers}
    task_runs = 0
    rng = random.Random(seed)
    progress = await progress_artifact(groups)
    started_at = time.monotonic()
    finished = 0
    exhausted: set[str] = set()

    async def store(spec: EnvSpec, results: list[ScoredGroup | RolloutFailure]) -> None:
        nonlocal finished
        for result in results:
            stats[spec.key].add(result)
        scored = [result for result in results if isinstance(result, ScoredGroup)]
        if scored:
            for url in await asyncio.to_thread(writer.add_many, scored):
                emit_shard_event(url, run, scored[0].env)
        finished += len(results)

    slot_freed = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Task runs on this loop take a slot per group as it starts sampling (see tasks.rollout._slot),
    # so the flow can start them ahead of free slots. Task runs on workers (distributed) and
    # under a server concurrency limit (whose Prefect slots a task run holds whole) are not gated:
    # they start when their groups' slots are free.
    gated = not distributed and not limits
    sizer = TaskRunSizer(groups_per_task, max_concurrent_groups, server_concurrency, per_group_slots=gated)
    sampling = asyncio.Semaphore(max_concurrent_groups)

    async def run_task(spec: EnvSpec, items: list[Item], server: str) -> None:
        """Runs one task run whose groups the caller already counted in busy[server]."""
        handed_over: list[ScoredGroup | RolloutFailure] = []
        future = None
        released = 0

        def release(count: int | None = None) -> None:
            """Frees `count` of this task run's groups (default: all not yet freed)."""
            nonlocal released
            count = len(items) - released if count is None else min(count, len(items) - released)
            if count > 0:
                released += count
                busy[server] -= count
                slot_freed.set()

        @contextlib.asynccontextmanager
        async def slot():
            async with sampling:
                began = time.monotonic()
                yield
                sizer.observe(time.monotonic() - began)
            # This group's sampling is over: the next one starts now. (A group that raised is
            # freed when its task run ends: Prefect retries the task run's groups together.)
            release(1)

        def receive(results: list[ScoredGroup | RolloutFailure]) -> None:
            handed_over.extend(results)
            if not limits:
                # Sampling is over: the next groups start now, while Prefect finishes this task
                # run. (Under a server concurrency limit the slots free when the task releases them.)
                loop.call_soon_threadsafe(release)

        began = time.monotonic()
        try:
            with hand_over_to(receive), (slots_from(slot) if gated else contextlib.nullcontext()):
                if distributed:
                    future = collect_groups.submit(spec, items, server, tokenizer, limits.get(server))
                    await settled(future)
                    results: list[ScoredGroup | RolloutFailure] = future.result()
                else:
                    results = await collect_groups(spec, items, server, tokenizer, limits.get(server))
            if not gated:  # its groups sampled side by side: the task run's time is each one's
                sizer.observe(time.monotonic() - began)
        except asyncio.CancelledError:
            # Cancelled after the groups were sampled (Prefect may already show the task run
            # Completed): they are stored before the cancel goes on; unfinished ones are abandoned.
            if not handed_over and future is not None:
                if future.wrapped_future.done():
                    with contextlib.suppress(Exception):
                        handed_over = future.result(timeout=0)  # finished on another worker
                else:
                    future.wrapped_future.cancel()  # one still queued never starts
            if handed_over:
                await to_the_end(store(spec, handed_over))
            raise
        except Exception as error:  # retries exhausted (server unreachable): recorded failures
            message = f"{type(error).__name__}: {error}"
            results = [RolloutFailure(env=stats[spec.key].env, item_id=item.id, error=message) for item in items]
        finally:
            release()
        await to_the_end(store(spec, results))
        await progress.update(finished)

    in_flight: set[asyncio.Task] = set()
    async with ShardWriter(
        storage, run, tokenizer=tokenizer, max_groups=shard_max_groups, max_age_s=shard_max_age_s
    ) as writer:
        try:
            started = 0
            while groups is None or started < groups:
                live = [spec for spec in specs if spec.key not in exhausted]
                if not live:
                    log.info("every environment ran out of items")
                    break
                if max_policy_lag is not None:
                    await wait_for_trainer(storage, run, max_policy_lag, poll_s=5.0, log=log)
                size = sizer.size()
                if groups is not None:
                    size = min(size, groups - started)
                # Gated task runs start while every slot is taken, up to one task run's groups
                # ahead: their start overlaps sampling and a freed slot goes to a waiting group.
                ahead = size if gated else 0
                while sum(busy.values()) + size > max_concurrent_groups + ahead:
                    slot_freed.clear()
                    freed = asyncio.ensure_future(slot_freed.wait())
                    await asyncio.wait({*in_flight, freed}, return_when=asyncio.FIRST_COMPLETED)
                    freed.cancel()
                    for task in [task for task in in_flight if task.done()]:
                        in_flight.discard(task)
                        task.result()  # a failed store (storage down) stops the flow, never silently
                    if writer.due():
                        for url in await asyncio.to_thread(writer.flush_if_due):
                            emit_shard_event(url, run, None)
                spec = rng.choices(live, weights=[s.weight for s in live])[0]
                items: list[Item] = []
                while len(items) < size:
                    item = await sources[spec.key].get_item()
                    if item is None:
                        exhausted.add(spec.key)
                        break
                    items.append(item)
                if not items:
                    continue
                server = min(servers, key=busy.__getitem__)
                busy[server] += len(items)  # counted now, so the next pick and the wait see it
                in_flight.add(asyncio.create_task(run_task(spec, items, server)))
                started += len(items)
                task_runs += 1
            if in_flight:
                await asyncio.gather(*in_flight)
        finally:
            # Cancelled (UI, Ctrl-C) or failed: groups still being sampled are abandoned, never
            # half-written; every finished group is handed to the writer first (the wait below,
            # which a second cancel cannot cut short), then flushed by the writer's exit.
            for task in in_flight:
                task.cancel()
            await to_the_end(asyncio.gather(*in_flight, return_exceptions=True))
    seconds = time.monotonic() - started_at  # running groups and storing them; the report follows
    await progress.close()
    summary = await publish_report(stats, writer.written, seconds, run, storage, task_runs)
    log.info("rollout finished: %s", summary["totals"])
    return summary
