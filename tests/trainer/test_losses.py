"""Policy losses pinned by hand-computed tensors and by the micro-batching invariant."""

from __future__ import annotations

import math

import pytest
import torch

from tests.trainer.toy_model import ToyCausalLM, gradients, padded_attention_mask
from trainer.config import LossConfig
from trainer.losses import policy_loss, sft
from trainer.metrics import Maximum, Minimum, Total, merge_metrics
from trainer.model import token_logprobs

# The worked example used by the hand-computed tests. Two sequences of three tokens; the sampler
# gave every token logprob -1, and the trainer's ratios pi/mu are chosen round:
#   sequence 0: ratios 1.0 1.5 0.5, advantage +1, first token untrained
#   sequence 1: ratios 1.1 1.0 3.0, advantage -1, all trained
RATIOS = [[1.0, 1.5, 0.5], [1.1, 1.0, 3.0]]
ADVANTAGES = [[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]]
MASK = [[False, True, True], [True, True, True]]


def worked_example():
    old = torch.full((2, 3), -1.0, dtype=torch.float64)
    logprobs = (old + torch.tensor(RATIOS, dtype=torch.float64).log()).requires_grad_()
    return logprobs, old, torch.tensor(ADVANTAGES, dtype=torch.float64), torch.tensor(MASK)


def loss_and_grad(config, **kwargs):
    logprobs, old, advantages, mask = worked_example()
    loss, metrics = policy_loss(logprobs, old, advantages, mask, config, **kwargs)
    loss.backward()
    return loss.item(), logprobs.grad, metrics


def test_grpo_by_hand():
    # clip range [0.8, 1.2], cap 2. Per-token objective min(w A, clip(r) A):
    #   seq 0: r=1.5, A=+1 -> min(1.5, 1.2) = 1.2   clipped, no gradient
    #          r=0.5, A=+1 -> min(0.5, 0.8) = 0.5   gradient weight 0.5
    #   seq 1: r=1.1, A=-1 -> -1.1; r=1.0 -> -1.0;
    #          r=3.0 -> w = min(3, 2) = 2 -> min(-2, -1.2) = -2   capped
    # Sequence means: (1.2 + 0.5) / 2 = 0.85 and -4.1 / 3; loss = -(0.85 - 4.1/3) / 2 = 0.258333.
    # d loss / d logp_t = -(1/2 sequences) (1/n_i tokens) w_t A_t.
    loss, grad, metrics = loss_and_grad(LossConfig(name="grpo"))
    assert loss == pytest.approx(-(0.85 - 4.1 / 3) / 2)
    expected = [[0.0, 0.0, -0.5 / 4], [1.1 / 6, 1.0 / 6, 2.0 / 6]]
    torch.testing.assert_close(grad, torch.tensor(expected, dtype=torch.float64))
    assert metrics["clip_fraction"] == pytest.approx(1 / 5)
    assert metrics["capped_fraction"] == pytest.approx(1 / 5)
    assert metrics["importance_weight_mean"] == pytest.approx(7.1 / 5)
    assert metrics["importance_weight_max"] == pytest.approx(3.0)
    assert metrics["importance_weight_min"] == pytest.approx(0.5)
    trained_ratios = [1.5, 0.5, 1.1, 1.0, 3.0]
    sampler_kl = sum(r - 1 - math.log(r) for r in trained_ratios) / 5
    assert metrics["sampler_kl"] == pytest.approx(sampler_kl)
    assert metrics["num_tokens"] == 5 and metrics["num_sequences"] == 2
    assert metrics["loss"] == pytest.approx(loss)


def test_grpo_without_cap_keeps_the_full_weight():
    # Only the r=3, A=-1 token changes: objective -3 and gradient weight 3.
    # Sequence 1 mean -5.1 / 3 = -1.7; loss = -(0.85 - 1.7) / 2 = 0.425.
    loss, grad, metrics = loss_and_grad(LossConfig(name="grpo", importance_cap=None))
    assert loss == pytest.approx(0.425)
    assert grad[1, 2].item() == pytest.approx(3.0 / 6)
    assert metrics["capped_fraction"] == 0.0


def test_dapo_by_hand():
    # Clip range [0.8, 1.28]: seq 0's r=1.5 token now gives 1.28 (still clipped).
    # Sum of objectives 1.28 + 0.5 - 1.1 - 1 - 2 = -2.32 over 5 trained tokens: loss 0.464.
    # d loss / d logp_t = -(1/5) w_t A_t.
    loss, grad, metrics = loss_and_grad(LossConfig(name="dapo"))
    assert loss == pytest.approx(2.32 / 5)
    expected = [[0.0, 0.0, -0.5 / 5], [1.1 / 5, 1.0 / 5, 2.0 / 5]]
    torch.testing.assert_close(grad, torch.tensor(expected, dtype=torch.float64))
    assert metrics["clip_fraction"] == pytest.approx(1 / 5)


def test_dr_grpo_by_hand():
    # Clip range [0.8, 1.2]; objectives sum to 1.2 + 0.5 - 1.1 - 1 - 2 = -2.4, divided by
    # 2 sequences x constant 4: loss 0.3. d loss / d logp_t = -(1/8) w_t A_t.
    loss, grad, _ = loss_and_grad(LossConfig(name="dr_grpo", constant_normalizer=4))
    assert loss == pytest.approx(0.3)
    expected = [[0.0, 0.0, -0.5 / 8], [1.1 / 8, 1.0 / 8, 2.0 / 8]]
    torch.testing.assert_close(grad, torch.tensor(expected, dtype=torch.float64))


def test_gspo_by_hand():
    # Sequence ratios: s0 = exp(mean(log 1.5, log 0.5)) = sqrt(0.75) = 0.866025, inside [0.8, 1.2];
    # s1 = (1.1 * 1.0 * 3.0) ** (1/3) = 1.488806, A=-1, below the cap: objective -1.488806.
    # loss = -(s0 - s1) / 2. Each trained token of sequence i: d/d logp_t = -(1/2)(1/n_i) s_i A_i.
    config = LossConfig(name="gspo", clip_low=0.2, clip_high=0.2)
    loss, grad, metrics = loss_and_grad(config)
    s0, s1 = math.sqrt(0.75), 3.3 ** (1 / 3)
    assert loss == pytest.approx((s1 - s0) / 2)
    expected = [[0.0, -s0 / 4, -s0 / 4], [s1 / 6, s1 / 6, s1 / 6]]
    torch.testing.assert_close(grad, torch.tensor(expected, dtype=torch.float64))
    assert metrics["importance_weight_max"] == pytest.approx(s1)
    assert metrics["clip_fraction"] == 0.0


def test_gspo_matches_the_sequence_level_definition():
    # With one advantage per sequence, GSPO-token must equal GSPO written directly on s_i.
    generator = torch.Generator().manual_seed(1)
    old = -torch.rand(3, 5, generator=generator, dtype=torch.float64) * 3
    logprobs = (old + torch.randn(3, 5, generator=generator, dtype=torch.float64) * 0.3).requires_grad_()
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    sequence_advantage = torch.tensor([0.7, -1.3, 0.4], dtype=torch.float64)
    advantages = sequence_advantage[:, None].expand(3, 5)
    config = LossConfig(name="gspo", clip_low=0.1, clip_high=0.1, importance_cap=None)
    loss, _ = policy_loss(logprobs, old, advantages, mask, config)
    (grad,) = torch.autograd.grad(loss, logprobs)

    direct_logprobs = logprobs.detach().clone().requires_grad_()
    log_ratio = ((direct_logprobs - old) * mask).sum(1) / mask.sum(1)
    ratio = log_ratio.exp()
    objective = torch.minimum(ratio * sequence_advantage, ratio.clamp(0.9, 1.1) * sequence_advantage)
    direct_loss = -objective.mean()
    (direct_grad,) = torch.autograd.grad(direct_loss, direct_logprobs)
    assert loss.item() == pytest.approx(direct_loss.item())
    torch.testing.assert_close(grad, direct_grad)


def test_gspo_clips_whole_sequences():
    old = torch.zeros(1, 3, dtype=torch.float64)
    logprobs = torch.log(torch.tensor([[1.0, 1.01, 1.02]], dtype=torch.float64)).requires_grad_()
    mask = torch.tensor([[False, True, True]])
    loss, metrics = policy_loss(logprobs, old, torch.ones(1, 3), mask, LossConfig(name="gspo"))
    loss.backward()
    assert torch.count_nonzero(logprobs.grad) == 0  # s = 1.015 > 1 + 4e-4 with A > 0
    assert metrics["clip_fraction"] == 1.0


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "dapo", "gspo"])
def test_a_built_in_by_name_and_by_import_path_is_the_same_loss(name):
    by_name = loss_and_grad(LossConfig(name=name))
    by_path = loss_and_grad(LossConfig(name=f"trainer.losses:{name}"))
    assert by_path[0] == by_name[0] and by_path[2] == by_name[2]
    assert torch.equal(by_path[1], by_name[1])


def test_a_custom_loss_by_hand():
    # tests.trainer.custom_loss:reinforce: -scale * w_t * A_t * logp_t over the 5 trained tokens,
    # w_t = min(r_t, 2) held constant: w = 1.5 0.5 | 1.1 1.0 2.0; d loss / d logp_t = -3 w_t A_t / 5.
    config = LossConfig(name="tests.trainer.custom_loss:reinforce", options={"scale": 3.0})
    loss, grad, metrics = loss_and_grad(config)
    logp = [math.log(r) - 1.0 for r in (1.5, 0.5, 1.1, 1.0, 3.0)]
    weighted = [1.5, 0.5, -1.1, -1.0, -2.0]  # w_t A_t
    assert loss == pytest.approx(-3 * sum(w * lp for w, lp in zip(weighted, logp)) / 5)
    expected = [[0.0, -3 * 1.5 / 5, -3 * 0.5 / 5], [3 * 1.1 / 5, 3 * 1.0 / 5, 3 * 2.0 / 5]]
    torch.testing.assert_close(grad, torch.tensor(expected, dtype=torch.float64))
    assert metrics["reinforce_weight_mean"] == pytest.approx(6.1 / 5)
    assert metrics["reinforce_weight_max"] == 2.0
    assert isinstance(metrics["reinforce_weight_max"], Maximum)  # merges as a maximum
    assert metrics["reinforce_scale"] == 3.0 and "clip_fraction" not in metrics
    assert (metrics["loss"], metrics["num_tokens"], metrics["num_sequences"]) == (pytest.approx(loss), 5, 2)


def test_a_loss_that_does_not_reduce_is_named():
    logprobs, old, advantages, mask = worked_example()
    config = LossConfig(name="tests.trainer.custom_loss:unreduced")
    with pytest.raises(ValueError, match="unreduced': returned a loss of \\(5,\\); return a 0-dim"):
        policy_loss(logprobs, old, advantages, mask, config)


def test_kl_penalty_by_hand():
    # One trained token, ratio 1, advantage 0; ref - logp = log 2.
    # k3 = exp(log 2) - log 2 - 1 = 0.306853; loss = 0.1 * k3.
    # d k3 / d logp = -exp(ref - logp) + 1 = -1, so the gradient is 0.1 * -1.
    logprobs = torch.tensor([[-1.0, -1.0]], dtype=torch.float64, requires_grad=True)
    old = logprobs.detach().clone()
    ref = old + math.log(2.0)
    mask = torch.tensor([[False, True]])
    config = LossConfig(kl_coef=0.1)
    loss, metrics = policy_loss(logprobs, old, torch.zeros(1, 2), mask, config, ref_logprobs=ref)
    loss.backward()
    k3 = 1.0 - math.log(2.0)
    assert loss.item() == pytest.approx(0.1 * k3)
    assert metrics["kl"] == pytest.approx(k3)
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, -0.1]], dtype=torch.float64))


def test_kl_needs_reference_logprobs():
    logprobs, old, advantages, mask = worked_example()
    with pytest.raises(ValueError, match="ref_logprobs.*kl_coef"):
        policy_loss(logprobs, old, advantages, mask, LossConfig(kl_coef=0.1))


def test_shape_mismatch_names_the_tensor():
    logprobs, old, advantages, mask = worked_example()
    with pytest.raises(ValueError, match="advantages: shape"):
        policy_loss(logprobs, old, advantages[:, :2], mask, LossConfig())


def test_untrained_and_extreme_values_never_give_nan():
    # Untrained slots hold garbage (as packed boundaries and padding do); a trained token has a
    # ratio of e^200, which overflows float32, and a negative advantage: the cap bounds its weight.
    logprobs = torch.tensor([[5.0, 0.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-1e4, -200.0, float("nan")]])
    mask = torch.tensor([[False, True, False]])
    loss, metrics = policy_loss(logprobs, old, -torch.ones(1, 3), mask, LossConfig())
    loss.backward()
    assert math.isfinite(loss.item()) and loss.item() == pytest.approx(2.0, rel=1e-5)
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, 2.0, 0.0]]))
    assert metrics["capped_fraction"] == 1.0


def test_nothing_trained_gives_zero_loss_with_a_graph():
    logprobs = torch.zeros(1, 4, requires_grad=True)
    loss, metrics = policy_loss(
        logprobs,
        torch.zeros(1, 4),
        torch.ones(1, 4),
        torch.zeros(1, 4, dtype=torch.bool),
        LossConfig(),
    )
    loss.backward()
    assert loss.item() == 0.0 and metrics["num_tokens"] == 0
    assert torch.count_nonzero(logprobs.grad) == 0


def test_sft_by_hand():
    # NLL_t = -logp_t = 1 - log r_t on the five trained tokens (logp = -1 + log r), token mean;
    # d loss / d logp_t = -1/5 on each trained token. Sampler logprobs and advantages are unread.
    loss, grad, metrics = loss_and_grad(LossConfig(), function=sft)
    trained_ratios = [1.5, 0.5, 1.1, 1.0, 3.0]
    expected = sum(1 - math.log(r) for r in trained_ratios) / 5
    assert loss == pytest.approx(expected)
    assert metrics["nll"] == pytest.approx(expected) and metrics["loss"] == pytest.approx(expected)
    assert metrics["num_tokens"] == 5 and metrics["num_sequences"] == 2
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.2, -0.2], [-0.2, -0.2, -0.2]], dtype=torch.float64))
    logprobs, old, advantages, mask = worked_example()
    moved, _ = policy_loss(logprobs, old + 3.0, -advantages, mask, LossConfig(), function=sft)
    assert moved.item() == pytest.approx(expected)


def test_packed_sequence_ids_group_tokens_like_rows():
    logprobs, old, advantages, mask = worked_example()
    expected, _ = policy_loss(logprobs, old, advantages, mask, LossConfig(name="grpo"))
    packed, _ = policy_loss(
        logprobs.reshape(1, 6),
        old.reshape(1, 6),
        advantages.reshape(1, 6),
        mask.reshape(1, 6),
        LossConfig(name="grpo"),
        sequence_ids=torch.tensor([[0, 0, 0, 1, 1, 1]]),
    )
    assert packed.item() == pytest.approx(expected.item())


def test_token_logprobs_shift_by_one():
    logits = torch.tensor([[[2.0, 0.0, 1.0], [0.0, 3.0, 0.0], [1.0, 1.0, 1.0]]])
    input_ids = torch.tensor([[1, 2, 1]])
    result = token_logprobs(logits, input_ids)
    # Token 1 (id 2) is predicted by position 0's logits; token 2 (id 1) by position 1's.
    expected = [
        0.0,
        torch.log_softmax(logits[0, 0], -1)[2].item(),
        torch.log_softmax(logits[0, 1], -1)[1].item(),
    ]
    torch.testing.assert_close(result, torch.tensor([expected]))
    halved = token_logprobs(logits, input_ids, temperature=2.0)
    assert halved[0, 1].item() == pytest.approx(torch.log_softmax(logits[0, 0] / 2, -1)[2].item())


def test_merge_metrics():
    # The values' types say how they merge; a plain float (a custom loss's own metric too) is a
    # mean weighted by trained tokens.
    first = {
        "loss": Total(0.5),
        "clip_fraction": 0.5,
        "my_metric": 4.0,
        "importance_weight_max": Maximum(2.0),
        "importance_weight_min": Minimum(0.5),
        "num_tokens": Total(2),
        "num_sequences": Total(1),
    }
    second = {
        "loss": Total(0.25),
        "clip_fraction": 0.0,
        "my_metric": 0.0,
        "importance_weight_max": Maximum(3.0),
        "importance_weight_min": Minimum(0.9),
        "num_tokens": Total(6),
        "num_sequences": Total(2),
    }
    merged = merge_metrics([first, second])
    assert merged == {
        "loss": 0.75,
        "clip_fraction": pytest.approx(1 / 8),
        "my_metric": pytest.approx(1.0),
        "importance_weight_max": 3.0,
        "importance_weight_min": 0.5,
        "num_tokens": 8,
        "num_sequences": 3,
    }
    assert all(type(value) is float for value in merged.values())


# --- micro-batch 2 x accumulation 2 == micro-batch 4 ----------------------------------------

LENGTHS = [5, 7, 4, 6]


def toy_batch():
    """Four right-padded sequences with the per-token loss inputs, built from a toy model."""
    generator = torch.Generator().manual_seed(0)
    width = max(LENGTHS)
    input_ids = torch.randint(0, 17, (4, width), generator=generator)
    mask = torch.zeros(4, width, dtype=torch.bool)
    for row, length in enumerate(LENGTHS):
        mask[row, 2:length] = True
    positions = torch.arange(width).expand(4, width)
    attention = padded_attention_mask(LENGTHS, width)
    with torch.no_grad():
        current = token_logprobs(ToyCausalLM(seed=1)(input_ids, positions, attention), input_ids)
    # The sampler and the reference differ from the trained weights (seed 1) by noise, so some
    # ratios clip, some are capped and most pass.
    old = current + torch.randn(4, width, generator=generator, dtype=torch.float64) * 0.4
    reference = current + torch.randn(4, width, generator=generator, dtype=torch.float64) * 0.2
    advantages = torch.tensor([0.9, -1.1, 0.4, -0.2], dtype=torch.float64)[:, None].expand(4, width).clone()
    advantages[3] = torch.randn(width, generator=generator, dtype=torch.float64)  # a per-token override
    return input_ids, positions, attention, mask, old, advantages, reference


LOSS_CONFIGS = [
    LossConfig(name=name, clip_low=0.2, clip_high=0.28, kl_coef=0.05, constant_normalizer=8)
    for name in ("grpo", "dr_grpo", "dapo", "gspo")
]


@pytest.mark.parametrize(
    "config, function",
    [(config, None) for config in LOSS_CONFIGS] + [(LOSS_CONFIGS[0], sft)],
    ids=[config.name for config in LOSS_CONFIGS] + ["sft"],
)
def test_two_micro_batches_of_two_equal_one_of_four(config, function):
    input_ids, positions, attention, mask, old, advantages, reference = toy_batch()
    model = ToyCausalLM(seed=1)

    def run(rows, **counts):
        logprobs = token_logprobs(model(input_ids[rows], positions[rows], attention[rows]), input_ids[rows])
        loss, metrics = policy_loss(
            logprobs,
            old[rows],
            advantages[rows],
            mask[rows],
            config,
            ref_logprobs=reference[rows],
            function=function,
            **counts,
        )
        loss.backward()
        return loss.item(), metrics

    whole_loss, whole_metrics = run(slice(0, 4))
    whole = gradients(model)
    counts = {"step_num_sequences": 4, "step_num_tokens": int(mask.sum())}
    parts = [run(slice(0, 2), **counts), run(slice(2, 4), **counts)]
    accumulated = gradients(model)

    assert sum(loss for loss, _ in parts) == pytest.approx(whole_loss, abs=1e-10)
    assert any(g.abs().max() > 1e-3 for g in whole.values())
    for name in whole:
        torch.testing.assert_close(accumulated[name], whole[name], rtol=0, atol=1e-5)
    merged = merge_metrics([metrics for _, metrics in parts])
    shared = set(whole_metrics) - {"num_tokens", "num_sequences"}
    assert shared >= ({"nll"} if function else {"clip_fraction", "importance_weight_max", "kl"})
    for key in shared:
        assert merged[key] == pytest.approx(whole_metrics[key])
