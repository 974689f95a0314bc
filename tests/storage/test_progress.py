"""The run's progress documents round-trip on every backend, are replaced whole, and a sampler
list is one file per sampler."""

from __future__ import annotations

import pytest

from storage.progress import (
    SamplerPosition,
    TrainerPosition,
    read_sampler_positions,
    read_trainer_position,
    write_sampler_position,
    write_trainer_position,
)
from storage.reader import ShardReader


def test_positions_round_trip_and_replace_whole(root: str) -> None:
    assert read_trainer_position(root, "run") is None and read_sampler_positions(root, "run") == []
    first = TrainerPosition(steps=3, groups_consumed=12, policy_version=3, groups_per_step=4, save_every=1, max_staleness=1)
    write_trainer_position(root, "run", first)
    assert read_trainer_position(root, "run") == first
    later = TrainerPosition(steps=4, groups_consumed=16, policy_version=4, groups_per_step=4, save_every=1, max_staleness=1)
    write_trainer_position(root, "run", later)
    assert read_trainer_position(root, "run") == later

    for name, committed in (("a", 5), ("b", 7), ("a", 9)):
        write_sampler_position(root, "run", SamplerPosition(name, committed=committed, in_flight=2))
    samplers = sorted(read_sampler_positions(root, "run"), key=lambda p: p.sampler)
    assert [(p.sampler, p.committed, p.in_flight) for p in samplers] == [("a", 9, 2), ("b", 7, 2)]
    assert ShardReader(root, "run").new_shards() == []  # progress is not rollout data


def test_a_bad_sampler_name_is_refused(root: str) -> None:
    with pytest.raises(ValueError, match="sampler 'a/b'"):
        write_sampler_position(root, "run", SamplerPosition("a/b", committed=0, in_flight=0))
