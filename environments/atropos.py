"""Conversion between ScoredGroup and Atropos's ScoredDataGroup dict, so Atropos environments port."""

from __future__ import annotations

from typing import Any

from environments.scored_group import ScoredGroup, ScoredSequence

# Atropos marks untrained positions with -100 in `masks` and 1.0 in `inference_logprobs`
# (a logprob can never be positive, so 1.0 is unambiguous).
IGNORE_INDEX = -100
UNSAMPLED_LOGPROB = 1.0


def to_atropos(group: ScoredGroup) -> dict[str, Any]:
    """ScoredGroup -> Atropos ScoredDataGroup (tokens, masks, scores, advantages, inference_logprobs)."""
    sequences = group.sequences
    has_advantages = any(s.advantages is not None for s in sequences)
    has_messages = all(s.messages is not None for s in sequences)
    return {
        "tokens": [list(s.tokens) for s in sequences],
        "masks": [[t if m else IGNORE_INDEX for t, m in zip(s.tokens, s.mask)] for s in sequences],
        "scores": [s.score for s in sequences],
        "advantages": [s.advantages for s in sequences] if has_advantages else None,
        "ref_logprobs": None,
        "messages": [s.messages for s in sequences] if has_messages else None,
        "inference_logprobs": [
            [lp if m else UNSAMPLED_LOGPROB for lp, m in zip(s.logprobs, s.mask)] for s in sequences
        ],
        "group_overrides": dict(group.extras) or None,
        "overrides": [dict(s.extras) for s in sequences] if any(s.extras for s in sequences) else None,
    }


def from_atropos(data: dict[str, Any], *, env: str, item_id: str, policy_version: int = 0) -> ScoredGroup:
    """Atropos ScoredDataGroup -> ScoredGroup. Missing inference_logprobs become 0.0 (unknown)."""
    for required in ("tokens", "masks", "scores"):
        if required not in data:
            raise KeyError(f"Atropos group lacks {required!r}; a ScoredDataGroup has tokens, masks, scores")
    n = len(data["tokens"])
    logprobs = data.get("inference_logprobs") or [None] * n
    advantages = data.get("advantages") or [None] * n
    messages = data.get("messages") or [None] * n
    overrides = data.get("overrides") or [{}] * n
    sequences = []
    for i in range(n):
        mask = [m != IGNORE_INDEX for m in data["masks"][i]]
        sampled = logprobs[i]
        sequences.append(
            ScoredSequence(
                tokens=list(data["tokens"][i]),
                mask=mask,
                logprobs=[lp if m else 0.0 for lp, m in zip(sampled, mask)] if sampled else [0.0] * len(mask),
                score=float(data["scores"][i]),
                advantages=list(advantages[i]) if advantages[i] is not None else None,
                messages=messages[i],
                extras=dict(overrides[i] or {}),
            )
        )
    return ScoredGroup(
        env=env,
        item_id=item_id,
        sequences=sequences,
        policy_version=policy_version,
        extras=dict(data.get("group_overrides") or {}),
    )
