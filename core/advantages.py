"""Group-relative advantages from scores: the one formula the trainer, reprocessing and an
environment that sets per-token advantages of its own (code_exec) all use."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

AdvantageMode = Literal["grpo", "mean_only", "leave_one_out"]


def group_advantages(scores: Sequence[float], mode: AdvantageMode = "grpo", eps: float = 1e-6) -> list[float]:
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
    if mode == "mean_only":
        return centered
    if mode == "leave_one_out":
        return [c * n / (n - 1) for c in centered]  # n > 1: a group of one has equal scores
    std = math.sqrt(sum(c * c for c in centered) / n)
    return [c / (std + eps) for c in centered]
