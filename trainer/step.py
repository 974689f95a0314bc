"""One optimizer step's data: scored groups -> training sequences (each objective's per-token
advantages) -> packed micro-batches (trainer.packing), with the counts each objective's loss
divides by and the step's stats."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from core.scored_group import ScoredGroup, ScoredSequence, objective_problems, preference_pair
from trainer.advantages import sequence_token_advantages
from trainer.config import AdvantageConfig
from trainer.data import ON_POLICY_OBJECTIVES, group_objective
from trainer.packing import PackedBatch, TrainingSequence, pack_micro_batches, padding_waste
from trainer.prefix_sharing import share_prefixes


def training_sequences(
    groups: Sequence[ScoredGroup], config: AdvantageConfig, default_objective: str = "auto"
) -> list[TrainingSequence]:
    """Flatten groups into sequences with their objective (trainer.data.group_objective), their
    per-token advantages, with the first
    token untrained since nothing predicts it, and the temperature each is scored at
    (logprob_temperature). Advantages by objective:
        rl       the group's (trainer.advantages; per-token overrides honoured)
        distill  teacher logprob - sampler logprob on each trained token (reverse KL, per token)
        dpo      +1 on the chosen sequence, -1 on the rejected one, which follows it (one unit)
        sft      0.0 (it has none)"""
    result = []
    unit = 0
    for group_index, group in enumerate(groups):
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
                    name=f"group {group.group_id} (env {group.env}) sequences[{index}]",
                    objective=objective,
                    ref_logprobs=None if sequence.ref_logprobs is None else list(sequence.ref_logprobs),
                    unit=unit,
                    group=-1 if objective == "dpo" else group_index,
                    temperature=logprob_temperature(sequence, objective),
                )
            )
            if objective != "dpo":
                unit += 1
        if objective == "dpo":
            unit += 1
    return result


def logprob_temperature(sequence: ScoredSequence, objective: str) -> float:
    """The temperature the trainer scores a sequence at: for a policy-gradient objective (rl,
    distill), the one its sampler's logprobs are at, so that the importance ratio compares one
    distribution with itself; a demonstration or a preference pair is scored under the model."""
    if objective not in ON_POLICY_OBJECTIVES or sequence.sampling is None:
        return 1.0
    return sequence.sampling.logprob_temperature


def dpo_pair(group: ScoredGroup) -> tuple[int, int]:
    """(chosen, rejected) of a dpo group (core.scored_group.preference_pair), or a clear
    error for a group that is no pair (the trainer rejects those before packing)."""
    pair = preference_pair(group)
    if (problems := objective_problems(group, "dpo")) or pair is None:
        raise ValueError(f"group {group.group_id} (env {group.env}) trained as dpo: {(problems or ['no pair'])[0]}")
    return pair


def distillation_advantages(group: ScoredGroup, index: int) -> list[float]:
    """A distill sequence's per-token advantage: teacher minus sampler logprob where trained."""
    if problems := objective_problems(group, "distill"):
        raise ValueError(f"group {group.group_id} (env {group.env}) trained as distill: {problems[0]}")
    sequence = group.sequences[index]
    teacher_logprobs = sequence.teacher_logprobs or []  # objective_problems: every distill sequence has them
    return [
        teacher - sampled if trained else 0.0
        for teacher, sampled, trained in zip(teacher_logprobs, sequence.logprobs, sequence.mask, strict=True)
    ]


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
    row_multiple: int = 8,
    token_work: int = 0,
    padded_rows: bool = True,
    share_prompts: bool = True,
) -> StepBatch:
    """Compute advantages and pack every group given; stats are plain floats for logging.

    Which groups to train on is decided before (trainer.data.is_stale); `policy_version`, the
    version of the weights about to be updated, only measures how stale the given rl groups are.
    Each objective's loss divides by its own counts (`objectives`), passed to `policy_loss` as
    step_num_sequences and step_num_tokens for every micro-batch, and weighs its share of groups.
    """
    sequences = training_sequences(groups, advantage_config, default_objective)
    laid_out = share_prefixes(sequences, token_budget, token_work) if share_prompts else sequences
    batches = pack_micro_batches(laid_out, token_budget, row_multiple, token_work, padded_rows)
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
        torch.cat([b.advantages[b.objective_mask("rl")] for b in batches]) if batches else torch.zeros(0)
    )
    staleness = [policy_version - g.policy_version for g in rl_groups]
    tokens = sum(len(s.tokens) for s in sequences)  # the sequences' own, a shared prompt in each
    scores = [score for g in rl_groups for score in g.scores]
    stats = {
        "groups": float(len(groups)),
        **{f"{name}/groups": float(share.groups) for name, share in objectives.items() if name != "rl"},
        "staleness_mean": statistics.fmean(staleness) if staleness else 0.0,
        "staleness_max": float(max(staleness, default=0)),
        "micro_batches": float(len(batches)),
        "padding_waste": padding_waste(batches),
        "tokens": float(tokens),
        # the tokens a shared prompt spared the forward and backward (trainer.prefix_sharing)
        "shared_prefix_tokens": float(tokens - sum(sum(b.sequence_lengths) for b in batches)),
    }
    for value in sorted(set(staleness)):  # how many groups trained at each staleness
        stats[f"staleness/{value}"] = float(staleness.count(value))
    spans = [s.policy_versions for g in rl_groups for s in g.sequences if s.policy_versions is not None]
    if spans:  # sequences sampled across a reload (in flight, or between turns)
        stats["spanning_versions"] = float(sum(last > first for first, last in spans))
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
