"""Advantages: group-normalized scores, or an environment's own per-token values where given."""

from __future__ import annotations

import math
from collections.abc import Sequence

from environments.scored_group import ScoredGroup
from trainer.config import AdvantageConfig


def group_advantages(scores: Sequence[float], config: AdvantageConfig) -> list[float]:
    """One advantage per score, relative to the group.

    grpo:          (score - mean) / (std + eps)
    mean_only:     score - mean
    leave_one_out: score - mean of the other n - 1 scores = n / (n - 1) * (score - mean) (RLOO)

    std is the population std (divide by n, not n - 1) so a group of one gets 0, not NaN, and a
    group whose scores are all equal gets all zeros: it says nothing about which answer is better.
    """
    n = len(scores)
    if n == 0 or max(scores) == min(scores):
        # Exactly zero: a float mean of equal scores can differ from them in the last bit.
        return [0.0] * n
    mean = sum(scores) / n
    centered = [s - mean for s in scores]
    if config.mode == "mean_only":
        return centered
    if config.mode == "leave_one_out":
        return [c * n / (n - 1) for c in centered]  # n > 1: a group of one has equal scores
    std = math.sqrt(sum(c * c for c in centered) / n)
    return [c / (std + config.eps) for c in centered]


def sequence_token_advantages(group: ScoredGroup, config: AdvantageConfig) -> list[list[float]]:
    """Per-token advantages for every sequence of the group: list of [len(tokens)] lists.

    A sequence's computed advantage is put on each of its trained tokens. When an environment set
    the sequence's `advantages`, those values replace the computed ones for that sequence only
    (Atropos's trainer silently ignores them; we must not). The group mean and std still use every
    sequence's score, so an override never shifts its siblings' advantages. Untrained tokens get 0.0
    either way: they never enter the loss, and a zero there keeps stored tensors easy to read.
    """
    computed = group_advantages(group.scores, config)
    result = []
    for sequence, advantage in zip(group.sequences, computed, strict=True):
        source = (
            sequence.advantages
            if sequence.advantages is not None
            else [advantage] * len(sequence.tokens)
        )
        result.append(
            [
                value if trained else 0.0
                for value, trained in zip(source, sequence.mask, strict=True)
            ]
        )
    return result
