"""Objectives per group: which one a group trains with, demonstrations never stale, and a step that
mixes sft and rl groups, packed or not, in one micro-batch or several, weighs each by its groups."""

from __future__ import annotations

import pytest
import torch

from core.scored_group import ScoredGroup, ScoredSequence
from storage.reader import ShardReader
from tests.trainer.rollouts import sampled_groups, write_shards
from trainer.config import AdvantageConfig, LossConfig, TrainerConfig
from trainer.data import group_objective, next_step_groups
from trainer.metrics import merge_objective_metrics
from trainer.model import load_policy, micro_batch_loss
from trainer.step import build_step

ADVANTAGES = AdvantageConfig()


def demonstration(item: str, version: int = 0, length: int = 5) -> ScoredGroup:
    prompt, completion = [5, 6, 7], [10 + t for t in range(length)]
    sequence = ScoredSequence.from_prompt(prompt, completion, [0.0] * length, score=1.0)
    return ScoredGroup(env="sft", item_id=item, sequences=[sequence], policy_version=version)


def test_a_group_names_its_objective_else_the_default_else_its_shape_decides():
    single, pair = demonstration("a"), sampled_pair()
    assert group_objective(single) == "sft" and group_objective(pair) == "rl"
    assert group_objective(single, "rl") == "rl" and group_objective(pair, "sft") == "sft"
    pair.objective = "sft"
    assert group_objective(pair, "rl") == "sft"
    # One sequence with per-token advantages is a policy-gradient sample, not a demonstration.
    overridden = demonstration("b")
    overridden.sequences[0].advantages = [0.0] * len(overridden.sequences[0].tokens)
    assert group_objective(overridden) == "rl"
    assert TrainerConfig(model="m").objective == "auto"
    with pytest.raises(ValueError, match="objective"):
        TrainerConfig(model="m", objective="dance")


def sampled_pair(version: int = 0) -> ScoredGroup:
    sequences = [ScoredSequence.from_prompt([1, 2], [3, 4], [-0.5, -0.5], float(i)) for i in range(2)]
    return ScoredGroup(env="toy", item_id="p", sequences=sequences, policy_version=version)


def test_demonstrations_are_never_stale(tmp_path):
    root = str(tmp_path)
    write_shards(root, "run", [sampled_pair(0), demonstration("d", 0), sampled_pair(5)], 3)
    groups, stale = next_step_groups(ShardReader(root, "run"), 2, policy_version=5, max_lag=1, timeout_s=1)
    assert [g.item_id for g in groups] == ["d", "p"] and len(stale) == 1
    assert groups[1].policy_version == 5


def mixed_groups(model_dir) -> list[ScoredGroup]:
    rl = sampled_groups(model_dir, 2, seed=7, group_size=3)
    return [rl[0], demonstration("d1", length=9), rl[1], demonstration("d2", length=4)]


def step_loss(
    model, groups, budget: int, config: LossConfig | None = None, reference=None
) -> tuple[float, dict[str, torch.Tensor], dict, object]:
    """One step's loss summed over its micro-batches, the gradients, merged metrics and the step."""
    step = build_step(groups, policy_version=0, token_budget=budget, advantage_config=ADVANTAGES)
    model.zero_grad(set_to_none=True)
    total, micro = 0.0, []
    for batch in step.micro_batches:
        loss, metrics = micro_batch_loss(
            model, batch, config or LossConfig(), objectives=step.objectives, reference=reference
        )
        loss.backward()
        total += loss.item()
        micro.append(metrics)
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    weights = {name: share.weight for name, share in step.objectives.items()}
    return total, grads, merge_objective_metrics(micro, weights), step


def test_a_mixed_step_is_each_objective_alone_weighted_by_its_groups(tiny_model_dir):
    model = load_policy(str(tiny_model_dir))
    groups = mixed_groups(tiny_model_dir)
    whole, whole_grads, metrics, step = step_loss(model, groups, budget=256)
    split, split_grads, split_metrics, split_step = step_loss(model, groups, budget=32)
    assert len(step.micro_batches) == 1 and len(split_step.micro_batches) > 2
    assert {name: s.groups for name, s in step.objectives.items()} == {"rl": 2, "sft": 2}

    # Micro-batch invariance: the same loss, gradients and merged metrics however it is cut.
    assert split == pytest.approx(whole, abs=1e-6)
    for name in whole_grads:
        torch.testing.assert_close(split_grads[name], whole_grads[name], rtol=0, atol=1e-6)
    for key in ("loss", "sft/nll", "rl/loss", "sft/loss", "clip_fraction", "num_tokens"):
        assert split_metrics[key] == pytest.approx(metrics[key], abs=1e-6)

    # Each objective alone, on its own groups: the mixed step is their mean by share of groups.
    rl_alone, rl_grads, rl_metrics, _ = step_loss(model, groups[0::2], budget=256)
    sft_alone, sft_grads, sft_metrics, _ = step_loss(model, groups[1::2], budget=256)
    assert whole == pytest.approx(0.5 * rl_alone + 0.5 * sft_alone, abs=1e-6)
    for name in whole_grads:
        torch.testing.assert_close(whole_grads[name], 0.5 * rl_grads[name] + 0.5 * sft_grads[name], rtol=0, atol=1e-6)
    assert metrics["sft/nll"] == pytest.approx(sft_metrics["sft/nll"], abs=1e-6)
    assert metrics["clip_fraction"] == pytest.approx(rl_metrics["clip_fraction"])
    assert metrics["num_tokens"] == rl_metrics["num_tokens"] + sft_metrics["sft/num_tokens"]
    # A step of one objective keeps the names it always had; sft's NLL is a real one (> 0).
    assert "rl/loss" not in rl_metrics and rl_metrics["loss"] == pytest.approx(rl_alone)
    assert sft_metrics["loss"] == pytest.approx(sft_metrics["sft/nll"]) and sft_alone > 0

    # Stats: the reward is the sampled groups' (a demonstration's score is not a reward).
    assert step.stats["sft/groups"] == 2 and step.stats["groups"] == 4
    assert step.stats["score_mean"] == pytest.approx(1 / 3)  # scores 0 1 0 in both rl groups
