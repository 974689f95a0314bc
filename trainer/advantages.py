"""Per-token advantages: group-normalized scores (core.advantages), or an environment's own values where given."""

from __future__ import annotations

from core.advantages import group_advantages
from core.scored_group import ScoredGroup
from trainer.config import AdvantageConfig


def sequence_token_advantages(group: ScoredGroup, config: AdvantageConfig) -> list[list[float]]:
    """Per-token advantages for every sequence of the group: list of [len(tokens)] lists.

    A sequence's computed advantage is put on each of its trained tokens. When an environment set
    the sequence's `advantages`, those values replace the computed ones for that sequence only
    (Atropos's trainer silently ignores them; we must not). The group mean and std still use every
    sequence's score, so an override never shifts its siblings' advantages. Untrained tokens get 0.0
    either way: they never enter the loss, and a zero there keeps stored tensors easy to read.
    """
    computed = group_advantages(group.scores, config.mode, config.eps)
    result = []
    for sequence, advantage in zip(group.sequences, computed, strict=True):
        source = sequence.advantages if sequence.advantages is not None else [advantage] * len(sequence.tokens)
        result.append([value if trained else 0.0 for value, trained in zip(source, sequence.mask, strict=True)])
    return result
