"""Packing: scored groups -> micro-batches of flat tensors under a token budget, with masks."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from environments.scored_group import ScoredGroup, objective_problems, preference_pair
from trainer.advantages import sequence_token_advantages
from trainer.config import AdvantageConfig
from trainer.data import group_objective

AttentionMaskHook = Callable[[torch.Tensor, dict[str, Any]], torch.Tensor]
"""Given one sequence's block of the attention mask, [n, n] bool (True: the query row may attend to
the key column; causal to begin with), and that sequence's extras, return the block to use. A hook
returns the block unchanged for extras it does not understand, so several can be chained."""


def additive_mask(mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A boolean attention mask as an additive one: 0 where allowed, the dtype's min elsewhere."""
    return torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)


def sliding_window(block: torch.Tensor, extras: dict[str, Any]) -> torch.Tensor:
    """Hook: extras {"attention": {"type": "sliding_window", "window": W}} lets each token see only
    itself and the W - 1 tokens before it: query i attends key j iff 0 <= i - j < W, as in Mistral.
    """
    spec = extras.get("attention")
    if not isinstance(spec, dict) or spec.get("type") != "sliding_window":
        return block
    window = spec.get("window")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(
            f"extras.attention.window: {window!r}; give a positive int, the number of most recent "
            "tokens (the token itself included) each token may attend to"
        )
    positions = torch.arange(block.shape[0])
    return block & (positions[:, None] - positions[None, :] < window)


DEFAULT_HOOKS: tuple[AttentionMaskHook, ...] = (sliding_window,)


@dataclass(frozen=True)
class TrainingSequence:
    """One sequence ready to pack: equal-length per-token lists and what to call it in errors."""

    tokens: list[int]
    mask: list[bool]
    old_logprobs: list[float]
    advantages: list[float]
    extras: dict[str, Any]
    name: str
    objective: str = "rl"
    ref_logprobs: list[float] | None = None  # stored by the environment (dpo); else the trainer's
    unit: int = -1  # sequences of one unit (a dpo pair) are packed side by side; -1: on its own


@dataclass
class PackedBatch:
    """One micro-batch: whole sequences laid end to end in a single row, padded at the end.

    input_ids, position_ids, sequence_ids, mask, old_logprobs, advantages: [1, T].
    position_ids restart at 0 for every sequence, so a model with varlen attention (flash attention
    reads sequence starts from them) treats the sequences separately; `attention_mask` gives the
    same separation as a block-diagonal mask for eager or sdpa attention. sequence_ids is 0..n-1 by
    sequence and -1 on padding. mask is True on trained tokens only: never on padding and never on
    the first token of a sequence, which has no prediction (see losses.token_logprobs).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    sequence_ids: torch.Tensor
    mask: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    sequence_lengths: list[int]
    sequence_extras: list[dict[str, Any]]
    sequence_objectives: list[str] = field(default_factory=list)
    # Reference logprobs the environment stored, [1, T], and where there are any, [1, T] bool;
    # None when no sequence of the micro-batch has them.
    stored_ref_logprobs: torch.Tensor | None = None
    has_stored_ref: torch.Tensor | None = None

    @property
    def num_slots(self) -> int:
        return self.input_ids.shape[1]

    @property
    def num_padding(self) -> int:
        return self.num_slots - sum(self.sequence_lengths)

    @property
    def num_trained_tokens(self) -> int:
        return int(self.mask.sum())

    @property
    def num_sequences(self) -> int:
        """Sequences with at least one trained token: the ones a sequence-mean loss counts."""
        return int(torch.unique(self.sequence_ids[self.mask]).numel())

    @property
    def objectives(self) -> list[str]:
        """The objectives of this micro-batch's sequences, each once, in first-seen order."""
        return list(dict.fromkeys(self.sequence_objectives))

    def objective_mask(self, objective: str) -> torch.Tensor:
        """[1, T] bool: the trained tokens of the sequences trained with `objective`."""
        chosen = torch.tensor(
            [index for index, name in enumerate(self.sequence_objectives) if name == objective],
            dtype=torch.long,
        )
        return self.mask & torch.isin(self.sequence_ids, chosen)

    def objective_counts(self, objective: str) -> tuple[int, int]:
        """(sequences with a trained token, trained tokens) of `objective` in this micro-batch."""
        mask = self.objective_mask(objective)
        return int(torch.unique(self.sequence_ids[mask]).numel()), int(mask.sum())

    def needs_reference(self, kl: bool) -> bool:
        """Whether the trainer's reference model must score this micro-batch: its dpo tokens (and,
        with a KL penalty, every trained token) that have no stored reference logprobs."""
        needed = self.mask if kl else self.objective_mask("dpo")
        if self.has_stored_ref is not None:
            needed = needed & ~self.has_stored_ref
        return bool(needed.any())

    def attention_mask(self, hooks: Sequence[AttentionMaskHook] = DEFAULT_HOOKS) -> torch.Tensor:
        """Block-diagonal causal mask [1, 1, T, T] bool, True where a query may attend to a key.

        Each sequence's block passes through every hook with that sequence's extras. A padding
        slot attends only to itself, so no softmax row is empty (an empty row gives NaN in sdpa).
        Use `additive_mask` for models that want 0 / -inf instead of booleans.
        """
        mask = torch.eye(self.num_slots, dtype=torch.bool)
        start = 0
        for length, extras in zip(self.sequence_lengths, self.sequence_extras, strict=True):
            block = torch.ones(length, length, dtype=torch.bool).tril()
            for hook in hooks:
                block = hook(block, extras)
            mask[start : start + length, start : start + length] = block
            start += length
        return mask[None, None]


def training_sequences(
    groups: Sequence[ScoredGroup], config: AdvantageConfig, default_objective: str = "auto"
) -> list[TrainingSequence]:
    """Flatten groups into sequences with their objective (trainer.data.group_objective), their
    per-token advantages and extras (group's, then the sequence's own on top), with the first
    token untrained since nothing predicts it. Advantages by objective:
        rl       the group's (trainer.advantages; per-token overrides honoured)
        distill  teacher logprob - sampler logprob on each trained token (reverse KL, per token)
        dpo      +1 on the chosen sequence, -1 on the rejected one, which follows it (one unit)
        sft      0.0 (it has none)"""
    result = []
    unit = 0
    for group in groups:
        objective = group_objective(group, default_objective)
        sequences = list(enumerate(group.sequences))
        if objective == "rl":
            advantages = sequence_token_advantages(group, config)
        elif objective == "distill":
            advantages = [distillation_advantages(group, index) for index, _ in sequences]
        elif objective == "dpo":
            chosen, rejected = dpo_pair(group)
            sequences = [(chosen, group.sequences[chosen]), (rejected, group.sequences[rejected])]
            advantages = [[1.0] * len(group.sequences[chosen].tokens), [-1.0] * len(group.sequences[rejected].tokens)]
        else:
            advantages = [[0.0] * len(sequence.tokens) for _, sequence in sequences]
        for (index, sequence), token_advantages in zip(sequences, advantages, strict=True):
            result.append(
                TrainingSequence(
                    tokens=list(sequence.tokens),
                    mask=[False] + list(sequence.mask[1:]),
                    old_logprobs=list(sequence.logprobs),
                    advantages=token_advantages,
                    extras={**group.extras, **sequence.extras},
                    name=f"group {group.group_id} (env {group.env}) sequences[{index}]",
                    objective=objective,
                    ref_logprobs=None if sequence.ref_logprobs is None else list(sequence.ref_logprobs),
                    unit=unit,
                )
            )
            if objective != "dpo":
                unit += 1
        if objective == "dpo":
            unit += 1
    return result


def dpo_pair(group: ScoredGroup) -> tuple[int, int]:
    """(chosen, rejected) of a dpo group (environments.scored_group.preference_pair), or a clear
    error for a group that is no pair (the trainer rejects those before packing)."""
    if problems := objective_problems(group, "dpo"):
        raise ValueError(f"group {group.group_id} (env {group.env}) trained as dpo: {problems[0]}")
    return preference_pair(group)


def distillation_advantages(group: ScoredGroup, index: int) -> list[float]:
    """A distill sequence's per-token advantage: teacher minus sampler logprob where trained."""
    if problems := objective_problems(group, "distill"):
        raise ValueError(f"group {group.group_id} (env {group.env}) trained as distill: {problems[0]}")
    sequence = group.sequences[index]
    return [
        teacher - sampled if trained else 0.0
        for teacher, sampled, trained in zip(sequence.teacher_logprobs, sequence.logprobs, sequence.mask, strict=True)
    ]


def plan_micro_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """First-fit decreasing: indices into `lengths`, grouped so each group's total fits the budget.

    Longest first, each into the first micro-batch with room; within a micro-batch the indices are
    in input order. Deterministic for a given input. Every length must be <= token_budget.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        if lengths[i] > token_budget:
            raise ValueError(f"length {lengths[i]} at index {i} > token budget {token_budget}")
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(token_budget - lengths[i])
    return [sorted(b) for b in bins]


def pack_micro_batches(
    sequences: Sequence[TrainingSequence], token_budget: int, pad_multiple: int = 64
) -> list[PackedBatch]:
    """Pack whole sequences into micro-batches of at most `token_budget` tokens.

    Each micro-batch is padded up to a multiple of `pad_multiple` (never past the budget): a bounded
    set of shapes keeps kernel autotuning and compile caches warm at a cost of < pad_multiple slots.
    """
    for sequence in sequences:
        if len(sequence.tokens) > token_budget:
            raise ValueError(
                f"{sequence.name}: {len(sequence.tokens)} tokens > micro_batch_tokens "
                f"{token_budget}; raise trainer micro_batch_tokens to at least "
                f"{len(sequence.tokens)} or lower the environment's maximum tokens"
            )
    # Units (a dpo pair; any other sequence on its own) are planned whole, their sequences in order.
    units: dict[int, list[int]] = {}
    for index, sequence in enumerate(sequences):
        units.setdefault(sequence.unit if sequence.unit >= 0 else -1 - index, []).append(index)
    members = list(units.values())
    lengths = [sum(len(sequences[i].tokens) for i in unit) for unit in members]
    for unit, length in zip(members, lengths, strict=True):
        if length > token_budget:
            raise ValueError(
                f"{sequences[unit[0]].name} and the rest of its dpo pair: {length} tokens > micro_batch_tokens "
                f"{token_budget}; a pair trains in one micro-batch: raise micro_batch_tokens to at least {length}"
            )
    plan = plan_micro_batches(lengths, token_budget)
    return [_pack([sequences[i] for u in indices for i in members[u]], token_budget, pad_multiple) for indices in plan]


def _pack(
    sequences: Sequence[TrainingSequence], token_budget: int, pad_multiple: int
) -> PackedBatch:
    used = sum(len(s.tokens) for s in sequences)
    slots = min(math.ceil(used / pad_multiple) * pad_multiple, token_budget)
    padding = slots - used
    input_ids, positions, ids, mask, old_logprobs, advantages = [], [], [], [], [], []
    stored_ref, has_ref = [], []
    for index, s in enumerate(sequences):
        input_ids += s.tokens
        positions += range(len(s.tokens))
        ids += [index] * len(s.tokens)
        mask += s.mask
        old_logprobs += s.old_logprobs
        advantages += s.advantages
        stored_ref += s.ref_logprobs if s.ref_logprobs is not None else [0.0] * len(s.tokens)
        has_ref += [s.ref_logprobs is not None] * len(s.tokens)
    any_stored = any(s.ref_logprobs is not None for s in sequences)
    return PackedBatch(
        input_ids=torch.tensor([input_ids + [0] * padding], dtype=torch.long),
        position_ids=torch.tensor([positions + [0] * padding], dtype=torch.long),
        sequence_ids=torch.tensor([ids + [-1] * padding], dtype=torch.long),
        mask=torch.tensor([mask + [False] * padding], dtype=torch.bool),
        old_logprobs=torch.tensor([old_logprobs + [0.0] * padding], dtype=torch.float32),
        advantages=torch.tensor([advantages + [0.0] * padding], dtype=torch.float32),
        sequence_lengths=[len(s.tokens) for s in sequences],
        sequence_extras=[s.extras for s in sequences],
        sequence_objectives=[s.objective for s in sequences],
        stored_ref_logprobs=torch.tensor([stored_ref + [0.0] * padding], dtype=torch.float32) if any_stored else None,
        has_stored_ref=torch.tensor([has_ref + [False] * padding], dtype=torch.bool) if any_stored else None,
    )


def padding_waste(batches: Sequence[PackedBatch]) -> float:
    """Padded slots / all slots over the micro-batches; 0.0 when there are none."""
    slots = sum(b.num_slots for b in batches)
    return sum(b.num_padding for b in batches) / slots if slots else 0.0


@dataclass(frozen=True)
class ObjectiveShare:
    """One objective's part of an optimizer step: the counts its loss divides by, and its weight
    in the step's loss, its share of the step's groups (so a step of one objective weighs 1)."""

    groups: int
    num_sequences: int
    num_trained_tokens: int
    weight: float


@dataclass
class StepBatch:
    """One optimizer step's data: its micro-batches, the counts the loss divides by, and stats."""

    micro_batches: list[PackedBatch]
    num_sequences: int
    num_trained_tokens: int
    stats: dict[str, float] = field(default_factory=dict)
    objectives: dict[str, ObjectiveShare] = field(default_factory=dict)

    def needs_reference(self, kl: bool) -> bool:
        """Whether any micro-batch needs the trainer's reference model (PackedBatch.needs_reference)."""
        return any(batch.needs_reference(kl) for batch in self.micro_batches)


def build_step(
    groups: Sequence[ScoredGroup],
    *,
    policy_version: int,
    token_budget: int,
    advantage_config: AdvantageConfig,
    default_objective: str = "auto",
    pad_multiple: int = 64,
) -> StepBatch:
    """Compute advantages and pack every group given; stats are plain floats for logging.

    Which groups to train on is decided before (trainer.data.is_stale); `policy_version`, the
    version of the weights about to be updated, only measures how stale the given rl groups are.
    Each objective's loss divides by its own counts (`objectives`), passed to `policy_loss` as
    step_num_sequences and step_num_tokens for every micro-batch, and weighs its share of groups.
    """
    batches = pack_micro_batches(
        training_sequences(groups, advantage_config, default_objective), token_budget, pad_multiple
    )
    objective_of = [group_objective(g, default_objective) for g in groups]
    objectives = {}
    for objective in dict.fromkeys(objective_of):
        counts = [b.objective_counts(objective) for b in batches]
        objectives[objective] = ObjectiveShare(
            groups=objective_of.count(objective),
            num_sequences=sum(sequences for sequences, _ in counts),
            num_trained_tokens=sum(tokens for _, tokens in counts),
            weight=objective_of.count(objective) / len(groups),
        )
    rl_groups = [g for g, objective in zip(groups, objective_of) if objective == "rl"]
    trained_advantages = (
        torch.cat([b.advantages[b.objective_mask("rl")] for b in batches])
        if batches
        else torch.zeros(0)
    )
    staleness = [policy_version - g.policy_version for g in rl_groups]
    scores = [score for g in rl_groups for score in g.scores]
    stats = {
        "groups": float(len(groups)),
        **{f"{name}/groups": float(share.groups) for name, share in objectives.items() if name != "rl"},
        "staleness_mean": statistics.fmean(staleness) if staleness else 0.0,
        "staleness_max": float(max(staleness, default=0)),
        "micro_batches": float(len(batches)),
        "padding_waste": padding_waste(batches),
        "tokens": float(sum(sum(b.sequence_lengths) for b in batches)),
    }
    for value in sorted(set(staleness)):  # how many groups trained at each staleness
        stats[f"staleness/{value}"] = float(staleness.count(value))
    if scores:  # the reward of what the policy sampled; a demonstration's score is not one
        stats["score_mean"] = statistics.fmean(scores)
        for env in sorted({g.env for g in rl_groups}):  # and each environment's, in a mixed run
            stats[f"score_mean/{env}"] = statistics.fmean(s for g in rl_groups if g.env == env for s in g.scores)
    if "distill" in objectives:  # sampler minus teacher logprob per token: the reverse KL estimate
        teacher_gap = torch.cat([b.advantages[b.objective_mask("distill")] for b in batches])
        stats["distill/kl_to_teacher"] = -teacher_gap.mean().item() if teacher_gap.numel() else 0.0
    if trained_advantages.numel():
        stats |= {
            "advantage_mean": trained_advantages.mean().item(),
            "advantage_std": trained_advantages.std(unbiased=False).item(),
            "advantage_min": trained_advantages.min().item(),
            "advantage_max": trained_advantages.max().item(),
        }
    return StepBatch(
        micro_batches=batches,
        num_sequences=sum(b.num_sequences for b in batches),
        num_trained_tokens=sum(b.num_trained_tokens for b in batches),
        stats=stats,
        objectives=objectives,
    )
