"""The pieces the losses in trainer.losses are made of, public for custom losses to reuse (they are
importable from trainer.losses too): the clipped per-token objective, the k3 KL to a reference,
the reductions that keep a step's loss independent of its micro-batching, and the ratio metrics.
The notation and the normalization rules are trainer.losses' docstring."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from trainer.config import LossConfig
from trainer.metrics import LossMetrics, Maximum, Minimum


@dataclass(frozen=True)
class LossInputs:
    """One micro-batch's trained tokens, in mask order, and the counts its loss divides by.

    logprobs            [tokens] float  the trainer's logprobs, with gradient (float32 or wider)
    sampler_logprobs    [tokens] float  the sampler's logprobs mu of the same tokens
    advantages          [tokens] float
    sequence            [tokens] long   each token's sequence, 0..num_sequences-1
    num_sequences       int             sequences with a trained token in this micro-batch
    ref_logprobs        [tokens] float  a frozen reference model's logprobs, or None without one
    step_num_sequences  float           the optimizer step's sequences (over the world size)
    step_num_tokens     float           the optimizer step's trained tokens (over the world size)
    """

    logprobs: torch.Tensor
    sampler_logprobs: torch.Tensor
    advantages: torch.Tensor
    sequence: torch.Tensor
    num_sequences: int
    ref_logprobs: torch.Tensor | None
    step_num_sequences: float
    step_num_tokens: float

    @property
    def num_tokens(self) -> int:
        return self.logprobs.numel()

    @property
    def log_ratio(self) -> torch.Tensor:
        """log r_t = logp_t - mu_t, [tokens], with the gradient of logp."""
        return self.logprobs - self.sampler_logprobs


def clipped_token_loss(
    inputs: LossInputs, log_ratio: torch.Tensor, config: LossConfig
) -> tuple[torch.Tensor, LossMetrics]:
    """-J_t, plus the KL penalty when there are reference logprobs: [tokens]; and ratio_metrics.

    log_ratio [tokens] is the log of the ratio to clip: inputs.log_ratio per token, or another
    (gspo's sequence ratio) carrying the gradient of inputs.logprobs.
    """
    token_loss = -clipped_objective(log_ratio, inputs.advantages, config)
    kl = kl_to_reference(inputs)
    if kl is not None:
        token_loss = token_loss + config.kl_coef * kl
    return token_loss, ratio_metrics(log_ratio.detach(), inputs, config, kl=kl)


def clipped_objective(log_ratio: torch.Tensor, advantage: torch.Tensor, config: LossConfig) -> torch.Tensor:
    """J_t = min(w A, clip(r) A) per token, [tokens] -> [tokens]; w is r truncated at the cap."""
    if config.importance_cap is None:
        weight = torch.exp(log_ratio)
    else:
        # Value min(r, C) with the ratio's own gradient direction; in log space so a huge ratio
        # never overflows (inf times the zero gradient of a clamp is NaN).
        excess = torch.relu(log_ratio - math.log(config.importance_cap)).detach()
        weight = torch.exp(log_ratio - excess)
    clip_low, clip_high = config.clips
    low, high = math.log(1.0 - clip_low), math.log1p(clip_high)
    clipped_ratio = torch.exp(log_ratio.clamp(low, high))
    return torch.minimum(weight * advantage, clipped_ratio * advantage)


def kl_to_reference(inputs: LossInputs) -> torch.Tensor | None:
    """k3 = exp(ref - logp) - (ref - logp) - 1 per token, [tokens]; None without ref_logprobs."""
    if inputs.ref_logprobs is None:
        return None
    ref_minus_logp = inputs.ref_logprobs - inputs.logprobs
    return torch.exp(ref_minus_logp) - ref_minus_logp - 1.0


def sequence_mean(token_loss: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
    """(sum over sequences of each one's mean token loss) / step_num_sequences: [tokens] -> []."""
    total = segment_mean(token_loss, inputs.sequence, inputs.num_sequences).sum()
    return total / inputs.step_num_sequences


def token_mean(token_loss: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
    """(sum of token losses) / step_num_tokens: [tokens] -> []."""
    return token_loss.sum() / inputs.step_num_tokens


def constant_normalized(token_loss: torch.Tensor, inputs: LossInputs, constant: float) -> torch.Tensor:
    """(sum of token losses) / (step_num_sequences * constant): [tokens] -> []."""
    return token_loss.sum() / (inputs.step_num_sequences * constant)


def segment_mean(values: torch.Tensor, segment: torch.Tensor, num_segments: int) -> torch.Tensor:
    """Mean of `values` [tokens] within each segment that `segment` [tokens] names -> [segments]."""
    sums = torch.zeros(num_segments, dtype=values.dtype, device=values.device).index_add(0, segment, values)
    counts = torch.bincount(segment, minlength=num_segments).to(values.dtype)
    return sums / counts


@torch.no_grad()
def ratio_metrics(
    log_ratio: torch.Tensor,
    inputs: LossInputs,
    config: LossConfig,
    *,
    kl: torch.Tensor | None = None,
) -> LossMetrics:
    """Metrics of a clipped loss over the trained tokens, log_ratio [tokens] the one it clipped.

    clip_fraction (gradient zeroed by the clip); capped_fraction (weight truncated by
    importance_cap); importance_weight_mean/max/min (the ratio the loss used: per token, or the
    sequence's for gspo); sampler_kl (mean of r - 1 - log r, an estimate of KL(sampler || policy):
    staleness plus numeric mismatch); kl (the mean of `kl`, to the reference, when given).
    """
    ratio = torch.exp(log_ratio)
    token_log_ratio = inputs.log_ratio
    advantage = inputs.advantages
    clip_low, clip_high = config.clips
    clip_active = ((advantage > 0) & (ratio > 1.0 + clip_high)) | ((advantage < 0) & (ratio < 1.0 - clip_low))
    capped = torch.zeros_like(clip_active)
    if config.importance_cap is not None:
        capped = ~clip_active & (ratio > config.importance_cap)
    values = {
        "clip_fraction": clip_active.float().mean(),
        "capped_fraction": capped.float().mean(),
        "importance_weight_mean": ratio.mean(),
        "importance_weight_max": ratio.max(),
        "importance_weight_min": ratio.min(),
        "sampler_kl": (torch.exp(token_log_ratio) - 1.0 - token_log_ratio).mean(),
    }
    if kl is not None:
        values["kl"] = kl.mean()
    # One stacked transfer instead of a device sync per metric.
    floats = dict(zip(values, torch.stack([v.float() for v in values.values()]).tolist()))
    floats["importance_weight_max"] = Maximum(floats["importance_weight_max"])
    floats["importance_weight_min"] = Minimum(floats["importance_weight_min"])
    return floats
