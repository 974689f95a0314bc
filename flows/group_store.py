"""Where a rollout flow's finished groups go: counted per environment (the stats, the progress bar,
the failures card), written to shards, told to the admission (bounded staleness) and to the
environment instance that handed out the item (a curriculum learns from it)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio

from core.scored_group import ScoredGroup
from environments.base import Environment, RolloutFailure
from flows.admission import Admission
from flows.rollout_report import (
    RolloutStats,
    emit_shard_event,
    progress_artifact,
    publish_report,
    stats_card,
    stats_table,
)
from inference.client import PolicyClient
from storage.writer import ShardWriter
from tasks.rollout import EnvSpec

Results = list[ScoredGroup | RolloutFailure]


class GroupStore:
    """A rollout flow's finished groups, from every lane. `store()` runs to its end even when the
    flow is cancelled meanwhile: a group that finished is never lost to Ctrl-C. Opened with
    `GroupStore.open()`, which owns the shard writer and the admission's clients."""

    def __init__(
        self, storage: str, run: str, sources: dict[str, Environment], writer: ShardWriter, progress: Any, log: Any
    ):
        self.storage, self.run, self.sources, self.writer, self.progress, self.log = (
            storage,
            run,
            sources,
            writer,
            progress,
            log,
        )
        self.stats = {key: RolloutStats(env=env.name) for key, env in sources.items()}
        self.card = stats_card(run)  # failures by reason as they happen, not only at the end
        self.admission: Admission | None = None
        self.started = time.monotonic()

    @classmethod
    @contextlib.asynccontextmanager
    async def open(
        cls,
        storage: str,
        run: str,
        sources: dict[str, Environment],
        *,
        tokenizer: str,
        groups: int | None,
        shard_max_groups: int,
        shard_max_age_s: float,
        servers: list[str],
        api_key: str | None,
        max_lag: int | None,
        until_step: int | None,
        sampler: str,
        log: Any,
    ) -> AsyncIterator[GroupStore]:
        """The store with its progress card, its writer and, with `max_lag`, its admission
        (which reads the version the servers serve). On leaving, the writer goes first (its exit
        flushes every stored group), then the admission's clients."""
        open_ended = (
            f"ends once the trainer has taken step {until_step}'s groups" if until_step else "runs until cancelled"
        )
        progress = await progress_artifact(groups, run, open_ended)
        async with (
            contextlib.AsyncExitStack() as clients,
            ShardWriter(
                storage, run, tokenizer=tokenizer, max_groups=shard_max_groups, max_age_s=shard_max_age_s
            ) as writer,
        ):
            store = cls(storage, run, sources, writer, progress, log)
            if max_lag is not None:
                version_clients = [
                    await clients.enter_async_context(PolicyClient(url, api_key=api_key)) for url in servers
                ]
                store.admission = Admission(
                    storage,
                    run,
                    max_lag=max_lag,
                    served_version=functools.partial(lowest_served_version, version_clients),
                    buffered=lambda: writer.pending_groups,
                    flush=store.flush,
                    sampler=sampler,
                    logger=log,
                    last_step=until_step,
                )
                clients.push_async_callback(store.admission.close)  # after the heartbeat stopped: its last word
                await clients.enter_async_context(store.admission.heartbeat())
            yield store

    async def store(self, spec: EnvSpec, results: Results) -> None:
        """Counts and writes finished groups, then lets their environment learn from them; a cancel
        cannot cut it short (it lands once the groups are stored)."""
        with anyio.CancelScope(shield=True):
            scored = self.count(spec.key, results)
            if scored:
                await self.write(scored)
            await self.observe(spec.key, scored)
            await self.progress.update(sum(s.groups + s.failures for s in self.stats.values()))
            await self.card.show(lambda: stats_table(self.stats))  # the rows are built only when an update is due

    def count(self, key: str, results: Results) -> list[ScoredGroup]:
        for result in results:
            self.stats[key].add(result)
            if self.admission is not None:
                self.admission.finished(stored=isinstance(result, ScoredGroup))
        return [result for result in results if isinstance(result, ScoredGroup)]

    async def write(self, scored: list[ScoredGroup]) -> None:
        await self.write_shards(self.writer.add_many, scored, env=scored[0].env)
        if self.admission is not None and self.admission.flush_due():
            await self.flush()

    async def observe(self, key: str, scored: list[ScoredGroup]) -> None:
        """The instance that handed out the items learns from them (a curriculum); its bugs are
        logged, never a reason to lose a group already counted."""
        try:
            for group in scored:
                await self.sources[key].observe(group)
            self.stats[key].metrics = self.sources[key].metrics()  # e.g. the level of a curriculum
        except Exception as error:  # noqa: BLE001 - an environment's hook never loses a counted group
            self.log.warning("env %s: observe/metrics failed: %s", self.stats[key].env, error)

    def gone(self, spec: EnvSpec, error: Exception) -> None:
        """An environment's get_item failed: it leaves the run, recorded as a failure."""
        stats = self.stats[spec.key]
        self.log.error("environment %s left the run: %s", stats.env, error)
        stats.add(RolloutFailure.of(stats.env, "get_item", error))

    async def flush(self) -> None:
        """Writes every buffered group now (the admission asks when the trainer waits for them)."""
        await self.write_shards(self.writer.flush)

    async def flush_aged(self) -> None:
        """Writes a shard once its oldest group reached the writer's max age, also while no group ends."""
        while True:
            await asyncio.sleep(1.0)
            if self.writer.due():
                await self.write_shards(self.writer.flush_if_due)

    async def write_shards(self, write: Callable[..., list[str]], *args: Any, env: str | None = None) -> None:
        """One of the writer's writes, off the event loop; each shard it wrote becomes an event."""
        for url in await asyncio.to_thread(write, *args):
            emit_shard_event(url, self.run, env)

    async def report(self, task_runs: int) -> dict[str, Any]:
        """The flow's summary (its time: from the store's opening to now, running groups and
        storing them), its report artifact and its last card."""
        seconds = time.monotonic() - self.started
        await self.progress.close()
        return await publish_report(
            self.stats, self.writer.written, seconds, self.run, self.storage, task_runs, self.card
        )


async def lowest_served_version(clients: list[PolicyClient]) -> int:
    """The policy version every server serves (the oldest of theirs)."""
    return min(await asyncio.gather(*(client.weight_version() for client in clients)))
