"""--max-policy-lag: the rollout flow waits while the trainer has not consumed shards sampled more
than K versions before its newest checkpoint, and goes on once it has (no Prefect needed)."""

from __future__ import annotations

import asyncio
import logging
import random

import pytest

from flows.rollout import wait_for_trainer
from storage.checkpoints import publish_checkpoint
from storage.ledger import Ledger
from storage.reader import ShardReader
from storage.writer import ShardWriter
from tests.storage.factory import make_group

log = logging.getLogger("test")


def publish(root: str, step: int, ledger: Ledger, tmp_path) -> None:
    weights = tmp_path / f"weights-{step}"
    weights.mkdir()
    (weights / "config.json").write_text("{}")
    publish_checkpoint(weights, root, "run", step, extra={"ledger": ledger.to_dict()})


async def returns(root: str, max_policy_lag: int) -> bool:
    try:
        await asyncio.wait_for(wait_for_trainer(root, "run", max_policy_lag, poll_s=0.05, log=log), timeout=0.5)
    except TimeoutError:
        return False
    return True


async def test_max_policy_lag_holds_the_sampler_until_the_trainer_catches_up(tmp_path):
    root = str(tmp_path / "store")
    assert await returns(root, 0), "no checkpoint yet: nothing to wait for"
    with ShardWriter(root, "run", tokenizer="t") as writer:
        writer.add(make_group(random.Random(0), policy_version=0))
    [shard] = ShardReader(root, "run").new_shards()

    publish(root, 3, Ledger(), tmp_path)  # the trainer is at 3, a version-0 shard is unconsumed
    assert not await returns(root, 2)
    assert await returns(root, 3)

    publish(root, 4, Ledger(consumed={shard.name}), tmp_path)  # it consumed the shard
    assert await returns(root, 0)


@pytest.mark.parametrize("lag", [0, 1])
async def test_a_fresh_unconsumed_shard_never_holds_the_sampler(tmp_path, lag):
    root = str(tmp_path / "store")
    with ShardWriter(root, "run", tokenizer="t") as writer:
        writer.add(make_group(random.Random(0), policy_version=5))
    publish(root, 5, Ledger(), tmp_path)
    assert await returns(root, lag)
