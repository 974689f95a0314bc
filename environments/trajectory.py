"""Token bookkeeping for one rollout: a growing sequence whose sampled tokens train and others don't."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from inference.client import Completion
from core.scored_group import ScoredGroup, ScoredSequence, version_range


@dataclass
class Trajectory:
    """Tokens in the order the policy saw them; mask and logprobs stay aligned with them.

    Context (prompts, environment, tool and user turns) is masked out with logprob 0.0; sampled
    tokens are kept exactly as the server returned them, never re-tokenized from text.
    """

    tokens: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "stop"
    turns: int = 0
    policy_versions: tuple[int, int] | None = None  # over its sampled turns; None while unknown

    def add_context(self, token_ids: list[int]) -> None:
        self.tokens.extend(token_ids)
        self.mask.extend([False] * len(token_ids))
        self.logprobs.extend([0.0] * len(token_ids))

    def add_sampled(self, completion: Completion) -> None:
        self.tokens.extend(completion.token_ids)
        self.mask.extend([True] * len(completion.token_ids))
        self.logprobs.extend(completion.logprobs)
        self.finish_reason = completion.finish_reason
        self.turns += 1
        # Turns sampled by different versions (a reload between or during them) make one sequence
        # with the whole range; the environment never sees the swap.
        self.policy_versions = version_range([self.policy_versions, completion.policy_versions])

    def to_sequence(
        self,
        score: float,
        *,
        advantages: list[float] | None = None,
        messages: list[dict[str, Any]] | None = None,
        extras: dict[str, Any] | None = None,
    ) -> ScoredSequence:
        return ScoredSequence(
            tokens=list(self.tokens),
            mask=list(self.mask),
            logprobs=list(self.logprobs),
            score=score,
            advantages=advantages,
            finish_reason=self.finish_reason,
            policy_versions=self.policy_versions,
            messages=messages,
            extras=extras or {},
        )


def stamp_versions(group: ScoredGroup, sampled: list[tuple[int, int] | None], announced: int) -> int:
    """Completes a collected group's version record and returns its stamp (ScoredGroup.policy_version).

    `sampled` holds the (first, last) policy versions of every completion sampled for the group
    (inference.client.recording_versions), None for one whose server reported none. A sequence with
    trained tokens and no policy_versions of its own (built from raw token lists) gets the range of
    them all, which holds its own. The stamp is the oldest version of the group's sequences; where a
    completion's versions are unknown (or nothing was sampled), it is at most `announced`, the
    version the server announced as sampling started.
    """
    if (whole := version_range(sampled)) is not None:
        for sequence in group.sequences:
            if sequence.policy_versions is None and any(sequence.mask):
                sequence.policy_versions = whole
    versions = group.policy_versions
    if versions is None:
        return announced
    return versions[0] if None not in sampled else min(versions[0], announced)
