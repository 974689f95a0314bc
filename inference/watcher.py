"""Follows a run's published checkpoints and hot-reloads every policy server onto each new STABLE one."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.retrying import backoff_ceiling
from inference.parity_guard import ParityGuard
from inference.reload import (
    CheckpointRejected,
    ReloadError,
    ServedPolicy,
    ensure_resumed,
    reload_server,
    restore_server,
)
from inference.weights import reload_dir_for
from storage.checkpoints import (
    PIN_TTL_S,
    SPARE_WEIGHTS,
    CheckpointError,
    CheckpointInfo,
    checkpoint_url,
    drop_cached_copy,
    fetch_checkpoint,
    latest_checkpoint,
    pin_steps,
    read_checkpoint,
)
from storage.layout import split_run_url

log = logging.getLogger(__name__)

DEFAULT_CACHE = Path(".clotho/reload-cache")  # in the working directory
HEALTH_S = 2.0  # seconds between asking each server which version it announces


@dataclass(frozen=True)
class ReloadOutcome:
    """What one poll did to one server: 'reloaded', 'rejected', 'failed' or 'restored'."""

    base_url: str
    version: int
    status: str
    detail: str
    swap_s: float | None = None
    parity_s: float | None = None
    total_s: float | None = None  # the checkpoint's fetch (a delta step's rebuild) to the announcement
    fetch_s: float | None = None


def run_cache_dir(run_url: str, cache_dir: str | Path = DEFAULT_CACHE) -> Path:
    """Where a watcher of `run_url` keeps its copies: fetched copies are named by step only, so
    each run gets its own directory."""
    root, run = split_run_url(run_url)
    return Path(cache_dir) / f"{run}-{hashlib.sha1(f'{root}/{run}'.encode()).hexdigest()[:10]}"


class ReloadWatcher:
    """Polls STORAGE_URL/RUN for the newest STABLE checkpoint and reloads each server behind it.

    Remote checkpoints are copied to `cache_dir` once and shared by all servers; copies no server
    serves any more are deleted. A server that fails is reported, restored to its verified weights
    when possible, and tried again (next poll if restored, else with backoff up to a minute); a
    version that fails parity or the preflight on a server is not retried there (the next
    checkpoint is). Every poll also asks each healthy server which version it announces: one that
    restarted (a fresh vLLM announces 0 on its base weights) or stopped answering is restored the
    same way, not left behind until the next checkpoint. Each server pins the step it serves and
    the one it is loading (storage.checkpoints.pin_steps), so the trainer's checkpoint retention
    leaves them alone.
    """

    def __init__(
        self,
        run_url: str,
        servers: list[ServedPolicy],
        guard: ParityGuard,
        *,
        cache_dir: str | Path = DEFAULT_CACHE,
        poll_s: float = 2.0,
        health_s: float = HEALTH_S,
        storage_options: dict[str, Any] | None = None,
    ):
        if not servers:
            raise ValueError("ReloadWatcher needs at least one server to keep up to date")
        self.root, self.run_name = split_run_url(run_url)
        self.servers = servers
        self.guard = guard
        self.cache_dir = run_cache_dir(run_url, cache_dir)
        self.checkpoints_dir = self.cache_dir / "checkpoints"
        self.reload_root = self.cache_dir / "reload"
        self.poll_s = poll_s
        # A look at the run reads one pointer and can be frequent (the loop waits for the reload
        # that follows a publish); asking every server what it announces is an HTTP call each and
        # only catches restarts, so it runs every health_s.
        self.health_s = health_s
        self._health_checked = -float("inf")
        self.storage_options = storage_options
        self.history: list[ReloadOutcome] = []
        self._newest: Path | None = None
        self.latest: int | None = None  # the run's newest checkpoint at the last poll
        self._retry: dict[str, tuple[int, float]] = {}  # unhealthy server -> (failures, next try)
        self._pins: dict[str, tuple[frozenset[int], float]] = {}  # server -> (pinned steps, when)
        # Held by an evaluator while it answers (flows.pipeline.evaluate_versions): no server reloads
        # under an evaluation, so one version answers all of it; a poll waits for it, never the reverse.
        self.hold = asyncio.Lock()

    def pin(self, target: ServedPolicy, *loading: int) -> None:
        """Pin the server's served step and `loading`; renewed well within the pins' lifetime."""
        steps = frozenset(step for step in (target.version, *loading) if step > 0)
        pinned, when = self._pins.get(target.base_url, (frozenset(), 0.0))
        if steps != pinned or time.time() - when > PIN_TTL_S / 4:
            pin_steps(self.root, self.run_name, target.base_url, set(steps), storage_options=self.storage_options)
            self._pins[target.base_url] = (steps, time.time())

    async def local_copy(self, info: CheckpointInfo) -> Path:
        options = self.storage_options
        return await asyncio.to_thread(fetch_checkpoint, info, self.checkpoints_dir, storage_options=options)

    async def adopt_served_versions(self) -> None:
        """Picks up where a previous watcher left off: a server already announcing version N (>0) of
        this run gets checkpoint N as its verified weights, so fallbacks return there."""
        for target in self.servers:
            await self._adopt(target, resume=True)

    async def _adopt(self, target: ServedPolicy, *, resume: bool = False, version: int | None = None) -> None:
        """Takes the version `target` announces (`version`, when just asked) as what it serves,
        when that checkpoint is this run's; marks it unhealthy (restored by the next poll) when it
        cannot say or it is not."""
        try:
            if version is None:
                async with target.client() as client:
                    if resume:
                        await ensure_resumed(client)
                    version = await client.weight_version()
            if version > 0 and version != target.version:
                url = checkpoint_url(self.root, self.run_name, version)
                info = await asyncio.to_thread(read_checkpoint, url, storage_options=self.storage_options)
                target.weights_dir, target.version = await self.local_copy(info), version
                log.info("%s already serves version %d of run %s", target.base_url, version, self.run_name)
        except Exception as error:  # noqa: BLE001 - restored (or reported) by the first poll
            log.error(
                "%s: cannot tell what it serves (%s); restoring it to %s", target.base_url, error, target.weights_dir
            )
            target.healthy = False

    async def _check_announced(self, target: ServedPolicy) -> None:
        """A server this watcher left healthy must still announce the version it gave it. One that
        answers with less (a restart on its base weights announces 0) or not at all is unhealthy,
        and restored to its verified weights like a failed reload, instead of serving other
        weights than the run's newest until the next checkpoint comes (maybe never: a trainer
        waiting for groups the samplers hold back until the servers catch up)."""
        try:
            async with target.client() as client:
                announced = await client.weight_version()
        except Exception as error:  # noqa: BLE001 - unreachable or failing: the restore says which
            log.error("%s does not answer (%s); restoring it to version %d", target.base_url, error, target.version)
            target.healthy = False
            return
        if announced < target.version:
            log.error(
                "%s announces version %d, not %d (restarted?); restoring it", target.base_url, announced, target.version
            )
            target.healthy = False
        elif announced > target.version:  # another watcher moved it on: take its version if it is this run's
            await self._adopt(target, version=announced)

    async def poll_once(self) -> list[ReloadOutcome]:
        """One look at the run: every server behind the newest checkpoint is reloaded, concurrently
        (once no evaluation holds the servers at their version: `hold`)."""
        async with self.hold:
            return await self._poll()

    async def _poll(self) -> list[ReloadOutcome]:
        options = self.storage_options
        info = await asyncio.to_thread(latest_checkpoint, self.root, self.run_name, storage_options=options)
        self.latest = info.step if info is not None else None
        due = [t for t in self.servers if self._retry.get(t.base_url, (0, 0.0))[1] <= time.monotonic()]
        behind = [t for t in due if info is not None and info.step > t.version and info.step not in t.rejected]
        if time.monotonic() - self._health_checked >= self.health_s:
            self._health_checked = time.monotonic()
            await asyncio.gather(*(self._check_announced(t) for t in due if t.healthy and t not in behind))
        unhealthy = [t for t in due if not t.healthy and t not in behind]
        for target in self.servers:
            await asyncio.to_thread(self.pin, target, *([info.step] if target in behind else []))
        if behind:
            try:  # pinned, then still STABLE: retention will not delete it under the reload
                await asyncio.to_thread(read_checkpoint, info.url, storage_options=options)
            except CheckpointError as error:
                log.info(
                    "checkpoint %d went away before its reload (%s); taking the newest next poll", info.step, error
                )
                behind = []
        checkpoint_dir: Path | Exception | None = None
        fetch_started = time.perf_counter()
        if behind:
            try:  # fetched once for every server
                checkpoint_dir = self._newest = await self.local_copy(info)
            except Exception as error:  # noqa: BLE001 - reported per server, retried next poll
                checkpoint_dir = error
        fetch_s = time.perf_counter() - fetch_started
        jobs = [self._restore(target) for target in unhealthy]
        jobs += [self._reload(target, info.step, checkpoint_dir, fetch_s) for target in behind]
        outcomes = list(await asyncio.gather(*jobs))
        for target in behind + unhealthy:
            self._back_off_if_down(target)
            await asyncio.to_thread(self.pin, target)  # the step it serves now
        self.history = (self.history + outcomes)[-100:]  # bounded: the watcher may run for weeks
        if outcomes:
            await asyncio.to_thread(self.prune_cache)
        return outcomes

    def blocked_by_rejection(self, max_lag: int) -> tuple[int, str] | None:
        """(version, the last rejection's reason) when the run's newest checkpoint was rejected by
        every server and every server serves a version more than `max_lag` older: no server moves
        until a newer checkpoint comes, and a trainer whose next step takes groups at most `max_lag`
        versions old cannot make one. None otherwise (a newer checkpoint may be taken)."""
        version = self.latest
        if version is None or not self.servers or any(version not in target.rejected for target in self.servers):
            return None
        if max(target.version for target in self.servers) >= version - max_lag:
            return None
        reasons = [outcome.detail for outcome in self.history if outcome.status == "rejected"]
        return version, reasons[-1] if reasons else "rejected"

    def _back_off_if_down(self, target: ServedPolicy) -> None:
        """A server that could not even be restored is retried after 1, 2, 4 ... 60 s, not every poll."""
        if target.healthy:
            self._retry.pop(target.base_url, None)
            return
        failures = self._retry.get(target.base_url, (0, 0.0))[0] + 1
        self._retry[target.base_url] = (failures, time.monotonic() + backoff_ceiling(failures, 1.0, 60.0))

    async def _restore(self, target: ServedPolicy) -> ReloadOutcome:
        try:
            how = await restore_server(target, self.guard, self.reload_root)
        except Exception as error:  # noqa: BLE001 - one server's failure must not stop the others
            log.error("FAILED %s: %s (retrying next poll)", target.base_url, error)
            return ReloadOutcome(target.base_url, target.version, "failed", f"{type(error).__name__}: {error}")
        return ReloadOutcome(target.base_url, target.version, "restored", how)

    async def _reload(
        self, target: ServedPolicy, version: int, checkpoint_dir: Path | Exception, fetch_s: float
    ) -> ReloadOutcome:
        url = target.base_url
        try:
            if isinstance(checkpoint_dir, Exception):
                raise ReloadError(f"could not copy checkpoint {version} to {self.checkpoints_dir}: {checkpoint_dir}")
            if not target.healthy:
                await restore_server(target, self.guard, self.reload_root)
            report = await reload_server(target, checkpoint_dir, version, self.guard, self.reload_root)
        except CheckpointRejected as error:
            log.error("REJECTED %s", error)
            return ReloadOutcome(url, target.version, "rejected", str(error))
        except Exception as error:  # noqa: BLE001 - one server's failure must not stop the others
            log.error("FAILED %s: %s (retrying next poll)", url, error)
            return ReloadOutcome(url, target.version, "failed", f"{type(error).__name__}: {error}")
        return ReloadOutcome(
            url,
            report.version,
            "reloaded",
            f"parity max |diff| {report.parity.max_difference:.2g}",
            report.swap_s,
            report.parity.seconds,
            fetch_s + report.total_s,
            fetch_s,
        )

    def prune_cache(self) -> None:
        """Deletes fetched copies and reload directories that no server serves (big models are GBs),
        the last weights file deleted kept for the next rebuild to write over (drop_cached_copy)."""
        served = {target.weights_dir.resolve() for target in self.servers}
        if self._newest is not None:  # a server that failed on it retries next poll: keep the copy
            served.add(self._newest.resolve())
        keep = {reload_dir_for(path, self.reload_root) for path in served}
        for directory, kept in ((self.checkpoints_dir, served), (self.reload_root, keep)):
            if directory.exists():
                for entry in directory.iterdir():
                    if entry.resolve() in kept or entry in kept or entry.name == SPARE_WEIGHTS:
                        continue
                    if directory == self.checkpoints_dir:
                        drop_cached_copy(entry)  # its weights file written over by the next rebuild
                    else:
                        shutil.rmtree(entry, ignore_errors=True)

    def discard_cache(self) -> None:
        """Deletes this run's copies (its checkpoints stay in the run's storage): once the servers
        are done with the run, a copy of a 7B model is 15 GB of disk that no one reads again."""
        shutil.rmtree(self.cache_dir, ignore_errors=True)

    async def run(
        self,
        *,
        max_polls: int | None = None,
        stop: asyncio.Event | None = None,
        on_outcomes: Callable[[list[ReloadOutcome]], Awaitable[None]] | None = None,
    ) -> list[ReloadOutcome]:
        """Polls every poll_s until `stop` is set or after max_polls; returns the recent outcomes.

        `on_outcomes` hears about each poll that did something (flows turn it into artifacts)."""
        await self.adopt_served_versions()
        polls = failures = 0
        while (max_polls is None or polls < max_polls) and not (stop and stop.is_set()):
            started = time.monotonic()
            interval = self.poll_s
            try:
                outcomes = await self.poll_once()
                failures = 0
                if outcomes and on_outcomes is not None:
                    await on_outcomes(outcomes)
            except Exception as error:  # noqa: BLE001 - storage hiccups must not end the watch
                failures += 1  # frequent looks must not become a storm of failing requests and log lines
                interval = max(self.poll_s, backoff_ceiling(failures, 1.0, 30.0))
                log.error("polling %s/%s failed: %s (retrying in %.0fs)", self.root, self.run_name, error, interval)
            polls += 1
            if max_polls is not None and polls >= max_polls:
                break
            delay = max(0.0, interval - (time.monotonic() - started))
            if stop is None:
                await asyncio.sleep(delay)
            else:
                try:
                    await asyncio.wait_for(stop.wait(), delay)
                except TimeoutError:
                    pass
        return self.history
