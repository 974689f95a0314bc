"""Packing: bin plans, packed tensors and masks, step stats, packed == unpacked through a model."""

from __future__ import annotations

import random

import pytest
import torch

from core.scored_group import ScoredGroup, ScoredSequence
from tests.trainer.toy_model import ToyCausalLM, gradients, padded_attention_mask
from trainer.config import AdvantageConfig, LossConfig
from trainer.losses import policy_loss
from trainer.model import token_logprobs
from trainer.packing import (
    additive_mask,
    choose_row_length,
    pack_micro_batches,
    padding_waste,
    plan_micro_batches,
)
from trainer.step import build_step, training_sequences

ADVANTAGES = AdvantageConfig(mode="mean_only")


def make_group(lengths, prompt=2, version=0, scores=None, override=None):
    sequences = []
    for i, length in enumerate(lengths):
        completion = length - prompt
        sequences.append(
            ScoredSequence.from_prompt(
                list(range(1, prompt + 1)),
                [(i + t) % 17 for t in range(completion)],
                [-0.5] * completion,
                scores[i] if scores else float(i),
                advantages=override if i == 1 else None,
            )
        )
    return ScoredGroup(env="toy", item_id="0", sequences=sequences, policy_version=version)


def test_first_fit_decreasing_plan():
    # Longest first: 7 opens bin A (room 1), 5 opens B (room 3), 4 opens C (room 4),
    # 3 goes to B (room 0), 2 goes to C. Indices are reported in input order per bin.
    assert plan_micro_batches([5, 3, 7, 2, 4], 8) == [[2], [0, 1], [3, 4]]
    assert plan_micro_batches([], 8) == []


def test_overlong_sequence_is_named_with_the_fix():
    groups = [make_group([4, 12, 5])]
    with pytest.raises(ValueError, match=r"sequences\[1\]: 12 tokens > micro_batch_tokens 10; raise"):
        build_step(groups, policy_version=0, token_budget=10, advantage_config=ADVANTAGES)


def test_packed_tensors():
    # Two sequences of 4 and 3 tokens (prompt 2), padded to 8: one padding slot.
    # mean_only advantages of scores 0, 1: -0.5 and +0.5 on the completion tokens.
    (batch,) = pack_micro_batches(
        training_sequences([make_group([4, 3])], ADVANTAGES), 16, row_multiple=8, padded_rows=False
    )
    assert batch.input_ids.tolist() == [[1, 2, 0, 1, 1, 2, 1, 0]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0]]
    assert batch.sequence_ids.tolist() == [[0, 0, 0, 0, 1, 1, 1, -1]]
    assert batch.mask.tolist() == [[False, False, True, True, False, False, True, False]]
    assert batch.old_logprobs.tolist() == [[0.0, 0.0, -0.5, -0.5, 0.0, 0.0, -0.5, 0.0]]
    assert batch.advantages.tolist() == [[0.0, 0.0, -0.5, -0.5, 0.0, 0.0, 0.5, 0.0]]
    assert (batch.num_slots, batch.num_padding, batch.num_trained_tokens, batch.num_sequences) == (
        8,
        1,
        3,
        2,
    )
    assert padding_waste([batch]) == 1 / 8


def test_first_token_is_never_trained():
    sequence = ScoredSequence(tokens=[5, 6, 7], mask=[True, True, False], logprobs=[-1.0, -1.0, 0.0], score=1.0)
    group = ScoredGroup(env="toy", item_id="0", sequences=[sequence])
    (row,) = training_sequences([group], ADVANTAGES)
    assert row.mask == [False, True, False]


def test_block_diagonal_causal_mask():
    (batch,) = pack_micro_batches(
        training_sequences([make_group([3, 2], prompt=1)], ADVANTAGES), 8, row_multiple=8, padded_rows=False
    )
    mask = batch.attention_mask()
    assert mask.shape == (1, 1, 8, 8)
    expected = torch.zeros(8, 8, dtype=torch.bool)
    expected[:3, :3] = torch.ones(3, 3, dtype=torch.bool).tril()
    expected[3:5, 3:5] = torch.ones(2, 2, dtype=torch.bool).tril()
    expected[5:, 5:] = torch.eye(3, dtype=torch.bool)  # padding sees only itself
    assert torch.equal(mask[0, 0], expected)
    additive = additive_mask(mask)
    assert additive[0, 0, 1, 0] == 0 and additive[0, 0, 0, 1] == torch.finfo(torch.float32).min


def test_every_group_given_is_packed_and_its_staleness_measured():
    # Skipping stale groups is trainer.data's rule; build_step packs and measures what it gets.
    groups = [make_group([4, 4], version=v, scores=[1.0, 0.0]) for v in (5, 4, 3)]
    step = build_step(groups, policy_version=5, token_budget=64, advantage_config=ADVANTAGES)
    assert step.stats["groups"] == 3 and "stale_groups_skipped" not in step.stats
    assert step.stats["staleness_mean"] == 1.0 and step.stats["staleness_max"] == 2
    assert step.stats["score_mean"] == 0.5
    assert step.stats["advantage_mean"] == 0.0 and step.stats["advantage_max"] == 0.5
    assert (step.num_sequences, step.num_trained_tokens) == (6, 12)


def test_no_groups_give_an_empty_step():
    step = build_step([], policy_version=9, token_budget=64, advantage_config=ADVANTAGES)
    assert step.micro_batches == [] and step.stats["groups"] == 0
    assert step.stats["padding_waste"] == 0.0 and step.stats["staleness_max"] == 0
    assert (step.num_sequences, step.num_trained_tokens) == (0, 0)


def test_shared_rows_are_planned_for_least_padding_and_dense_ones_trade_it_for_attention():
    # Environment-shaped data: 8 groups of 8 answers, prompts of 50-400 tokens, answers of
    # 20-1000, a 4096-token budget. Kept apart by their bounds, each sequence's attention costs
    # the same in any row: narrow and wide models alike get the rows with the least padding.
    rng = random.Random(0)
    groups = []
    for _ in range(8):
        prompt = rng.randint(50, 400)
        groups.append(make_group([prompt + rng.randint(20, 1000) for _ in range(8)], prompt=prompt))
    longest = max(len(s.tokens) for g in groups for s in g.sequences)
    narrow, wide = (
        build_step(
            groups,
            policy_version=0,
            token_budget=4096,
            advantage_config=ADVANTAGES,
            share_prompts=False,
            token_work=work,
            padded_rows=False,
        )
        for work in (6 * 64, 6 * 4096)
    )
    assert [b.input_ids.shape for b in narrow.micro_batches] == [b.input_ids.shape for b in wide.micro_batches]
    assert narrow.stats["padding_waste"] <= 0.05 and not any(b.needs_mask() for b in narrow.micro_batches)
    # Under the dense mask (a shared prompt, a hook) every slot attends its whole row: a narrow
    # model (attention dominates a slot's cost) gets the shortest rows the data allows, a wide one
    # longer rows with less padding.
    lengths = [len(s.tokens) for g in groups for s in g.sequences]
    dense = {work: choose_row_length(lengths, 4096, 8, work, dense=True) for work in (6 * 64, 6 * 4096)}
    assert dense[6 * 64][0] == -(-longest // 8) * 8 < dense[6 * 4096][0]
    for step in (narrow, wide):
        assert all(b.num_slots <= 4096 for b in step.micro_batches)
        assert step.stats["tokens"] == sum(len(s.tokens) for g in groups for s in g.sequences)
        slots = sum(b.num_slots for b in step.micro_batches)
        assert step.stats["padding_waste"] == pytest.approx(1 - step.stats["tokens"] / slots)


def test_short_answers_share_rows_without_padding_and_without_a_mask():
    # The demo's shape: 8 prompts x 16 answers of 31 tokens, rows shared: 8 answers a row of 248
    # slots, no padding, kept apart by their bounds (one dense row of 4096 slots paid attention
    # over 4096^2 pairs).
    groups = [make_group([31] * 16, prompt=27) for _ in range(8)]
    (batch,) = build_step(
        groups, policy_version=0, token_budget=4096, advantage_config=ADVANTAGES, share_prompts=False, padded_rows=False
    ).micro_batches
    assert tuple(batch.input_ids.shape) == (16, 248) and batch.shares_rows() and not batch.needs_mask()
    assert batch.num_sequences == 128 and batch.sequence_ids[0].tolist() == [
        index for index in range(8) for _ in range(31)
    ]
    bounds, longest = batch.sequence_bounds()
    assert bounds.tolist() == list(range(0, 16 * 248 + 1, 31)) and longest == 31


def test_answers_of_one_length_train_as_a_padded_batch_with_no_mask():
    # For the demo's model (hidden 256) rows of three sequences with a dense mask cost more than
    # one sequence a row at the longest length with causal attention and no mask at all.
    lengths = [33] * 15 + [30]
    groups = [make_group(lengths, prompt=29) for _ in range(8)]
    step = build_step(
        groups,
        policy_version=0,
        token_budget=8192,
        advantage_config=ADVANTAGES,
        share_prompts=False,
        token_work=6 * 256,
    )
    (batch,) = step.micro_batches
    assert tuple(batch.input_ids.shape) == (128, 33) and not batch.needs_mask()
    assert batch.sequence_ids[:, 0].tolist() == list(range(128)) and step.stats["padding_waste"] == pytest.approx(
        3 * 8 / (128 * 33)
    )
    # A budget of 4096 slots holds 124 such rows: two micro-batches of 64, not 124 and 4.
    halves = build_step(
        groups,
        policy_version=0,
        token_budget=4096,
        advantage_config=ADVANTAGES,
        share_prompts=False,
        token_work=6 * 256,
    )
    assert [b.input_ids.shape[0] for b in halves.micro_batches] == [64, 64]
    # Rows that share need their sequences' bounds (variable-length attention), not a mask.
    shared = build_step(
        groups,
        policy_version=0,
        token_budget=4096,
        advantage_config=ADVANTAGES,
        share_prompts=False,
        token_work=6 * 256,
        padded_rows=False,
    )
    assert shared.micro_batches[0].shares_rows() and not shared.micro_batches[0].needs_mask()
    assert not step.micro_batches[0].shares_rows()


# --- packed == unpacked, through a model ------------------------------------------------------


def model_groups(override=None):
    """Two groups of real-looking data: sampler logprobs are the toy model's plus noise."""
    generator = torch.Generator().manual_seed(3)
    sampler = ToyCausalLM(seed=1)
    lengths, prompts = [7, 9, 5, 8, 6], [2, 3, 2, 4, 1]
    sequences = []
    for i, (length, prompt) in enumerate(zip(lengths, prompts, strict=True)):
        tokens = torch.randint(0, 17, (1, length), generator=generator)
        attention = padded_attention_mask([length], length)
        with torch.no_grad():
            logprobs = token_logprobs(sampler(tokens, torch.arange(length)[None], attention), tokens)[0]
        logprobs += torch.randn(length, generator=generator, dtype=torch.float64) * 0.3
        sequences.append(
            ScoredSequence(
                tokens=tokens[0].tolist(),
                mask=[False] * prompt + [True] * (length - prompt),
                logprobs=[0.0] * prompt + logprobs[prompt:].tolist(),
                score=float(i * i % 5),  # 0 1 4 | 4 1: every sequence has an advantage
                advantages=override if (override is not None and i == 3) else None,
            )
        )
    return [
        ScoredGroup(env="toy", item_id="a", sequences=sequences[:3]),
        ScoredGroup(env="toy", item_id="b", sequences=sequences[3:]),
    ]


CONFIGS = [
    LossConfig(name=n, clip_low=0.2, clip_high=0.28, constant_normalizer=8) for n in ("grpo", "dr_grpo", "dapo", "gspo")
]


def packed_loss(model, step, config):
    total = 0.0
    for batch in step.micro_batches:
        logprobs = token_logprobs(model(batch.input_ids, batch.position_ids, batch.attention_mask()), batch.input_ids)
        loss, _ = policy_loss(
            logprobs,
            batch.old_logprobs,
            batch.advantages,
            batch.mask,
            config,
            sequence_ids=batch.sequence_ids,
            step_num_sequences=step.num_sequences,
            step_num_tokens=step.num_trained_tokens,
        )
        loss.backward()
        total += loss.item()
    return total


def padded_loss(model, groups, config):
    rows = training_sequences(groups, ADVANTAGES)
    width = max(len(r.tokens) for r in rows)

    def padded(name, fill, dtype):
        # float32 like the packed tensors, so both sides see the same rounded inputs.
        return torch.tensor([getattr(r, name) + [fill] * (width - len(r.tokens)) for r in rows], dtype=dtype)

    input_ids = padded("tokens", 0, torch.long)
    attention = padded_attention_mask([len(r.tokens) for r in rows], width)
    logprobs = token_logprobs(model(input_ids, torch.arange(width).expand(len(rows), width), attention), input_ids)
    loss, _ = policy_loss(
        logprobs,
        padded("old_logprobs", 0.0, torch.float32),
        padded("advantages", 0.0, torch.float32),
        padded("mask", False, torch.bool),
        config,
    )
    loss.backward()
    return loss.item()


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize("budget", [64, 16], ids=["one_micro_batch", "several_micro_batches"])
@pytest.mark.parametrize("padded_rows", [False, True], ids=["packed", "padded_allowed"])
def test_packed_equals_unpacked(config, budget, padded_rows):
    groups = model_groups()
    model = ToyCausalLM(seed=1)
    step = build_step(
        groups,
        policy_version=0,
        token_budget=budget,
        advantage_config=ADVANTAGES,
        row_multiple=8,
        padded_rows=padded_rows,
    )
    if not padded_rows:
        assert len(step.micro_batches) == (1 if budget == 64 else 3)
    packed = packed_loss(model, step, config)
    packed_grads = gradients(model)
    unpacked = padded_loss(model, groups, config)
    unpacked_grads = gradients(model)
    assert packed == pytest.approx(unpacked, abs=1e-9)
    assert any(g.abs().max() > 1e-3 for g in packed_grads.values())
    for name in packed_grads:
        torch.testing.assert_close(packed_grads[name], unpacked_grads[name], rtol=0, atol=1e-5)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_advantage_override_changes_exactly_its_sequence(config):
    def logprob_gradient(groups):
        step = build_step(groups, policy_version=0, token_budget=64, advantage_config=ADVANTAGES)
        (batch,) = step.micro_batches
        generator = torch.Generator().manual_seed(4)
        logprobs = (
            batch.old_logprobs + torch.randn(batch.old_logprobs.shape, generator=generator) * 0.1
        ).requires_grad_()
        loss, _ = policy_loss(
            logprobs,
            batch.old_logprobs,
            batch.advantages,
            batch.mask,
            config,
            sequence_ids=batch.sequence_ids,
        )
        loss.backward()
        return logprobs.grad, batch.sequence_ids

    base, sequence_ids = logprob_gradient(model_groups())
    override = [0.0, 0.0, 0.0, 0.0, 2.0, -1.0, 0.5, 3.0]  # sequence 3: 8 tokens, prompt 4
    changed, _ = logprob_gradient(model_groups(override))
    overridden = sequence_ids == 3
    assert torch.equal(changed[~overridden], base[~overridden])
    assert not torch.allclose(changed[overridden], base[overridden])


def test_answers_of_31_and_33_tokens_train_one_a_row_rather_than_pay_for_shared_rows():
    # The demo's answers on the bench's small model (hidden 256), forward and backward on 2 cores:
    # 128 x 33 one a row 0.496 s, 64 x 64 two a row kept apart by their bounds 0.537 s (under the
    # dense mask, as before, 0.489 s). Rows of 64 save 3% of the slots, less than the shared rows'
    # overhead (packing.SHARED_ROW_OVERHEAD).
    groups = [make_group([31 if i % 2 else 33] * 16, prompt=27) for i in range(8)]
    step = build_step(
        groups,
        policy_version=0,
        token_budget=4096,
        advantage_config=ADVANTAGES,
        share_prompts=False,
        token_work=6 * 256,
    )
    assert [tuple(b.input_ids.shape) for b in step.micro_batches] == [(64, 33), (64, 33)]  # 4224 slots: two
    assert not any(b.shares_rows() or b.needs_mask() for b in step.micro_batches)
