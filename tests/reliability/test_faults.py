"""Fault injection into a running loop, the CI subset of `make soak` (soak/): SIGKILL of rollout
flows and of the trainer at random moments, each restarted; afterwards every committed group was
trained by exactly one step, nothing is torn, and an uninterrupted trainer replaying the same
shards publishes the same weights bit for bit. The checks themselves are pinned first, on a run
made by hand with a lost group, a group trained twice and a torn file."""

from __future__ import annotations

import random

import pytest

from clotho.testing.s3_server import s3_bucket
from core.scored_group import ScoredGroup, ScoredSequence
from soak import checks
from soak.faults import run_trials
from soak.loop import Loop, Settings
from storage.checkpoints import publish_checkpoint
from storage.layout import ROLLOUTS
from storage.ledger import Ledger, shard_id_of
from storage.writer import ShardWriter


def groups(count: int, first: int) -> list[ScoredGroup]:
    sequence = ScoredSequence.from_prompt([5, 6], [7, 8], [-1.0, -1.0], 1.0)
    return [
        ScoredGroup(env="toy", item_id=str(first + n), sequences=[sequence], policy_version=0) for n in range(count)
    ]


def publish_ledger(tmp_path, root: str, step: int, ledger: Ledger) -> None:
    weights = tmp_path / f"weights-{step}"
    weights.mkdir()
    (weights / "config.json").write_text("{}")
    publish_checkpoint(weights, root, "run", step, extra={"ledger": ledger.to_dict()})


def shard_named(shard_id: str, stored: dict) -> str:
    return next(name for name in stored if shard_id in name)


def test_the_checks_count_lost_twice_and_torn(tmp_path):
    """Three shards of two groups; step 1 takes shard A, step 2's ledger forgets A and takes B,
    step 3 takes A again (A trained twice), nobody takes C (lost); a stray file is torn."""
    root = f"file://{tmp_path}/store"
    with ShardWriter(root, "run", tokenizer="tiny", max_groups=10**6) as writer:
        for first in (0, 2, 4):
            writer.add_many(groups(2, first))
            writer.flush()
    a, b, c = sorted({shard_id_of(group.shard) for group in checks.read_storage(f"{root}/run").groups})
    publish_ledger(tmp_path, root, 1, Ledger(consumed={a}))
    publish_ledger(tmp_path, root, 2, Ledger(consumed={b}))
    publish_ledger(tmp_path, root, 3, Ledger(consumed={a, b}))
    stray = tmp_path / "store" / "run" / ROLLOUTS / "env=toy" / "policy_version=0" / ".half-written.tmp"
    stray.write_bytes(b"PAR1")

    counted = checks.tally(f"{root}/run", up_to_step=3, groups_per_step=2)
    assert counted.committed == 6
    stored = checks.read_storage(f"{root}/run").by_shard
    assert counted.lost == {group.group_id for group in stored[shard_named(c, stored)]}
    assert counted.twice == {group.group_id for group in stored[shard_named(a, stored)]}
    assert [t.split(":")[0] for t in counted.torn] == ["env=toy/policy_version=0/.half-written.tmp"]
    # Every step took two groups (the wrong two included); step 2's ledger forgot step 1's.
    assert counted.wrong_steps == ["step 2's ledger lost 2 groups step 1's held"]


# Kills land while the flow samples, never in its exit flush: a kill between a shard's index entry
# and the shard stalls the trainer for storage.index.GRACE_S (soak/run.py reports it).
SETTINGS = Settings(steps_per_trial=2, delay_s=0.3, shard_max_age_s=5.0, rollout_kill_tail_s=-0.2, rollout_anywhere=0.0)


def run_killed_loop(
    tmp_path, policy_server, tiny_model_dir, prefect_server, plan: dict[str, int], seed: int, storage: str | None = None
):
    """Segments of 2 steps of 4 groups, `plan[fault]` trials of each fault (killed at moments
    drawn from `seed`), then the uninterrupted replay; asserts every check. No reload watcher: the
    session's policy server keeps its base weights for the other tests."""
    loop = Loop(
        tmp_path / "loop",
        tiny_model_dir,
        policy_server.base_url,
        settings=SETTINGS,
        prefect_api_url=prefect_server.api_url,
        prefect_home=prefect_server.home,
        watch=False,
        storage=storage,
    )
    rng = random.Random(seed)
    try:
        loop.start()
        trials = [trial for fault, count in plan.items() for trial in run_trials(loop, fault, count, rng)]
        comparisons = loop.replay(trials)
    finally:
        loop.stop()
    described = "\n".join(str(trial) for trial in trials)
    assert all(trial.ok for trial in trials), described
    assert [trial.committed for trial in trials] == [8] * sum(plan.values()), described
    assert sum(trial.lost + trial.twice + trial.torn for trial in trials) == 0, described
    assert len(comparisons) == loop.last_step() >= 2 * sum(plan.values())
    assert all(c.equal and c.same_groups for c in comparisons), comparisons
    return trials


@pytest.mark.integration
@pytest.mark.slow
def test_killed_rollout_flows_and_trainer_lose_nothing_and_train_nothing_twice(
    tmp_path, policy_server, tiny_model_dir, prefect_server
):
    """Two rollout-flow kills and two trainer kills on one run. The flush window (5 s) is longer
    than a segment's sampling, so a flow killed mid-sampling loses every group it finished
    (bounded by the window) and a top-up flow makes them again."""
    trials = run_killed_loop(
        tmp_path, policy_server, tiny_model_dir, prefect_server, {"rollout flow": 2, "trainer": 2}, seed=20
    )
    assert all(trial.uncommitted_oldest_s <= 5.0 + 2.0 for trial in trials[:2]), trials


@pytest.fixture
def s3_store():
    """A bucket on a moto S3 server of the test's own, the AWS variables pointing at it."""
    with s3_bucket("clotho-faults"):
        yield "s3://clotho-faults"


@pytest.mark.integration
@pytest.mark.slow
def test_a_trainer_killed_on_s3_loses_nothing(tmp_path, policy_server, tiny_model_dir, prefect_server, s3_store):
    """The same on a run stored through the S3 API, with trainer kills. A restarted trainer lists
    the run when it starts (the tokenizer check); s3fs used to answer later reads in the listed
    partitions from that listing, so the trainer passed shards written afterwards as never
    written and lost their groups (storage.filesystem.resolve turns that cache off)."""
    run_killed_loop(tmp_path, policy_server, tiny_model_dir, prefect_server, {"trainer": 2}, seed=21, storage=s3_store)
