"""Bounded staleness: the admission rule as a pure function, simulated against a trainer over many
combinations of lag, batch, checkpoint interval, lanes and speeds (no deadlock, nothing stale,
about (k + 1) steps of groups waiting), and the Admission controller on real progress files."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import random
import time
from collections import deque
from dataclasses import dataclass, field

import pytest

from flows.admission import Admission, admits
from storage.progress import (
    SamplerPosition,
    TrainerPosition,
    groups_committed,
    read_sampler_positions,
    read_trainer_position,
    write_run_end,
    write_sampler_position,
    write_trainer_position,
)


def test_the_rule_by_hand():
    rule = dict(groups_per_step=4, save_every=1, max_lag=1)
    # Trainer took step 3's data (published 2), servers at 2: step 4 trains on version 3, step 5
    # on 4. A group queued behind 0-3 others goes to step 4 (lag 1 from version 2): admitted;
    # behind 4 it would go to step 5 (lag 2): not.
    assert admits(pending=3, steps=3, served_version=2, **rule)
    assert not admits(pending=4, steps=3, served_version=2, **rule)
    # k = 0: nothing while the trainer trains step 4 on version 3 with the servers still at 3...
    on_policy = dict(rule, max_lag=0)
    assert admits(pending=3, steps=3, served_version=3, **on_policy)
    assert not admits(pending=0, steps=4, served_version=3, **on_policy)
    # ... and one step's worth once it published 4 and the servers serve it.
    assert admits(pending=3, steps=4, served_version=4, **on_policy)
    assert not admits(pending=4, steps=4, served_version=4, **on_policy)
    # Checkpoints every 3 steps: steps 4-6 all train on version 3, so k = 0 admits three steps.
    every_three = dict(on_policy, save_every=3)
    assert admits(pending=11, steps=3, served_version=3, **every_three)
    assert not admits(pending=12, steps=3, served_version=3, **every_three)


@dataclass
class Simulation:
    """A trainer, a sampler of `lanes` lanes admitted by the rule, and servers that reload each
    checkpoint after `reload_s`; time in units of one group's mean sampling time."""

    max_lag: int
    groups_per_step: int
    save_every: int
    lanes: int
    train_s: float  # one optimizer step
    reload_s: float
    seed: int = 0
    # trainer
    steps: int = 0  # whose data it took (published with `consumed`)
    consumed: int = 0
    published: int = 0
    training_until: float | None = None
    taking: list = field(default_factory=list)  # fresh groups of the step being gathered
    taking_stale: int = 0
    # servers and sampler
    served: int = 0
    reloads: deque = field(default_factory=deque)
    sampling: list = field(default_factory=list)  # (done_at, version)
    queue: deque = field(default_factory=deque)  # committed versions, shard order
    committed: int = 0
    # what happened
    trained: list = field(default_factory=list)  # (policy version of the step, group's version)
    stale: int = 0
    most_waiting: int = 0

    def pending(self) -> int:
        return self.committed + len(self.sampling) - self.consumed

    def run(self, target_steps: int, horizon: float) -> float:
        rng = random.Random(self.seed)
        now, dt = 0.0, 0.05
        while self.steps < target_steps or self.training_until is not None:
            if now > horizon:
                raise AssertionError(f"deadlock or stall at t={now:.0f}: {self}")
            # servers: reloads land after reload_s
            while self.reloads and self.reloads[0][0] <= now:
                self.served = self.reloads.popleft()[1]
            # sampler: finished groups commit; idle lanes start a group when admitted
            for done in [s for s in self.sampling if s[0] <= now]:
                self.sampling.remove(done)
                self.queue.append(done[1])
                self.committed += 1
            while len(self.sampling) < self.lanes and admits(
                pending=self.pending(),
                steps=self.steps,
                served_version=self.served,
                groups_per_step=self.groups_per_step,
                save_every=self.save_every,
                max_lag=self.max_lag,
            ):
                self.sampling.append((now + rng.uniform(0.5, 1.5), self.served))
            self.most_waiting = max(self.most_waiting, self.pending())
            # trainer: finish a step (publish), or gather the next step's fresh groups
            if self.training_until is not None and self.training_until <= now:
                self.training_until = None
                if self.steps % self.save_every == 0:
                    self.published = self.steps
                    self.reloads.append((now + self.reload_s, self.steps))
            if self.training_until is None and self.steps < target_steps:
                while self.queue and len(self.taking) < self.groups_per_step:
                    version = self.queue.popleft()
                    if self.published - version > self.max_lag:
                        self.taking_stale += 1
                        self.consumed += 1  # published at once (trainer.data.next_step_groups' on_wait)
                    else:
                        self.taking.append(version)
                if len(self.taking) == self.groups_per_step:
                    self.trained += [(self.published, version) for version in self.taking]
                    self.consumed += len(self.taking)
                    self.stale += self.taking_stale
                    self.taking, self.taking_stale = [], 0
                    self.steps += 1
                    self.training_until = now + self.train_s
            now += dt
        return now


COMBINATIONS = list(
    itertools.product(
        [0, 1, 2, 4],  # max lag k
        [1, 3, 8],  # groups per step B
        [1, 2, 3],  # save every N
        [1, 4, 32],  # lanes
        [0.1, 1.0, 3.0, 40.0],  # train time per step, in group sampling times
    )
)


@pytest.mark.parametrize("max_lag, groups_per_step, save_every, lanes, train_s", COMBINATIONS)
def test_the_loop_never_deadlocks_and_trains_nothing_stale(max_lag, groups_per_step, save_every, lanes, train_s):
    sim = Simulation(max_lag, groups_per_step, save_every, lanes, train_s, reload_s=0.3)
    steps = 12
    # Generous: the slowest loop is synchronous, one step's sampling then its training and reload.
    horizon = steps * (train_s + 2.0 * (groups_per_step / min(lanes, groups_per_step) + 1) + 1.0) + 50
    sim.run(steps, horizon)
    assert len(sim.trained) == steps * groups_per_step
    assert all(version - sampled <= max_lag for version, sampled in sim.trained)
    # Groups finish out of the order they were admitted in: one admitted at the edge of its step's
    # lag can be overtaken and land a step later, stale. That only happens when a step trains
    # about as fast as its groups sample, and costs little even then.
    stale_fraction = sim.stale / (sim.stale + len(sim.trained))
    assert stale_fraction <= 0.25
    if train_s >= 3.0:
        assert sim.stale == 0, "the rule admitted a group the trainer then skipped as stale"
    # About (k + 1) steps of groups wait: one more checkpoint interval at most, rounded to whole steps.
    assert sim.most_waiting <= (max_lag + save_every) * groups_per_step + groups_per_step


def test_k0_is_the_synchronous_loop_and_k1_overlaps_sampling_with_training():
    def wall_time(max_lag: int) -> float:
        sim = Simulation(max_lag, groups_per_step=8, save_every=1, lanes=8, train_s=1.0, reload_s=0.1)
        return sim.run(20, horizon=10_000)

    synchronous, one_off = wall_time(0), wall_time(1)
    # k = 0 alternates: sample a step (~1.4, the slowest of 8 groups), train it (1), reload (0.1).
    assert synchronous == pytest.approx(20 * 2.5, rel=0.15)
    assert one_off < 0.75 * synchronous


# --- the controller on real progress files -----------------------------------------------------


class Served:
    def __init__(self, version: int = 0):
        self.version = version

    async def __call__(self) -> int:
        return self.version


async def admitted_within(admission: Admission, seconds: float) -> bool:
    try:
        await asyncio.wait_for(admission.acquire(), timeout=seconds)
    except TimeoutError:
        return False
    return True


def position(steps: int, consumed: int, version: int, groups_per_step: int = 2, max_lag: int = 0) -> TrainerPosition:
    return TrainerPosition(
        steps=steps,
        groups_consumed=consumed,
        policy_version=version,
        groups_per_step=groups_per_step,
        save_every=1,
        max_lag=max_lag,
    )


async def test_the_controller_follows_the_trainer_and_flushes_what_it_waits_for(tmp_path):
    root = str(tmp_path)
    flushed = []
    served = Served(0)
    writer = {"buffered": 0}  # what the flow's shard writer holds

    async def flush():
        flushed.append(writer["buffered"])
        writer["buffered"] = 0

    admission = Admission(
        root,
        "run",
        max_lag=0,
        served_version=served,
        buffered=lambda: writer["buffered"],
        flush=flush,
        sampler="a",
        refresh_s=0.02,
    )
    assert not await admitted_within(admission, 0.2), "no trainer position yet: wait for one"
    write_trainer_position(root, "run", position(steps=0, consumed=0, version=0))
    assert await admitted_within(admission, 1) and await admitted_within(admission, 1)
    for _ in range(2):
        admission.finished(stored=True)
        writer["buffered"] += 1
    assert not await admitted_within(admission, 0.2), "two groups pending = one step for k = 0"
    assert flushed[:1] == [2], "blocked with groups buffered: flush them for the trainer"
    assert read_sampler_positions(root, "run") == [
        SamplerPosition("a", 2, 0, updated_at=pytest.approx(0, abs=1e12), holder="a")
    ]

    # The trainer took both for step 1 and trains on version 0: k = 0 waits for version 1 served.
    write_trainer_position(root, "run", position(steps=1, consumed=2, version=0))
    assert not await admitted_within(admission, 0.2)
    write_trainer_position(root, "run", position(steps=1, consumed=2, version=1))
    assert not await admitted_within(admission, 0.2), "published, but the servers still serve 0"
    served.version = 1
    assert await admitted_within(admission, 1)
    admission.finished(stored=False)  # a failed group gives its place back
    assert await admitted_within(admission, 1) and await admitted_within(admission, 1)
    assert not await admitted_within(admission, 0.2)


async def test_a_blocked_sampler_looks_again_soon_not_at_its_slowest_refresh(tmp_path):
    """Blocked on the servers' version, a sampler re-reads soon, then less often: admitted a moment
    after the reload announces, well before the slowest refresh (3 s here) would come round."""
    root = str(tmp_path)
    served = Served(0)

    async def flush():
        pass

    admission = Admission(
        root, "run", max_lag=0, served_version=served, buffered=lambda: 0, flush=flush, sampler="a", refresh_s=3.0
    )
    write_trainer_position(root, "run", position(steps=1, consumed=2, version=1))
    waiting = asyncio.ensure_future(admission.acquire())
    await asyncio.sleep(0.1)
    assert not waiting.done(), "version 1 is trained on, the servers serve 0: blocked"
    served.version = 1
    started = time.monotonic()
    assert await asyncio.wait_for(waiting, timeout=10)
    assert time.monotonic() - started < 1.5  # the old fixed 3 s sleep: up to 3 s


async def test_a_run_ended_early_at_the_trainers_position_ends_the_sampler(tmp_path):
    """A pipeline whose stop rule held writes the step the run ended at (progress/end.json): the
    sampler admits nothing more and acquire says it is done (False), as at a phase's last step."""
    root = str(tmp_path)
    admission = Admission(
        root,
        "run",
        max_lag=1,
        served_version=Served(3),
        buffered=lambda: 0,
        flush=lambda: asyncio.sleep(0),
        sampler="a",
        refresh_s=0.02,
        last_step=100,
    )
    write_trainer_position(root, "run", position(steps=3, consumed=6, version=3, max_lag=1))
    assert await admitted_within(admission, 1) and admission.end_step == 100
    write_run_end(root, "run", 3)
    await asyncio.sleep(0.05)  # past refresh_s: the next acquire reads the positions again
    assert await asyncio.wait_for(admission.acquire(), timeout=1) is False
    assert admission.done and admission.end_step == 3


async def test_a_sampler_of_a_later_phase_waits_for_that_phases_trainer(tmp_path):
    """At a phase's start progress/trainer.json may still be the last phase's trainer's, with that
    phase's batch: a sampler of steps up to 10 waits until a trainer of those steps announces."""
    root = str(tmp_path)
    admission = Admission(
        root,
        "run",
        max_lag=1,
        served_version=Served(4),
        buffered=lambda: 0,
        flush=lambda: asyncio.sleep(0),
        sampler="a",
        refresh_s=0.02,
        last_step=10,
    )
    write_trainer_position(root, "run", dataclasses.replace(position(steps=4, consumed=8, version=4), end_step=4))
    assert not await admitted_within(admission, 0.2)
    assert "a trainer of steps up to 10" in admission._why_blocked()
    write_trainer_position(root, "run", dataclasses.replace(position(steps=4, consumed=8, version=4), end_step=10))
    assert await admitted_within(admission, 1)


async def test_other_samplers_count_and_dead_ones_only_with_what_they_committed(tmp_path):
    root = str(tmp_path)
    write_trainer_position(root, "run", position(steps=0, consumed=0, version=0, groups_per_step=4))

    async def flush():
        pass

    admission = Admission(
        root, "run", max_lag=0, served_version=Served(0), buffered=lambda: 0, flush=flush, sampler="me", refresh_s=0.02
    )
    await admission._refresh(force=True)  # claims its slot: a new one, none is free
    write_sampler_position(root, "run", SamplerPosition("live", committed=1, in_flight=2, holder="live"))
    write_sampler_position(
        root, "run", SamplerPosition("dead", committed=0, in_flight=5, holder="dead", updated_at=1.0)
    )
    await asyncio.sleep(0.05)  # past refresh_s: the next acquire reads them
    assert await admitted_within(admission, 1), "3 of 4 pending: one more fits"
    assert not await admitted_within(admission, 0.2)
    await admission.close()
    mine = {p.sampler: p for p in read_sampler_positions(root, "run")}["me"]
    assert (mine.committed, mine.in_flight, mine.closed, mine.holder) == (0, 0, True, "me")
    assert read_trainer_position(root, "run").groups_per_step == 4


async def flush_nothing():
    pass


def sampler(root: str, name: str, **options) -> Admission:
    return Admission(
        root,
        "run",
        max_lag=0,
        served_version=Served(0),
        buffered=lambda: 0,
        flush=flush_nothing,
        sampler=name,
        refresh_s=0.0,
        **options,
    )


async def store(admission: Admission, groups: int) -> None:
    for _ in range(groups):
        assert await admission.acquire()
        admission.finished(stored=True)


async def test_a_starting_sampler_takes_over_a_closed_slot_and_its_count(tmp_path, monkeypatch):
    """Each slot file has one writer: a flow that ended leaves its slot closed and the next flow
    takes it over, carrying its committed groups on, so the samplers' directory holds as many
    files as flows ran at once and every committed group counts once."""
    root = str(tmp_path)
    write_trainer_position(root, "run", position(steps=0, consumed=0, version=0, groups_per_step=8))
    ended = sampler(root, "ended")
    await store(ended, 3)
    await ended.close()
    write_sampler_position(root, "run", SamplerPosition("live", committed=1, in_flight=0, holder="live"))
    me = sampler(root, "me")
    await me._refresh(force=True)
    assert (me.slot, me.pending(), groups_committed(root, "run")) == ("ended", 4, 4)
    await store(me, 2)
    await me.close()
    slots = {p.sampler: p for p in read_sampler_positions(root, "run")}
    assert sorted(slots) == ["ended", "live"] and (slots["ended"].holder, slots["ended"].committed) == ("me", 5)
    assert groups_committed(root, "run") == 6


async def test_a_holder_taken_for_dead_goes_on_in_a_new_slot_counting_each_group_once(tmp_path, monkeypatch):
    """A flow that stopped writing for DEAD_AFTER_S looks dead and a new flow takes its slot over
    with what it read there; when the slow one writes again it sees that and moves its later
    groups to a slot of its own."""
    root = str(tmp_path)
    write_trainer_position(root, "run", position(steps=0, consumed=0, version=0, groups_per_step=16))
    slow = sampler(root, "slow")
    await store(slow, 2)
    await slow._write(force=True)
    stalled = read_sampler_positions(root, "run")[0]
    write_sampler_position(root, "run", dataclasses.replace(stalled, updated_at=time.time() - 61))
    new = sampler(root, "new")
    await store(new, 1)
    assert (new.slot, new.carried) == ("slow", 2)
    await store(slow, 1)  # it refreshes, sees the slot held by "new", and moves
    assert slow.slot.startswith("slow-")
    for admission in (new, slow, new):  # each reads the other's latest counts
        await admission._refresh(force=True)
    assert slow.pending() == new.pending() == 4
    await slow.close()
    await new.close()
    assert groups_committed(root, "run") == 4


async def test_the_heartbeat_writes_while_no_group_starts_and_never_over_a_slot_taken_over(tmp_path, monkeypatch):
    root = str(tmp_path)
    write_trainer_position(root, "run", position(steps=0, consumed=0, version=0, groups_per_step=16))
    slow = sampler(root, "slow")
    slow.HEARTBEAT_S = 0.05
    await store(slow, 1)  # claims its slot
    async with slow.heartbeat():
        first = read_sampler_positions(root, "run")[0].updated_at
        await asyncio.sleep(0.3)
        assert read_sampler_positions(root, "run")[0].updated_at > first, "no group started, yet it wrote"
        taken = SamplerPosition("slow", committed=1, in_flight=0, holder="new", adopted=1)
        write_sampler_position(root, "run", taken)
        await asyncio.sleep(0.3)
        assert read_sampler_positions(root, "run") == [taken]
