"""Off-policy corrections by name: losses that weigh, mask or cap each token's policy gradient by
how far the trainer's policy has moved from the sampler's, each its paper's formula.

Chosen like any loss (`loss.name: icepop`; trainer.losses has the signature and the notation), with
their thresholds in `loss.options` (defaults next to each function, LossDefaults.options).

Notation, per trained token t of sequence i (trainer.losses): logp_t the trainer's logprob (with
the gradient), mu_t the sampler's, A_t the advantage, and

    rho_t = exp(sg(logp_t) - mu_t)   the importance weight pi / mu of the token, no gradient
    r_t   = exp(logp_t - sg(logp_t)) the ratio to the old policy: 1 in value, grad logp_t

The papers write three policies: the sampler mu (the inference engine), the old policy pi_old
(the trainer's weights that sampled, recomputed) and pi. clotho takes one optimizer step per batch
of groups, so pi_old is the current weights before the step: pi_old = sg(pi), r_t = 1 in value,
and every mismatch between the sampler and the trainer, numeric or from staleness, is in rho_t.
Where a paper's ratio is to the sampler (CISPO as ScaleRL uses it, DPPO), it is rho_t with the
gradient of logp.

Every correction reports, per step (summed over micro-batches), the tokens it masked or capped:
`masked_tokens`, `capped_tokens` (and `masked_sequences` for mis_sequence), with the importance
weights it saw (importance_weight_mean/max/min) and `sampler_kl`, as the clipped losses do.
Masked tokens stay in the normalization's denominator, as in each paper: they add 0.
"""

from __future__ import annotations

import torch

from trainer.config import LossConfig, LossDefaults
from trainer.loss_terms import LossInputs, kl_to_reference, sequence_mean, token_mean
from trainer.metrics import LossMetrics, Maximum, Minimum, Total


def importance_weights(inputs: LossInputs) -> torch.Tensor:
    """rho_t = pi / mu per trained token, [tokens], without gradient (its log clamped at 20, as
    verl does, so that a token the sampler all but ruled out gives a large finite weight)."""
    return torch.exp((inputs.logprobs.detach() - inputs.sampler_logprobs).clamp(max=20.0))


def old_policy_ratio(inputs: LossInputs) -> torch.Tensor:
    """r_t = pi / pi_old with pi_old = sg(pi): 1 in value, the gradient of logp_t."""
    return torch.exp(inputs.logprobs - inputs.logprobs.detach())


def with_kl(token_loss: torch.Tensor, inputs: LossInputs, config: LossConfig) -> torch.Tensor:
    """token_loss plus the KL penalty to the reference (trainer.losses), where there is one."""
    kl = kl_to_reference(inputs)
    return token_loss if kl is None else token_loss + config.kl_coef * kl


@torch.no_grad()
def correction_metrics(inputs: LossInputs, weights: torch.Tensor, **counts: torch.Tensor) -> LossMetrics:
    """The importance weights a correction saw, [tokens] (mean, max, min), sampler_kl (mean of
    rho - 1 - log rho: KL(sampler || policy) estimated), and each count summed over the step."""
    log_rho = inputs.logprobs.detach() - inputs.sampler_logprobs
    values = torch.stack(
        [
            weights.mean(),
            weights.max(),
            weights.min(),
            (torch.exp(log_rho) - 1.0 - log_rho).mean(),
            *(count.sum() for count in counts.values()),
        ]
    ).tolist()
    mean, high, low, sampler_kl, *sums = values
    return {
        "importance_weight_mean": mean,
        "importance_weight_max": Maximum(high),
        "importance_weight_min": Minimum(low),
        "sampler_kl": sampler_kl,
        **{name: Total(total) for name, total in zip(counts, sums, strict=True)},
    }


def token_mask_correction(inputs: LossInputs, config: LossConfig) -> tuple[torch.Tensor, LossMetrics]:
    """The IcePop / token-MIS objective, normalized as grpo (mean over each sequence's tokens, the
    masked ones included, summed over sequences / step_num_sequences):

        J_t = M(rho_t) * min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t),
        M(k) = k if low <= k <= high else 0

    r_t = 1 in value, so the clip never binds and the gradient is M(rho_t) A_t grad logp_t."""
    low, high = config.options["low"], config.options["high"]
    rho = importance_weights(inputs)
    kept = (rho >= low) & (rho <= high)
    ratio = old_policy_ratio(inputs)
    clip_low, clip_high = config.clips
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    objective = torch.where(kept, rho, 0.0) * torch.minimum(ratio * inputs.advantages, clipped * inputs.advantages)
    loss = sequence_mean(with_kl(-objective, inputs, config), inputs)
    return loss, correction_metrics(inputs, rho, masked_tokens=~kept)


def icepop(inputs: LossInputs, config: LossConfig) -> tuple[torch.Tensor, LossMetrics]:
    """IcePop (Ring-1T, arXiv 2510.18855, "Small Leak Can Sink a Great Ship"): the GRPO objective
    with each token weighed by its train-inference ratio k = pi_old / mu where it lies in
    [alpha, beta] (options low, high: 0.5, 5 as in Ring-1T) and masked outside it:

        J = 1/G sum_i 1/|y_i| sum_t M(k_i,t; alpha, beta) min(r_i,t A, clip(r_i,t, 1 - eps, 1 + eps) A)

    (token_mask_correction). `masked_tokens`: the tokens outside [alpha, beta]."""
    return token_mask_correction(inputs, config)


def mis_token(inputs: LossInputs, config: LossConfig) -> tuple[torch.Tensor, LossMetrics]:
    """Token-level masked importance sampling (Liu, Li et al. 2025, "When Speed Kills Stability:
    Demystifying RL Collapse from the Training-Inference Mismatch"): each token's gradient weighed
    by its ratio rho_t and rejected (weight 0) where rho_t > C, the estimator
    rho_t 1[rho_t <= C] A_t grad logp_t; options high (C, 2 as in its TIS runs) and low (a lower
    rejection bound, 0: none, as in the paper). The same objective as icepop
    (token_mask_correction) at other bounds. `masked_tokens`: the rejected tokens."""
    return token_mask_correction(inputs, config)


def mis_sequence(inputs: LossInputs, config: LossConfig) -> tuple[torch.Tensor, LossMetrics]:
    """Sequence-level masked importance sampling (Liu, Li et al. 2025, as mis_token): a sequence's
    importance weight is the product of its tokens' ratios, rho_i = prod_t rho_i,t; the sequence
    is rejected where rho_i leaves [low, high] (options; 0 and C = 2: the paper's upper bound
    only), else every token is weighed by rho_i:

        J = 1/G sum_i 1/|y_i| sum_t rho_i 1[low <= rho_i <= high] A_i,t r_i,t

    normalized as grpo. `masked_sequences` and `masked_tokens`: the rejected ones."""
    low, high = config.options["low"], config.options["high"]
    log_rho = inputs.logprobs.detach() - inputs.sampler_logprobs
    sequence_log_rho = torch.zeros(inputs.num_sequences, dtype=log_rho.dtype, device=log_rho.device).index_add(
        0, inputs.sequence, log_rho
    )
    rho = torch.exp(sequence_log_rho.clamp(max=20.0))
    kept = (rho >= low) & (rho <= high)
    objective = torch.where(kept, rho, 0.0)[inputs.sequence] * inputs.advantages * old_policy_ratio(inputs)
    loss = sequence_mean(with_kl(-objective, inputs, config), inputs)
    return loss, correction_metrics(
        inputs, rho[inputs.sequence], masked_tokens=~kept[inputs.sequence], masked_sequences=~kept
    )


def cispo(inputs: LossInputs, config: LossConfig) -> tuple[torch.Tensor, LossMetrics]:
    """CISPO (MiniMax-M1, arXiv 2506.13585): REINFORCE with each token's importance weight clipped
    and stopped, so no token's gradient is ever dropped, only bounded:

        J = 1 / sum_i |o_i| * sum_i sum_t sg(clip(rho_i,t, low, high)) A_i,t log pi(o_i,t)

    with the ratio to the sampler, as ScaleRL (arXiv 2510.13786) runs it (to pi_old it would be 1
    here); options low and high, absolute bounds on the weight (0 and 5, ScaleRL's eps_max: the
    paper bounds it above only). Normalized over the step's tokens. `capped_tokens`: the tokens
    whose weight the clip changed."""
    low, high = config.options["low"], config.options["high"]
    rho = importance_weights(inputs)
    weight = rho.clamp(low, high)
    loss = token_mean(with_kl(-weight * inputs.advantages * inputs.logprobs, inputs, config), inputs)
    return loss, correction_metrics(inputs, rho, capped_tokens=(rho < low) | (rho > high))


def dppo(inputs: LossInputs, config: LossConfig) -> tuple[torch.Tensor, LossMetrics]:
    """DPPO, binary total-variation form (Qi et al. 2026, "Rethinking the Trust Region in LLM RL",
    arXiv 2602.04879; sail-sg/Stable-RL): the trust region is on the probability difference to the
    sampler, not the ratio. A token that already moved more than delta in its advantage's direction
    is masked:

        J = 1 / sum_i |o_i| * sum_i sum_t M_i,t sg(min(rho_i,t, C)) A_i,t log pi(o_i,t)
        M = 0 where A > 0 and pi - mu > delta_high, or A < 0 and pi - mu < -delta_low; else 1

    pi and mu the tokens' probabilities; options delta_low, delta_high (0.2) and cap (C = 5, the
    paper's default). Normalized over the step's tokens. `masked_tokens`: M = 0; `capped_tokens`:
    rho > C among the others."""
    options = config.options
    rho = importance_weights(inputs)
    moved = torch.exp(inputs.logprobs.detach()) - torch.exp(inputs.sampler_logprobs)
    masked = ((inputs.advantages > 0) & (moved > options["delta_high"])) | (
        (inputs.advantages < 0) & (moved < -options["delta_low"])
    )
    weight = torch.where(masked, 0.0, rho.clamp(max=options["cap"]))
    loss = token_mean(with_kl(-weight * inputs.advantages * inputs.logprobs, inputs, config), inputs)
    return loss, correction_metrics(inputs, rho, masked_tokens=masked, capped_tokens=~masked & (rho > options["cap"]))


icepop.loss_defaults = LossDefaults(options={"low": 0.5, "high": 5.0})  # type: ignore[attr-defined]
mis_token.loss_defaults = LossDefaults(options={"low": 0.0, "high": 2.0})  # type: ignore[attr-defined]
mis_sequence.loss_defaults = LossDefaults(options={"low": 0.0, "high": 2.0})  # type: ignore[attr-defined]
cispo.loss_defaults = LossDefaults(options={"low": 0.0, "high": 5.0})  # type: ignore[attr-defined]
dppo.loss_defaults = LossDefaults(options={"delta_low": 0.2, "delta_high": 0.2, "cap": 5.0})  # type: ignore[attr-defined]
