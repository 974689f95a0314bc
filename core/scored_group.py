"""ScoredGroup: the contract an environment returns and every other part of clotho reads."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from core.sampling import Sampling, policy_gradient_problems

# Bump when a field is added, removed or changes meaning; storage writes it into every shard and
# refuses shards of any other version (until a first release, no code reads older formats).
#   1: the first wave's fields
#   2: ScoredGroup.objective
#   3: ScoredSequence.ref_logprobs and teacher_logprobs; objectives "dpo" and "distill"
#   4: ScoredSequence.previous_score (kept by `clotho reprocess ... rescore`)
#   5: ScoredSequence.policy_versions (a sequence sampled across an in-flight reload spans two)
#   6: ScoredSequence.sampling (the parameters that drew it and what its logprobs are of: core.sampling)
SCHEMA_VERSION = 6

FINISH_REASONS = ("stop", "length", "abort", "error")

# What the trainer does with a group: "rl" (policy gradient on advantages, the GRPO family),
# "sft" (negative log-likelihood of the trained tokens: a demonstration), "dpo" (a preference pair:
# two sequences, the higher score chosen) or "distill" (on-policy distillation: the advantage of
# each sampled token is the teacher's logprob minus the student's).
Objective = Literal["rl", "sft", "dpo", "distill"]
OBJECTIVES: tuple[str, ...] = get_args(Objective)


class InvalidGroupError(Exception):
    """A group breaks the contract. The message names the sequence, the field and the fix;
    `reason` is the kind of break (one of FAILURE_REASONS), what the rollout flow counts by.

    Deliberately not a ValueError, so pydantic lets it through unwrapped.
    """

    def __init__(self, message: str, reason: str = "invalid"):
        super().__init__(message)
        self.reason = reason


# The kinds of contract break, as InvalidGroupError.reason: ids outside the vocabulary (or
# negative), per-token lists of another length than the tokens, NaN or inf values, no sequence or
# no token, nothing trained, a group over max_group_tokens or group_size, anything else.
CONTRACT_REASONS = (
    "out-of-vocab",
    "ragged",
    "non-finite",
    "empty",
    "no-trained-token",
    "too-large",
    "too-many-sequences",
    "invalid",
)


def version_range(ranges: Iterable[tuple[int, int] | None]) -> tuple[int, int] | None:
    """(first, last) policy version over several (first, last) ranges, the unknown (None) skipped;
    None when none is known. A sequence's over its turns, a group's over its sequences."""
    known = [versions for versions in ranges if versions is not None]
    return (min(first for first, _ in known), max(last for _, last in known)) if known else None


def new_group_id() -> str:
    """A unique id that sorts by creation time: 13 hex digits of microseconds + 12 random hex."""
    return f"{time.time_ns() // 1000:013x}-{os.urandom(6).hex()}"


# Optional per-token lists: when set, one entry per token.
PER_TOKEN_OPTIONAL = ("advantages", "ref_logprobs", "teacher_logprobs")


class ScoredSequence(BaseModel):
    """One rollout: the tokens the policy saw and produced, which of them train, and its reward."""

    model_config = ConfigDict(extra="forbid")

    tokens: list[int] = Field(description="Token ids of the whole sequence, prompt included.")
    mask: list[bool] = Field(description="True where the token is trained (sampled by the policy).")
    logprobs: list[float] = Field(
        description="The sampler's logprob of each token; 0.0 where the token was not sampled."
    )
    score: float = Field(description="The reward of this sequence.")
    advantages: list[float] | None = Field(
        default=None, description="Per-token advantages; when set they replace the trainer's."
    )
    ref_logprobs: list[float] | None = Field(
        default=None,
        description="A reference model's logprob of each token (0.0 where not trained), for DPO; "
        "without them the trainer computes them with its frozen copy of the initial model.",
    )
    teacher_logprobs: list[float] | None = Field(
        default=None,
        description="A teacher's logprob of each token (0.0 where not trained), for on-policy "
        "distillation (environments.bundled.distill fills them from a teacher server).",
    )
    previous_score: float | None = Field(
        default=None, description="The score before a rescore (clotho reprocess ... rescore); None if never rescored."
    )
    finish_reason: str = Field(default="stop", description=f"One of {FINISH_REASONS}.")
    policy_versions: tuple[int, int] | None = Field(
        default=None,
        description="(first, last) policy version whose weights sampled its trained tokens: apart when "
        "a reload swapped the weights mid-generation or between turns. Environment.sample_group "
        "fills it from what the server reported when the environment leaves it unset; None where "
        "unknown (shards older than schema version 5, a server that does not report versions).",
    )
    sampling: Sampling | None = Field(
        default=None,
        description="The sampling parameters and logprobs mode its trained tokens were drawn with, from "
        "the requests the policy client sent (Completion.sampling); Environment.sample_group fills it "
        "when the environment leaves it unset. None: temperature 1, no truncation (shards older than "
        "schema version 6, demonstrations nobody sampled).",
    )
    messages: list[dict[str, Any]] | None = Field(
        default=None, description="The conversation as messages, for inspection and SFT export."
    )
    extras: dict[str, Any] = Field(default_factory=dict, description="Open per-sequence data.")

    @classmethod
    def from_prompt(
        cls,
        prompt_tokens: list[int],
        completion_tokens: list[int],
        completion_logprobs: list[float],
        score: float,
        **fields: Any,
    ) -> ScoredSequence:
        """Atropos-style construction: everything after the prompt is trained."""
        return cls(
            tokens=list(prompt_tokens) + list(completion_tokens),
            mask=[False] * len(prompt_tokens) + [True] * len(completion_tokens),
            logprobs=[0.0] * len(prompt_tokens) + list(completion_logprobs),
            score=score,
            **fields,
        )

    @classmethod
    def from_completion(cls, prompt_tokens: list[int], completion: Any, score: float, **fields: Any) -> ScoredSequence:
        """A single-turn sample: the prompt, then a completion (inference.client.Completion) exactly
        as the sampler returned it, trained, with its finish reason and the policy versions that
        sampled it."""
        fields = {
            "finish_reason": completion.finish_reason,
            "policy_versions": completion.policy_versions,
            "sampling": completion.sampling,
            **fields,
        }
        return cls.from_prompt(prompt_tokens, completion.token_ids, completion.logprobs, score, **fields)

    @property
    def num_trained_tokens(self) -> int:
        return sum(self.mask)

    def problems(self) -> list[str]:
        """Every way this sequence breaks the contract, as 'field: what is wrong; fix' lines."""
        return [problem for _, problem in self.problems_by_reason()]

    def problems_by_reason(self) -> list[tuple[str, str]]:
        """problems(), each with its kind (CONTRACT_REASONS)."""
        found = []
        n = len(self.tokens)
        if n == 0:
            found.append(("empty", "tokens: empty; a sequence needs at least one trained token"))
        optional = tuple(name for name in PER_TOKEN_OPTIONAL if getattr(self, name) is not None)
        for name in ("mask", "logprobs") + optional:
            length = len(getattr(self, name))
            if length != n:
                found.append(("ragged", f"{name}: length {length} != len(tokens) {n}; give one {name} entry per token"))
        if n and not any(self.mask):
            found.append(("no-trained-token", "mask: no trained token (all False); mark the sampled tokens True"))
        if not math.isfinite(self.score):
            found.append(("non-finite", f"score: {self.score} is not finite; return a finite reward"))
        if self.advantages is not None and not all(math.isfinite(a) for a in self.advantages):
            found.append(("non-finite", "advantages: contains NaN or inf; return finite per-token advantages"))
        if not all(math.isfinite(lp) for lp in self.logprobs):
            found.append(("non-finite", "logprobs: contains NaN or inf; use 0.0 for tokens that were not sampled"))
        for name in ("ref_logprobs", "teacher_logprobs"):
            values = getattr(self, name)
            if values is not None and not all(math.isfinite(lp) for lp in values):
                found.append(("non-finite", f"{name}: contains NaN or inf; use 0.0 for tokens that are not trained"))
        if any(t < 0 for t in self.tokens):
            found.append(("out-of-vocab", "tokens: negative token id; token ids are >= 0"))
        if self.finish_reason not in FINISH_REASONS:
            found.append(("invalid", f"finish_reason: {self.finish_reason!r}; use one of {FINISH_REASONS}"))
        if self.policy_versions is not None and not 0 <= self.policy_versions[0] <= self.policy_versions[1]:
            found.append(
                (
                    "invalid",
                    f"policy_versions: {self.policy_versions} is not (first, last) with 0 <= first <= last; "
                    "give Completion.policy_versions of the completions it holds, or leave it unset",
                )
            )
        return found


def preference_pair(group: ScoredGroup) -> tuple[int, int] | None:
    """(chosen, rejected) indices into group.sequences: the highest score over the lowest (the
    first of each when several tie), or None when every score is the same. The DPO objective and
    the DPO export read pairs through this one function."""
    scores = group.scores
    best, worst = max(scores), min(scores)
    if best == worst:
        return None
    return scores.index(best), scores.index(worst)


def objective_problems(group: ScoredGroup, objective: str | None = None) -> list[str]:
    """What `group` lacks to be trained with `objective` (by default the one it is marked with), as
    'field: what; fix' lines. The one rule: ScoredGroup validation, the trainer (which may train an
    unmarked group as dpo or distill by its own setting) and the packing of pairs all ask it;
    storage.schema checks the same on Arrow columns."""
    objective = objective or group.objective
    if objective == "dpo":
        if len(group.sequences) != 2:
            return [
                f"objective: dpo needs a pair, this group has {len(group.sequences)} sequences; return "
                "two (chosen and rejected) or leave objective unset for the GRPO family"
            ]
        if group.sequences[0].score == group.sequences[1].score:
            return [
                f"objective: dpo pair with tied scores ({group.sequences[0].score}); the chosen sequence "
                "needs the higher score: score them apart or drop the pair"
            ]
    if objective in ("rl", "distill"):
        for index, sequence in enumerate(group.sequences):
            if problems := policy_gradient_problems(sequence.sampling):
                return [f"sequences[{index}].{problems[0]} (objective {objective})"]
    if objective == "distill":
        for index, sequence in enumerate(group.sequences):
            teacher = sequence.teacher_logprobs
            if teacher is None or len(teacher) != len(sequence.tokens):
                given = "unset" if teacher is None else f"{len(teacher)} values for {len(sequence.tokens)} tokens"
                return [
                    f"sequences[{index}].teacher_logprobs: {given} in a distill group; give one teacher "
                    "logprob per token (environments.bundled.distill.teacher_logprobs) or leave objective unset"
                ]
    return []


class ScoredGroup(BaseModel):
    """A group of related sequences (GRPO's n samples of one prompt): the unit of training data."""

    model_config = ConfigDict(extra="forbid")

    env: str = Field(description="Name of the environment that produced the group.")
    item_id: str = Field(description="Id of the item the group was made from.")
    sequences: list[ScoredSequence]
    group_id: str = Field(default_factory=new_group_id, description="Unique, time-sortable.")
    policy_version: int = Field(
        default=0,
        description="The oldest policy version that sampled any of its tokens (the first of its "
        "sequences' policy_versions, when they are known): what bounded staleness counts from.",
    )
    chat_template: str | None = Field(
        default=None, description="Name of the chat template used, when not the tokenizer's."
    )
    objective: Objective | None = Field(
        default=None,
        description=f"How the trainer learns from the group, one of {OBJECTIVES}; None leaves it "
        "to the trainer's `objective` setting (by default: sft for a group of one sequence without "
        "advantages, rl otherwise).",
    )
    extras: dict[str, Any] = Field(default_factory=dict, description="Open group data for trainer extensions.")
    created_at: float = Field(default_factory=time.time, description="Unix time of creation.")
    schema_version: int = SCHEMA_VERSION

    @model_validator(mode="after")
    def _check_contract(self) -> ScoredGroup:
        if not self.sequences:
            raise InvalidGroupError(
                f"group {self.group_id} (env {self.env}, item {self.item_id}): sequences is empty; "
                "a group needs at least one sequence",
                reason="empty",
            )
        found = [(r, f"sequences[{i}].{p}") for i, s in enumerate(self.sequences) for r, p in s.problems_by_reason()]
        found += [("invalid", problem) for problem in objective_problems(self)]
        if self.schema_version != SCHEMA_VERSION:
            found.append(
                (
                    "invalid",
                    f"schema_version: {self.schema_version} != {SCHEMA_VERSION}; "
                    "convert the data with the matching clotho version",
                )
            )
        if found:
            raise InvalidGroupError(
                f"group {self.group_id} (env {self.env}, item {self.item_id}) is invalid:\n  "
                + "\n  ".join(problem for _, problem in found),
                reason=found[0][0],  # counted by its first problem
            )
        return self

    def check_limits(
        self,
        vocab_size: int | None = None,
        max_group_size: int | None = None,
        max_tokens: int | None = None,
        expected: str | None = None,
    ) -> None:
        """Checks that need the run's context: the most sequences a group may hold (its
        environment's max_group_sequences, `expected` saying how that follows from its config:
        group_size by default), the token budget (max_group_tokens) and the tokenizer's vocabulary."""
        if max_group_size is not None and len(self.sequences) > max_group_size:
            expected = expected or f"group_size {max_group_size}"
            raise InvalidGroupError(
                f"group {self.group_id} (env {self.env}): {len(self.sequences)} sequences > {max_group_size} expected "
                f"({expected}); return at most that many sequences or raise group_size",
                reason="too-many-sequences",
            )
        if max_tokens is not None and self.num_tokens > max_tokens:
            raise InvalidGroupError(
                f"group {self.group_id} (env {self.env}): {self.num_tokens:,} tokens (about "
                f"{self.num_tokens * 4 / 2**20:.1f} MiB of token ids) > max_group_tokens {max_tokens:,}; "
                "return shorter or fewer sequences, or raise max_group_tokens (--set max_group_tokens=N)",
                reason="too-large",
            )
        if vocab_size is not None:
            for i, sequence in enumerate(self.sequences):
                top = max(sequence.tokens)
                if top >= vocab_size:
                    raise InvalidGroupError(
                        f"group {self.group_id} (env {self.env}): sequences[{i}].tokens: id {top} "
                        f">= vocab size {vocab_size}; tokenize with the policy's tokenizer",
                        reason="out-of-vocab",
                    )

    @property
    def scores(self) -> list[float]:
        return [s.score for s in self.sequences]

    @property
    def policy_versions(self) -> tuple[int, int] | None:
        """(first, last) policy version over its sequences' tokens; None where none is known."""
        return version_range(s.policy_versions for s in self.sequences)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.sequences)
