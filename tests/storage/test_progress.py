"""The run's progress documents round-trip on every backend, are replaced whole, and a sampler
list is one file per slot."""

from __future__ import annotations

import pytest

from storage.filesystem import resolve
from storage.progress import (
    SamplerPosition,
    TrainerPosition,
    announce_trainer,
    claim_sampler_slot,
    clear_run_end,
    groups_committed,
    read_run_end,
    read_sampler_position,
    read_sampler_positions,
    read_trainer_position,
    sampler_position_url,
    write_run_end,
    write_sampler_position,
    write_trainer_position,
)
from storage.reader import ShardReader


def test_positions_round_trip_and_replace_whole(root: str) -> None:
    assert read_trainer_position(root, "run") is None and read_sampler_positions(root, "run") == []
    first = TrainerPosition(steps=3, groups_consumed=12, policy_version=3, groups_per_step=4, save_every=1, max_lag=1)
    write_trainer_position(root, "run", first)
    assert read_trainer_position(root, "run") == first
    later = TrainerPosition(steps=4, groups_consumed=16, policy_version=4, groups_per_step=4, save_every=1, max_lag=1)
    write_trainer_position(root, "run", later)
    assert read_trainer_position(root, "run") == later

    for name, committed in (("a", 5), ("b", 7), ("a", 9)):
        write_sampler_position(root, "run", SamplerPosition(name, committed=committed, in_flight=2, holder=name))
    samplers = sorted(read_sampler_positions(root, "run"), key=lambda p: p.sampler)
    assert [(p.sampler, p.committed, p.in_flight) for p in samplers] == [("a", 9, 2), ("b", 7, 2)]
    assert ShardReader(root, "run").new_shards() == []  # progress is not rollout data


def test_a_bad_sampler_name_is_refused(root: str) -> None:
    with pytest.raises(ValueError, match="sampler 'a/b'"):
        write_sampler_position(root, "run", SamplerPosition("a/b", committed=0, in_flight=0, holder="a/b"))


def test_flows_racing_for_free_slots_never_hold_one_slot_together(root: str) -> None:
    """8 flows start at once where 4 slots are free, 50 times over: each free slot goes to exactly
    one of them (a claim written only where none exists), the other 4 make slots of their own, and
    every committed group counts once."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    flows, free = 8, 4
    for index in range(free):
        write_sampler_position(
            root,
            "run",
            SamplerPosition(f"slot{index}", committed=index + 1, in_flight=0, holder=f"flow{index}", closed=True),
        )
    total = groups_committed(root, "run")
    rounds = 50
    with ThreadPoolExecutor(flows) as pool:
        for round_ in range(rounds):
            start = threading.Barrier(flows)

            def claim(holder: str, start: threading.Barrier = start) -> SamplerPosition:
                start.wait()
                return claim_sampler_slot(root, "run", holder)

            claims = list(pool.map(claim, [f"r{round_}f{index}" for index in range(flows)]))
            taken = [c.sampler for c in claims if c.sampler.startswith("slot")]
            assert sorted(taken) == [f"slot{index}" for index in range(free)], claims  # each free slot once
            assert all(read_sampler_position(root, "run", c.sampler).holder == c.holder for c in claims)
            assert groups_committed(root, "run") == total  # carried on once, never twice
            for c in claims:  # the holders end: their slots are free for the next round; the new ones go
                if c.sampler.startswith("slot"):
                    write_sampler_position(
                        root,
                        "run",
                        SamplerPosition(
                            c.sampler,
                            c.committed,
                            0,
                            closed=True,
                            holder=c.holder,
                            adopted=c.adopted,
                            generation=c.generation,
                        ),
                    )
                else:
                    fs, path = resolve(sampler_position_url(root, "run", c.sampler))
                    fs.rm(path)
    assert {p.sampler: p.generation for p in read_sampler_positions(root, "run") if p.sampler.startswith("slot")} == {
        f"slot{index}": rounds for index in range(free)
    }


def test_the_announced_trainer_keeps_the_runs_counts_with_its_own_settings(root: str) -> None:
    assert announce_trainer(root, "run", groups_per_step=4, save_every=2, max_lag=1, end_step=10).steps == 0
    write_trainer_position(
        root,
        "run",
        TrainerPosition(
            steps=10,
            groups_consumed=41,
            policy_version=10,
            groups_per_step=4,
            save_every=2,
            max_lag=1,
            end_step=10,
        ),
    )
    later = announce_trainer(root, "run", groups_per_step=8, save_every=1, max_lag=0, end_step=30)
    assert (later.steps, later.groups_consumed, later.policy_version, later.groups_per_step, later.end_step) == (
        10,
        41,
        10,
        8,
        30,
    )
    assert read_trainer_position(root, "run") == later
    assert read_run_end(root, "run") is None
    write_run_end(root, "run", 12)
    assert read_run_end(root, "run") == 12
    clear_run_end(root, "run")
    assert read_run_end(root, "run") is None
