"""Bounded staleness on the sampler's side: a group starts sampling only when the trainer will
still train it, so the sampler never runs ahead to make groups that are thrown away as stale.

The rule (`admits`), as AReaL's staleness manager and prime-rl's async level state it, in counts
the trainer publishes every step (storage.progress): with max lag k, B groups per step and a
checkpoint every N steps, a new group queues behind the `pending` groups already admitted and not
yet consumed, so the trainer takes it in step

    j = steps + pending // B + 1          (steps: steps whose data the trainer has taken)

whose weights are the newest version published before it, N * ((j - 1) // N). The group samples
with the served version v, so it is admitted iff N * ((j - 1) // N) - v <= k. With N = 1 that is
pending < (k + 1 + v - steps) * B: about (k + 1) * B groups wait unconsumed, and k = 0 samples one
step's groups on the newest weights, then waits for the next checkpoint (the synchronous loop).

Groups finish out of the order they were admitted in, so one admitted at the edge of its step's lag
can be overtaken and land a step later, where the trainer skips it as stale (trainer.data.is_stale
stays the one guarantee). In simulation (tests/flows/test_admission.py) that happens only when a
step trains about as fast as its groups sample, for up to a few percent of the groups.

It never deadlocks: a trainer waiting for step steps + 1 has published N * (steps // N); once the
servers serve it, a group queued behind fewer than B others is admitted (j = steps + 1), and any
pending group is either trained or consumed as stale, which lowers `pending`. Failed groups give
their place back, and the shards a waiting trainer needs are flushed the moment admission blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from core.polling import poll_delay
from storage.progress import (
    SamplerPosition,
    TrainerPosition,
    claim_sampler_slot,
    read_run_end,
    read_sampler_position,
    read_sampler_positions,
    read_trainer_position,
    write_sampler_position,
)
from trainer.data import is_stale

log = logging.getLogger(__name__)


def training_step(pending: int, steps: int, groups_per_step: int) -> int:
    """The step that will train a group admitted now, behind `pending` unconsumed ones."""
    return steps + pending // groups_per_step + 1


def admits(
    *,
    pending: int,
    steps: int,
    served_version: int,
    groups_per_step: int,
    save_every: int,
    max_lag: int,
) -> bool:
    """Whether one more group may start sampling now (see the module docstring): the trainer's own
    staleness rule (trainer.data.is_stale), applied to the version the group samples with and the
    weights of the step that will train it. The group's stamp is the oldest version that sampled
    its tokens (a later swap only makes its tokens fresher), so what is admitted here is stale there
    only when it lands a step later than predicted."""
    step = training_step(pending, steps, groups_per_step)
    trained_with = save_every * ((step - 1) // save_every)
    return not is_stale(served_version, policy_version=trained_with, max_lag=max_lag)


class Admission:
    """Admits this sampler's groups under the rule, counting its own exactly and reading the
    trainer's and the other samplers' positions at most every `refresh_s` (faster while blocked).
    It writes its counts to a sampler slot it claims first (storage.progress).

    `served_version()` is the oldest version the flow's servers serve and `buffered()` the groups
    its shard writer holds (stored, not yet in a shard). Call `acquire()` before a group samples
    and `finished(stored)` when it is given to the writer or failed. `flush()` is awaited when
    admission blocks with groups still buffered: they are what the trainer is waiting for.
    """

    HEARTBEAT_S = 5.0
    BLOCKED_SAY_S = 60.0  # while admission stays blocked, its reason is logged at INFO this often

    def __init__(
        self,
        storage: str,
        run: str,
        *,
        max_lag: int,
        served_version: Callable[[], Awaitable[int]],
        buffered: Callable[[], int],
        flush: Callable[[], Awaitable[None]],
        sampler: str,
        last_step: int | None = None,
        refresh_s: float = 0.25,
        storage_options: dict[str, Any] | None = None,
        logger: logging.Logger | logging.LoggerAdapter = log,
    ):
        self.storage, self.run, self.max_lag = storage, run, max_lag
        self.served_version, self.buffered, self.flush = served_version, buffered, flush
        self.sampler = sampler  # this flow's name: the holder of the slot it writes
        self.slot: str | None = None  # claimed at the first refresh
        self.carried = 0  # the committed groups of the slot's earlier holders, carried on in it
        self.adopted = 0  # what the slot held when this sampler claimed it
        self.generation = 0  # the slot's claim this sampler holds (storage.progress.claim_sampler_slot)
        self.run_end: int | None = None  # the step a pipeline's stop rule ended the run at
        self.refresh_s, self.storage_options, self.log = refresh_s, storage_options, logger
        self.last_step = last_step
        self.stored = 0  # this sampler's groups given to the writer: in shards, or buffered there
        self.sampling = 0
        self.trainer: TrainerPosition | None = None
        self.others = 0  # the other live samplers' committed + in flight, and dead ones' committed
        self.version = 0
        self.refreshed_at = -float("inf")
        self.written_at = -float("inf")
        self.written: tuple[int, int] | None = None
        self.blocked_since: float | None = None
        self.blocked_said = 0.0
        self.lock = asyncio.Lock()

    @property
    def committed(self) -> int:
        """This sampler's groups in shards."""
        return self.stored - self.buffered()

    @property
    def in_flight(self) -> int:
        return self.sampling + self.buffered()

    def pending(self) -> int:
        """Groups admitted by every sampler and not yet consumed by the trainer."""
        consumed = self.trainer.groups_consumed if self.trainer else 0
        return max(0, self.carried + self.stored + self.sampling + self.others - consumed)

    async def acquire(self) -> bool:
        """Wait until one more group may sample, and count it; False once the trainer has taken
        `last_step`'s groups (the sampler's work is done: nothing more will be trained)."""
        async with self.lock:
            while True:
                await self._refresh(force=self.blocked_since is not None)
                if self.done:
                    return False
                if self._admits():
                    if self.blocked_since is not None:
                        self.log.debug("admitting again after %.1fs", time.monotonic() - self.blocked_since)
                        self.blocked_since = None
                    self.sampling += 1
                    return True
                if self.blocked_since is None:
                    self.blocked_since = self.blocked_said = time.monotonic()
                    (self.log.info if self.trainer is None else self.log.debug)(self._why_blocked())
                elif time.monotonic() - self.blocked_said >= self.BLOCKED_SAY_S:  # a long wait is worth a line
                    self.blocked_said = time.monotonic()
                    self.log.info("%s (for %.0f s)", self._why_blocked(), self.blocked_said - self.blocked_since)
                if self.buffered():
                    await self.flush()
                # Blocked: what unblocks it, a reload or the trainer's next step, is usually a
                # fraction of a second away (core.polling), then up to refresh_s.
                await asyncio.sleep(poll_delay(time.monotonic() - self.blocked_since, self.refresh_s))

    def finished(self, stored: bool) -> None:
        """A group admitted by acquire() is done: stored in the writer, or failed (its place is
        given back)."""
        self.sampling -= 1
        if stored:
            self.stored += 1

    @property
    def end_step(self) -> int | None:
        """The last step anything sampled here will be trained in: `last_step`, or earlier where the
        run was ended early (progress/end.json, written by a pipeline whose stop rule held)."""
        ends = [step for step in (self.last_step, self.run_end) if step is not None]
        return min(ends, default=None)

    @property
    def done(self) -> bool:
        return self.trainer is not None and self.end_step is not None and self.trainer.steps >= self.end_step

    def _trains_my_steps(self, trainer: TrainerPosition) -> bool:
        """Whether the position is of a trainer that trains this sampler's steps: one of an earlier
        pipeline phase, which ended before them, has that phase's batch and checkpoint settings."""
        return self.last_step is None or trainer.end_step is None or trainer.end_step >= self.last_step

    def _admits(self) -> bool:
        """The rule, and with an end step nothing that only a later step would train."""
        if self.trainer is None or not self._trains_my_steps(self.trainer):
            return False
        pending, trainer, end = self.pending(), self.trainer, self.end_step
        if end is not None and training_step(pending, trainer.steps, trainer.groups_per_step) > end:
            return False
        return admits(
            pending=pending,
            steps=trainer.steps,
            served_version=self.version,
            groups_per_step=trainer.groups_per_step,
            save_every=trainer.save_every,
            max_lag=self.max_lag,
        )

    def flush_due(self) -> bool:
        """Whether the buffered groups make a step for the trainer: write them now rather than
        when the shard is full or old, since the trainer waits for exactly these."""
        return self.trainer is not None and self.buffered() >= self.trainer.groups_per_step

    @contextlib.asynccontextmanager
    async def heartbeat(self):
        """While open, this sampler's counts are written every HEARTBEAT_S even when no group
        starts (all its lanes busy with long groups), so it is never taken for dead."""

        async def beat() -> None:
            while True:
                await asyncio.sleep(self.HEARTBEAT_S)
                if self.slot is None:
                    continue
                mine = await asyncio.to_thread(
                    read_sampler_position, self.storage, self.run, self.slot, storage_options=self.storage_options
                )
                if mine is None or mine.holder == self.sampler:  # taken over after a stall: the next refresh moves
                    await self._write(force=False)

        beating = asyncio.ensure_future(beat())
        try:
            yield self
        finally:
            beating.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beating

    async def close(self) -> None:
        """Publish the final counts once the flow's writer is closed (its last flush wrote every
        stored group): nothing of this sampler is in flight any more, and it writes no more."""
        self.sampling = 0
        await self._write(force=True, closed=True)

    def _why_blocked(self) -> str:
        if self.trainer is None:
            return "waiting for the trainer's position (progress/trainer.json, written as a trainer starts)"
        if not self._trains_my_steps(self.trainer):
            return (
                f"waiting for a trainer of steps up to {self.last_step}: progress/trainer.json is of one that "
                f"ended at step {self.trainer.end_step} (the phase's trainer writes its own as it starts)"
            )
        return (
            f"waiting for the trainer: {self.pending()} groups admitted and not consumed (this flow: "
            f"{self.sampling} sampling, {self.buffered()} buffered, {self.committed} in shards; other flows "
            f"{self.others}; trainer consumed {self.trainer.groups_consumed}), trainer at "
            f"step {self.trainer.steps} (published {self.trainer.policy_version}), servers at "
            f"{self.version}, max lag {self.max_lag}"
        )

    async def _refresh(self, force: bool) -> None:
        now = time.monotonic()
        if not force and now - self.refreshed_at < self.refresh_s:
            return
        self.refreshed_at = now
        self.version = await self.served_version()
        if self.slot is None:
            await asyncio.to_thread(self._claim)
        self.trainer, samplers, self.run_end = await asyncio.to_thread(self._read_positions)
        wall = time.time()
        mine = next((s for s in samplers if s.sampler == self.slot), None)
        if mine is not None and mine.holder != self.sampler:
            await self._taken_over(mine)
        self.others = sum(
            s.committed + (0 if s.free(wall) else s.in_flight)  # a dead holder's in-flight never arrive
            for s in samplers
            if s.sampler != self.slot
        )
        await self._write(force=False)

    def _claim(self) -> None:
        claimed = claim_sampler_slot(self.storage, self.run, self.sampler, storage_options=self.storage_options)
        self.slot, self.carried = claimed.sampler, claimed.committed
        self.adopted, self.generation = claimed.adopted, claimed.generation
        if claimed.sampler != self.sampler:
            self.log.debug("sampler slot %s taken over with %d committed groups", claimed.sampler, claimed.committed)

    async def _taken_over(self, mine: SamplerPosition) -> None:
        """Another flow took this sampler's slot over (it stopped writing long enough to look dead):
        it carries on what it read there, `mine.adopted`; the groups
        this sampler counted past that go on in a slot of its own."""
        self.log.warning("sampler slot %s was taken over by %s; going on in a new one", self.slot, mine.holder)
        self.slot, self.carried = f"{self.sampler}-{uuid.uuid4().hex[:6]}", self.carried - mine.adopted
        self.adopted, self.generation, self.written = 0, 0, None
        await self._write(force=True)

    def _read_positions(self) -> tuple[TrainerPosition | None, list[SamplerPosition], int | None]:
        """The trainer's position, then the samplers': read in this order, `groups_consumed` is
        never newer than the samplers' counts. Then the run's end, if a pipeline ended it early."""
        options = dict(storage_options=self.storage_options)
        trainer = read_trainer_position(self.storage, self.run, **options)
        samplers = read_sampler_positions(self.storage, self.run, **options)
        return trainer, samplers, read_run_end(self.storage, self.run, **options)

    async def _write(self, force: bool, closed: bool = False) -> None:
        counts = (self.carried + self.committed, self.in_flight)
        now = time.monotonic()
        if self.slot is None or (not force and counts == self.written and now - self.written_at < self.HEARTBEAT_S):
            return
        position = SamplerPosition(
            self.slot,
            committed=counts[0],
            in_flight=counts[1],
            closed=closed,
            holder=self.sampler,
            adopted=self.adopted,
            generation=self.generation,
        )
        await asyncio.to_thread(
            write_sampler_position, self.storage, self.run, position, storage_options=self.storage_options
        )
        self.written, self.written_at = counts, now
