"""DPO (and IPO) pairs and on-policy distillation: hand-computed losses, the reference model against
stored reference logprobs, packed == unpacked and micro-batch invariance, a step mixing all four
objectives, and groups an objective cannot train skipped with their reason."""

from __future__ import annotations

import math

import pytest
import torch

from core.scored_group import ScoredGroup, ScoredSequence
from storage.reader import ShardReader
from tests.trainer.rollouts import sampled_groups, write_shards
from tests.trainer.test_objectives import step_loss
from trainer.config import AdvantageConfig, LossConfig
from trainer.data import DataTimeoutError, group_objective, next_step_groups, objective_problem
from trainer.losses import dpo, policy_loss
from trainer.model import load_policy
from trainer.step import build_step, training_sequences

ADVANTAGES = AdvantageConfig()

# One packed row: the chosen sequence [prompt, t1, t2], then the rejected one [prompt, t1].
ROW = dict(
    logprobs=[0.0, -1.0, -0.5, 0.0, -2.0],
    ref_logprobs=[0.0, -1.2, -0.6, 0.0, -1.5],
    advantages=[1.0, 1.0, 1.0, -1.0, -1.0],
    mask=[False, True, True, False, True],
    sequence_ids=[0, 0, 0, 1, 1],
)


def row_loss(config: LossConfig) -> tuple[torch.Tensor, torch.Tensor, dict]:
    logprobs = torch.tensor([ROW["logprobs"]], requires_grad=True)
    loss, metrics = policy_loss(
        logprobs,
        torch.zeros(1, 5),
        torch.tensor([ROW["advantages"]]),
        torch.tensor([ROW["mask"]]),
        config,
        sequence_ids=torch.tensor([ROW["sequence_ids"]]),
        ref_logprobs=torch.tensor([ROW["ref_logprobs"]]),
        function=dpo,
    )
    loss.backward()
    return loss, logprobs.grad, metrics


def test_dpo_by_hand():
    # rho(chosen) = (-1.0 + 1.2) + (-0.5 + 0.6) = 0.3, rho(rejected) = -2.0 + 1.5 = -0.5, h = 0.8.
    loss, grad, metrics = row_loss(LossConfig(dpo_beta=0.1))
    assert loss.item() == pytest.approx(math.log1p(math.exp(-0.08)), abs=1e-6)  # -log sigmoid(0.08)
    # d/d logp = -beta * sigmoid(-beta h) on the chosen tokens, + on the rejected, 0 untrained.
    g = 0.1 / (1 + math.exp(0.08))
    torch.testing.assert_close(grad, torch.tensor([[0.0, -g, -g, 0.0, g]]), rtol=0, atol=1e-6)
    assert metrics["accuracy"] == 1.0
    assert metrics["reward_margin"] == pytest.approx(0.08, abs=1e-6)
    assert metrics["chosen_reward"] == pytest.approx(0.03, abs=1e-6)
    assert metrics["rejected_reward"] == pytest.approx(-0.05, abs=1e-6)


def test_ipo_by_hand():
    # Per-token means: rho(chosen) = 0.15, rho(rejected) = -0.5, h = 0.65; (h - 1/(2 beta))^2.
    loss, grad, metrics = row_loss(LossConfig(dpo_beta=0.1, dpo_variant="ipo"))
    assert loss.item() == pytest.approx((0.65 - 5.0) ** 2, abs=1e-5)
    g = 2 * (0.65 - 5.0)  # d/dh, then 1/2 per chosen token (a mean over 2), -1 for the rejected one
    torch.testing.assert_close(grad, torch.tensor([[0.0, g / 2, g / 2, 0.0, -g]]), rtol=0, atol=1e-5)
    assert metrics["reward_margin"] == pytest.approx(0.065, abs=1e-6)


def test_dpo_refuses_sequences_out_of_pair_order():
    logprobs = torch.tensor([ROW["logprobs"]])
    with pytest.raises(ValueError, match=r"not \(chosen, rejected\) pairs"):
        policy_loss(
            logprobs,
            torch.zeros(1, 5),
            -torch.tensor([ROW["advantages"]]),
            torch.tensor([ROW["mask"]]),
            LossConfig(),
            sequence_ids=torch.tensor([ROW["sequence_ids"]]),
            ref_logprobs=torch.tensor([ROW["ref_logprobs"]]),
            function=dpo,
        )


def test_the_distillation_advantage_is_teacher_minus_sampler_on_trained_tokens():
    sequence = ScoredSequence.from_prompt(
        [5, 6], [7, 8, 9], [-1.0, -0.5, -2.0], score=0.0, teacher_logprobs=[0.0, 0.0, -0.25, -0.5, -1.0]
    )
    group = ScoredGroup(env="toy", item_id="t", sequences=[sequence])
    assert group_objective(group) == "distill"  # teacher logprobs on every sequence
    [trained] = training_sequences([group], ADVANTAGES)
    assert trained.objective == "distill"
    assert trained.advantages == [0.0, 0.0, 0.75, 0.0, 1.0]
    step = build_step([group], policy_version=0, token_budget=64, advantage_config=ADVANTAGES)
    assert step.stats["distill/kl_to_teacher"] == pytest.approx(-(0.75 + 0.0 + 1.0) / 3)
    assert "score_mean" not in step.stats  # a distillation sample's score is not the reward


def pairs(model_dir, count: int, seed: int, ref_logprobs: bool = False) -> list[ScoredGroup]:
    """dpo pairs of the model's own samples; the scores put the chosen second in every other pair."""
    groups = sampled_groups(model_dir, count, seed=seed, group_size=2)
    for index, group in enumerate(groups):
        group.objective = "dpo"
        if index % 2:
            for sequence, score in zip(group.sequences, (1.0, 0.0), strict=True):
                sequence.score = score
        if ref_logprobs:  # the model's own logprobs: sampled_groups' sampler logprobs are them
            for sequence in group.sequences:
                sequence.ref_logprobs = list(sequence.logprobs)
    return groups


def distill_groups(model_dir, count: int, seed: int) -> list[ScoredGroup]:
    groups = sampled_groups(model_dir, count, seed=seed, group_size=2)
    for group in groups:
        for sequence in group.sequences:
            sequence.teacher_logprobs = [
                lp + (0.3 if t % 2 else -0.4) if m else 0.0
                for t, (lp, m) in enumerate(zip(sequence.logprobs, sequence.mask))
            ]
    return groups


def demonstrations(count: int) -> list[ScoredGroup]:
    return [
        ScoredGroup(
            env="sft",
            item_id=f"d{i}",
            sequences=[ScoredSequence.from_prompt([7, 8, 9], [40 + i, 41, 42, 2], [0.0] * 4, 1.0)],
        )
        for i in range(count)
    ]


def moved(model_dir, seed: int = 3):
    """The policy a few updates away from the reference, so the pairs' log ratios are not 0."""
    model = load_policy(str(model_dir))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.02 * torch.randn(parameter.shape, generator=generator))
    return model


def test_a_reference_model_and_stored_reference_logprobs_give_the_same_dpo_step(tiny_model_dir):
    model, reference = moved(tiny_model_dir), load_policy(str(tiny_model_dir)).requires_grad_(False)
    by_model = step_loss(model, pairs(tiny_model_dir, 3, seed=4), 512, LossConfig(), reference=reference)
    stored = step_loss(model, pairs(tiny_model_dir, 3, seed=4, ref_logprobs=True), 512, LossConfig())
    assert by_model[0] == pytest.approx(stored[0], abs=1e-5) and by_model[0] != pytest.approx(math.log(2), abs=1e-3)
    for name in by_model[1]:
        torch.testing.assert_close(stored[1][name], by_model[1][name], rtol=0, atol=1e-5)
    # The policy is its own reference: h = 0, the loss is log 2 and nothing is preferred yet.
    same = step_loss(
        reference.requires_grad_(True), pairs(tiny_model_dir, 3, seed=4), 512, LossConfig(), reference=reference
    )
    assert same[0] == pytest.approx(math.log(2), abs=1e-5) and same[2]["dpo/accuracy"] == 0.0
    with pytest.raises(ValueError, match="without stored ref_logprobs and no reference model"):
        step_loss(model, pairs(tiny_model_dir, 1, seed=4), 512, LossConfig())


@pytest.mark.parametrize("objective", ["dpo", "ipo", "distill", "sft"])
def test_packed_equals_unpacked_and_micro_batches_do_not_matter(tiny_model_dir, objective):
    model, reference = moved(tiny_model_dir), load_policy(str(tiny_model_dir)).requires_grad_(False)
    groups = {"dpo": pairs, "ipo": pairs, "distill": distill_groups}.get(objective)
    groups = groups(tiny_model_dir, 4, seed=9) if groups else demonstrations(4)
    config = LossConfig(dpo_variant="ipo") if objective == "ipo" else LossConfig()
    unit = max(
        sum(len(s.tokens) for s in g.sequences)
        if objective in ("dpo", "ipo")
        else max(len(s.tokens) for s in g.sequences)
        for g in groups
    )
    whole, whole_grads, whole_metrics, whole_step = step_loss(model, groups, 512, config, reference)
    one_each, grads, metrics, step = step_loss(model, groups, unit, config, reference)  # about a unit a micro-batch
    assert len(whole_step.micro_batches) == 1 and len(step.micro_batches) >= 3
    assert one_each == pytest.approx(whole, abs=1e-5)
    for name in whole_grads:
        torch.testing.assert_close(grads[name], whole_grads[name], rtol=0, atol=1e-5)
    name = "dpo" if objective == "ipo" else objective
    for key in [k for k in whole_metrics if k.startswith(f"{name}/") or k == "loss"]:
        assert metrics[key] == pytest.approx(whole_metrics[key], abs=1e-5), key


def test_a_step_of_all_four_objectives_is_each_alone_weighted_by_its_groups(tiny_model_dir):
    model, reference = moved(tiny_model_dir), load_policy(str(tiny_model_dir)).requires_grad_(False)
    parts = {
        "rl": sampled_groups(tiny_model_dir, 2, seed=7, group_size=3),
        "sft": demonstrations(1),
        "dpo": pairs(tiny_model_dir, 2, seed=8),
        "distill": distill_groups(tiny_model_dir, 3, seed=10),
    }
    mixed = [g for part in parts.values() for g in part]
    total, grads, metrics, step = step_loss(model, mixed, 96, LossConfig(), reference)
    assert {name: share.groups for name, share in step.objectives.items()} == {
        "rl": 2,
        "sft": 1,
        "dpo": 2,
        "distill": 3,
    }
    expected_loss, expected_grads = 0.0, {name: torch.zeros_like(g) for name, g in grads.items()}
    for name, groups in parts.items():
        alone, alone_grads, alone_metrics, _ = step_loss(model, groups, 96, LossConfig(), reference)
        weight = len(groups) / len(mixed)
        expected_loss += weight * alone
        for key, grad in alone_grads.items():
            expected_grads[key] += weight * grad
        if name == "rl":
            assert metrics["clip_fraction"] == pytest.approx(alone_metrics["clip_fraction"], abs=1e-6)
        else:  # each objective's own metrics, under its prefix
            key = {"sft": "nll", "dpo": "accuracy", "distill": "importance_weight_mean"}[name]
            assert metrics[f"{name}/{key}"] == pytest.approx(alone_metrics[f"{name}/{key}"], abs=1e-5)
    assert total == pytest.approx(expected_loss, abs=1e-5)
    for name in grads:
        torch.testing.assert_close(grads[name], expected_grads[name], rtol=0, atol=1e-5)
    assert {"dpo/reward_margin", "dpo/loss", "sft/loss", "distill/loss", "rl/loss"} <= set(metrics)
    assert "distill/kl_to_teacher" in step.stats and step.stats["dpo/groups"] == 2


def test_groups_an_objective_cannot_train_are_skipped_with_their_reason(tmp_path):
    root = str(tmp_path)
    fine = ScoredSequence.from_prompt([1, 2], [3, 4], [-0.5, -0.5], 1.0)
    worse = ScoredSequence.from_prompt([1, 2], [3, 5], [-0.5, -0.5], 0.0)
    tie = fine.model_copy(update={"score": 0.0})
    only_first = ScoredSequence(tokens=[3, 4], mask=[True, False], logprobs=[-0.5, 0.0], score=1.0)
    groups = [
        ScoredGroup(env="toy", item_id="pair", sequences=[fine, worse]),
        ScoredGroup(env="toy", item_id="tie", sequences=[tie, worse]),
        ScoredGroup(env="toy", item_id="first-token-only", sequences=[only_first, worse]),
        ScoredGroup(env="toy", item_id="pair-2", sequences=[worse, fine]),
    ]
    write_shards(root, "run", groups, 2)
    rejected = []
    fresh, stale = next_step_groups(
        ShardReader(root, "run"),
        2,
        policy_version=0,
        max_lag=1,
        timeout_s=1,
        objective="dpo",
        on_reject=lambda group, reason: rejected.append((group.item_id, reason)),
    )
    assert [g.item_id for g in fresh] == ["pair", "pair-2"] and stale == []
    assert [item for item, _ in rejected] == ["tie", "first-token-only"]
    assert rejected[0][1].startswith("objective: dpo pair with tied scores (0.0)")
    assert rejected[1][1].startswith("sequences[0].mask: no trained token after the first")
    # Ragged teacher logprobs (a group that skipped validation): named with the fix.
    ragged = ScoredGroup.model_construct(
        env="toy",
        item_id="r",
        group_id="g",
        objective="distill",
        sequences=[
            ScoredSequence.model_construct(
                tokens=[1, 2, 3],
                mask=[False, True, True],
                logprobs=[0.0, -1.0, -1.0],
                score=0.0,
                teacher_logprobs=[0.0, -1.0],
                advantages=None,
            )
        ],
    )
    assert objective_problem(ragged, "distill").startswith("sequences[0].teacher_logprobs: 2 values for 3 tokens")


def test_a_trainer_waiting_after_rejected_groups_tells_the_samplers(tmp_path):
    # Rejected groups are consumed like stale ones: before the trainer waits, on_wait must fire so
    # it publishes them as consumed (or an admitted sampler could wait for a waiting trainer).
    root = str(tmp_path)
    worse = ScoredSequence.from_prompt([1, 2], [3, 5], [-0.5, -0.5], 0.0)
    tie = ScoredGroup(env="toy", item_id="tie", sequences=[worse, worse])
    write_shards(root, "run", [tie, tie.model_copy(update={"group_id": "other"})], 2)
    waits, rejected = [], []
    with pytest.raises(DataTimeoutError):
        next_step_groups(
            ShardReader(root, "run"),
            1,
            policy_version=0,
            max_lag=1,
            timeout_s=0.5,
            objective="dpo",
            poll_s=0.05,
            on_wait=lambda stale: waits.append(len(stale)),
            on_reject=lambda group, reason: rejected.append(group.item_id),
        )
    assert rejected == ["tie", "tie"] and waits == [0]
