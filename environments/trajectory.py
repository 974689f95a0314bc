"""Token bookkeeping for one rollout: a growing sequence whose sampled tokens train and others don't."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from core.sampling import Sampling
from core.scored_group import InvalidGroupError, ScoredGroup, ScoredSequence, version_range
from inference.client import Completion


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
    sampling: Sampling | None = None  # its sampled turns'; one sequence is scored at one temperature

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
        if self.turns > 1 and completion.sampling != self.sampling:
            raise ValueError(
                f"turn {self.turns} sampled with {completion.sampling}, the turns before with {self.sampling}: "
                "the trainer scores a sequence under one sampling distribution; sample every turn of a "
                "sequence with the same parameters, or make each its own sequence"
            )
        self.sampling = completion.sampling

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
            sampling=self.sampling,
            messages=messages,
            extras=extras or {},
        )


def shared_sampling(completions: list[Completion | None]) -> Sampling | None:
    """The sampling the known ones of a sequence's completions were drawn with (None: none known);
    a ValueError where they differ, since the trainer scores a sequence under one distribution."""
    drawn = {completion.sampling for completion in completions if completion is not None}
    if len(drawn) > 1:
        raise ValueError(
            f"one sequence's turns sampled with {len(drawn)} different parameter sets ({', '.join(map(str, drawn))}): "
            "the trainer scores a sequence under one sampling distribution; sample every turn of a sequence alike"
        )
    return next(iter(drawn), None)


def complete_record(group: ScoredGroup, sampled: list[Completion | None]) -> None:
    """Completes a collected group's record of how it was sampled, from every completion sampled for
    it (inference.client.recording_completions; None for one this process never saw).

    A sequence with trained tokens and no policy_versions of its own (built from raw token lists)
    gets the range of them all, which holds its own; one with no sampling of its own gets the
    parameters they were all drawn with. Where those differ the group is invalid: which of them drew
    the sequence is unknown, and the trainer would score it under the wrong distribution.
    """
    whole = version_range(None if completion is None else completion.policy_versions for completion in sampled)
    drawn = {
        completion.sampling for completion in sampled if completion is not None and completion.sampling is not None
    }
    for index, sequence in enumerate(group.sequences):
        if not any(sequence.mask):
            continue
        if sequence.policy_versions is None and whole is not None:
            sequence.policy_versions = whole
        if sequence.sampling is None and drawn:
            if len(drawn) > 1:
                raise InvalidGroupError(
                    f"group {group.group_id} (env {group.env}) sequences[{index}].sampling: unset, and the group's "
                    f"completions were drawn with {len(drawn)} different parameter sets; build each sequence from "
                    "its completions (ScoredSequence.from_completion, ChatSession) so it carries its own"
                )
            sequence.sampling = next(iter(drawn))


def version_stamp(group: ScoredGroup, sampled: list[Completion | None], announced: int) -> int:
    """A collected group's stamp (ScoredGroup.policy_version), after complete_record: the oldest
    version of its sequences; where a completion's versions are unknown (or nothing was sampled), at
    most `announced`, the version the server announced as sampling started."""
    versions = group.policy_versions
    if versions is None:
        return announced
    known = all(completion is not None and completion.policy_versions is not None for completion in sampled)
    return versions[0] if known else min(versions[0], announced)
