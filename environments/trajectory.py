"""Token bookkeeping for one rollout: a growing sequence whose sampled tokens train and others don't."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from inference.client import Completion
from core.scored_group import ScoredSequence


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
            messages=messages,
            extras=extras or {},
        )
