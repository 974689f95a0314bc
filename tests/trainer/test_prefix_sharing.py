"""Prefix sharing: a group's prompt laid out once trains exactly as every sequence laid out whole."""

from __future__ import annotations

import torch

from core.scored_group import ScoredGroup, ScoredSequence
from trainer.config import AdvantageConfig, LossConfig
from trainer.model import load_policy, micro_batch_loss
from trainer.packing import TrainingSequence
from trainer.prefix_sharing import share_prefixes, shared_prefix_length
from trainer.step import build_step


def group(prompt: int, answers: list[int], seed: int, *, own_prompts: bool = False) -> ScoredGroup:
    """A group of answers to one prompt of `prompt` tokens (each its own prompt with own_prompts),
    sampler logprobs near the model's, scores that give every answer an advantage."""
    generator = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, 500, (prompt,), generator=generator).tolist()
    sequences = []
    for i, length in enumerate(answers):
        head = torch.randint(3, 500, (prompt,), generator=generator).tolist() if own_prompts else shared
        answer = torch.randint(3, 500, (length,), generator=generator).tolist()
        sequences.append(
            ScoredSequence.from_prompt(
                head,
                answer,
                (-2.0 - torch.rand(length, generator=generator)).tolist(),
                float(i % 3),
            )
        )
    return ScoredGroup(env="toy", item_id=str(seed), sequences=sequences)


def step(groups: list[ScoredGroup], share: bool, token_work: int):
    return build_step(
        groups,
        policy_version=0,
        token_budget=4096,
        advantage_config=AdvantageConfig(),
        token_work=token_work,
        share_prompts=share,
    )


def loss_and_gradients(model, batch_step):
    model.zero_grad()
    total = 0.0
    for batch in batch_step.micro_batches:
        loss, _ = micro_batch_loss(model, batch, LossConfig(name="grpo"), objectives=batch_step.objectives)
        loss.backward()
        total += loss.item()
    return total, torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_a_shared_prompt_trains_exactly_as_every_sequence_whole(tiny_model_dir):
    # Four groups of 8 short answers to one prompt share it; a group of different prompts is laid
    # out whole, as before. The loss and every gradient are the same either way; the shared layout
    # computes 4 x 7 x 24 fewer tokens.
    model = load_policy(str(tiny_model_dir)).train()
    work = 6 * model.config.hidden_size
    groups = [group(24, [2, 5, 3, 4, 2, 3, 5, 4], seed) for seed in range(3)]
    groups += [group(24, [3, 4, 2, 5, 3, 2, 4, 3], 3), group(24, [3] * 8, 4, own_prompts=True)]
    whole, shared = step(groups, False, work), step(groups, True, work)
    assert shared.stats["shared_prefix_tokens"] == 4 * 7 * 24 and whole.stats["shared_prefix_tokens"] == 0
    assert shared.stats["tokens"] == whole.stats["tokens"]
    assert (
        (shared.num_sequences, shared.num_trained_tokens)
        == (whole.num_sequences, whole.num_trained_tokens)
        == (40, 134)
    )
    assert all(batch.predictors is not None for batch in shared.micro_batches)
    whole_loss, whole_grad = loss_and_gradients(model, whole)
    shared_loss, shared_grad = loss_and_gradients(model, shared)
    assert abs(shared_loss - whole_loss) <= 1e-5 * abs(whole_loss)
    torch.testing.assert_close(shared_grad, whole_grad, rtol=1e-4, atol=1e-5 * whole_grad.abs().max().item())


def test_the_demo_s_groups_are_a_prompt_and_its_answers_a_row(tiny_model_dir):
    # 8 prompts of 27 tokens x 16 answers of 4 (the demo): 8 rows of 27 + 64 slots (96 with the
    # row multiple), not 128 of 31. Each answer's positions go on from the prompt's, its first
    # token is predicted by the prompt's last slot and it attends to the prompt and itself only.
    groups = [group(27, [4] * 16, seed) for seed in range(8)]
    (batch,) = step(groups, True, 6 * 256).micro_batches
    assert tuple(batch.input_ids.shape) == (8, 96)
    assert batch.position_ids[0, 27:35].tolist() == [27, 28, 29, 30, 27, 28, 29, 30]
    assert batch.predictors[0, 27:35].tolist() == [26, 27, 28, 29, 26, 31, 32, 33]
    mask = batch.attention_mask()[0, 0]
    second = slice(31, 35)
    assert mask[second, :27].all() and not mask[second, 27:31].any()
    assert torch.equal(mask[second, second], torch.ones(4, 4, dtype=torch.bool).tril())
    assert batch.sequence_prefixes[:3] == [None, 0, 0] and batch.num_sequences == 128


def test_long_answers_keep_their_prompt_copies():
    # 8 answers of 400 tokens to a 50-token prompt: one row of 3,250 slots would cost more
    # attention than the prompt's seven copies; the packer's cost model keeps them apart.
    groups = [group(50, [400] * 8, seed) for seed in range(2)]
    assert step(groups, True, 6 * 256).stats["shared_prefix_tokens"] == 0


def sequence(tokens: list[int], mask: list[bool], unit: int, group_index: int = 0) -> TrainingSequence:
    return TrainingSequence(
        tokens=tokens,
        mask=mask,
        old_logprobs=[0.0] * len(tokens),
        advantages=[1.0] * len(tokens),
        name=f"s{unit}",
        unit=unit,
        group=group_index,
    )


def test_a_prefix_stops_at_the_first_trained_token_and_leaves_each_sequence_a_token():
    a = sequence([1, 2, 3, 4, 5, 6], [False, False, False, True, True, True], 0)
    b = sequence([1, 2, 3, 4, 5, 7], [False] * 5 + [True], 1)
    assert shared_prefix_length([a, b]) == 3
    c = sequence([1, 2, 3], [False, False, True], 2)
    assert shared_prefix_length([sequence([1, 2, 3], [False, False, True], 3), c]) == 2
    assert shared_prefix_length([c]) == 0


def test_pairs_and_sequences_of_no_group_are_laid_out_whole():
    tokens = list(range(1, 40))
    pair = [sequence(tokens + [50], [False] * 39 + [True], 0), sequence(tokens + [51], [False] * 39 + [True], 0)]
    loose = [
        sequence(tokens + [52], [False] * 39 + [True], 1, -1),
        sequence(tokens + [53], [False] * 39 + [True], 2, -1),
    ]
    assert share_prefixes(pair + loose, 4096, 6 * 256) == pair + loose
