"""Load: two rollout flows and a reprocess job write one run at the same time while two trainer
ranks (torchrun, gloo on CPU) train it; every group is trained by exactly one step, no shard
clashes with another (every writer exits 0; no group id in two shards), nothing is torn. Real
processes throughout (soak.parts). Then a reprocess job of an
old run into a run whose trainer has moved on: its output shards get new ids, so the reader takes them."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from soak import checks
from soak.groups import draw_group
from soak.parts import BIN, Part, part_environment, rollout_part, trainer_part
from storage.index import add_entry
from storage.layout import ROLLOUTS, TEMPORARY, ShardLocation, join, new_shard_id
from storage.reader import ShardReader
from storage.schema import groups_to_table
from storage.shard_file import write_shard
from storage.writer import ShardWriter

pytestmark = [pytest.mark.integration, pytest.mark.slow]

GROUPS_PER_STEP = 4
# Every step kept (keep_last null): the tally checks each step's checkpoint.
SETTINGS = {"groups_per_step": GROUPS_PER_STEP, "save_every": 1, "max_lag": 10**6, "lr": 1e-3, "keep_last": None}


def reprocess_part(source_url: str, run_url: str, tmp_path: Path, env: dict[str, str]) -> Part:
    command = [str(BIN / "clotho"), "reprocess", source_url, run_url, "advantages:mode=leave_one_out"]
    return Part("reprocess", command, env=env, log_path=tmp_path / "logs" / "reprocess.log")


def finish(parts: list[Part], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for part in parts:
        code = part.wait(max(1.0, deadline - time.monotonic()))
        if code is None:
            part.kill()
        assert code == 0, f"{part.name} exited {code}:\n{part.log_tail()}"


def test_two_flows_and_a_reprocess_job_write_one_run_two_trainer_ranks_train_each_group_once(
    tmp_path, policy_server, tiny_model_dir, prefect_server
):
    env = part_environment(prefect_server.api_url, prefect_server.home)
    root = f"file://{tmp_path}/store"
    run_url = f"{root}/run"
    # The reprocess job's input: another run's 8 groups in 4 shards.
    with ShardWriter(root, "source", tokenizer=str(tiny_model_dir), max_groups=2) as writer:
        writer.add_many([draw_group(f"source-{n}", 4) for n in range(8)])
    total = 8 + 2 * 12
    trainer = trainer_part(run_url, tiny_model_dir, total // GROUPS_PER_STEP, SETTINGS, tmp_path, env, ranks=2).start()
    writers = [
        rollout_part(
            run_url, policy_server.base_url, tiny_model_dir, 12, seed, tmp_path, env, delay_s=0.3, shard_max_age_s=1.0
        )
        for seed in (1, 2)
    ] + [reprocess_part(f"{root}/source", run_url, tmp_path, env)]
    try:
        for part in writers:
            part.start()
        finish(writers, timeout_s=300)
        finish([trainer], timeout_s=300)
    finally:
        for part in [*writers, trainer]:
            part.stop()

    assert "on 2 rank(s)" in trainer.log_tail(100_000)
    counted = checks.tally(run_url, total // GROUPS_PER_STEP, GROUPS_PER_STEP)
    assert counted.committed == total, counted
    assert not (counted.lost or counted.twice or counted.torn or counted.wrong_steps), counted
    items = checks.read_storage(run_url).item_ids
    assert {f"source-{n}" for n in range(8)} | {f"{seed}-{n}" for seed in (1, 2) for n in range(1, 13)} == items


def aged_source(root: str, model: Path, hours: float) -> None:
    """A run whose 8 groups were committed `hours` ago (their shard ids say so), as when last
    week's run is reprocessed into today's."""
    from storage.filesystem import resolve

    fs, run_path = resolve(f"{root}/source")
    then = time.time_ns() - int(hours * 3600e9)
    for shard in range(4):
        location = ShardLocation("distinct", 0, new_shard_id(then + shard))
        add_entry(fs, run_path, location)
        table = groups_to_table([draw_group(f"old-{shard}-{n}", 4) for n in range(2)], str(model))
        write_shard(fs, join(run_path, ROLLOUTS, location.name), table, join(run_path, TEMPORARY))


def test_shards_reprocessed_from_an_old_run_into_a_trained_run_reach_its_trainer(
    tmp_path, tiny_model_dir, prefect_server
):
    """A trainer's reader has consumed everything its run holds (its watermark now trails its
    clock by GRACE_S); then a reprocess job writes an hour-old run's groups into the run: the
    reader must hand them out too."""
    env = part_environment(prefect_server.api_url, prefect_server.home)
    root = f"file://{tmp_path}/store"
    aged_source(root, tiny_model_dir, hours=1.0)
    with ShardWriter(root, "run", tokenizer=str(tiny_model_dir)) as writer:
        writer.add_many([draw_group(f"live-{n}", 4) for n in range(4)])
    reader = ShardReader(root, "run")
    assert len(list(reader.groups())) == 4
    assert list(reader.groups()) == []  # the pass that moves the watermark up to its clock less GRACE_S
    reprocess = reprocess_part(f"{root}/source", f"{root}/run", tmp_path, env)
    finish([reprocess.start()], timeout_s=300)
    assert len(checks.read_storage(f"{root}/run").groups) == 4 + 8  # written, and readable
    handed_out = sorted(group.item_id for group in reader.groups())
    assert handed_out == sorted(f"old-{shard}-{n}" for shard in range(4) for n in range(2))
