"""Rollout shards for trainer tests: groups whose sampler logprobs are the tiny model's own."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from core.scored_group import ScoredGroup, ScoredSequence
from storage.writer import ShardWriter


def sampled_groups(
    model_dir: Path,
    count: int,
    *,
    seed: int = 0,
    group_size: int = 4,
    policy_version: int = 0,
    extras: dict | None = None,
) -> list[ScoredGroup]:
    """`count` groups of random prompts and completions with the logprobs `model_dir` gives them
    (so the first step's importance ratios are 1) and 0/1 scores that differ within each group."""
    from inference.parity import load_reference_model, reference_logprobs

    model = load_reference_model(model_dir)
    rng = random.Random(seed)
    groups = []
    for index in range(count):
        prompt = [rng.randrange(3, 512) for _ in range(rng.randint(4, 10))]
        sequences = []
        for member in range(group_size):
            completion = [rng.randrange(3, 512) for _ in range(rng.randint(3, 12))]
            with torch.no_grad():
                logprobs = reference_logprobs(model, prompt, completion)
            sequences.append(ScoredSequence.from_prompt(prompt, completion, logprobs, float(member % 2)))
        groups.append(
            ScoredGroup(
                env="toy",
                item_id=f"{seed}-{index}",
                sequences=sequences,
                policy_version=policy_version,
                extras=extras or {},
            )
        )
    return groups


def write_shards(root: str, run: str, groups: list[ScoredGroup], groups_per_shard: int) -> None:
    """One shard per `groups_per_shard` consecutive groups, in order."""
    with ShardWriter(root, run, tokenizer="tiny", max_groups=10**6) as writer:
        for start in range(0, len(groups), groups_per_shard):
            writer.add_many(groups[start : start + groups_per_shard])
            writer.flush()
