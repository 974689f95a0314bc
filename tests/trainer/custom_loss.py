"""Losses defined outside the trainer, as a loss author writes them, selected by import path."""

from __future__ import annotations

import math

import torch

from trainer.config import LossConfig, LossDefaults
from trainer.losses import LossInputs, grpo, token_mean
from trainer.metrics import Maximum


def reinforce(inputs: LossInputs, config: LossConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """REINFORCE with a truncated importance weight, times loss.options.scale (default 1):
    -scale * min(r_t, cap) * A_t * logp_t per token, the weight held constant, token_mean."""
    scale = config.options.get("scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, int | float):
        raise ValueError(f"loss.options.scale: {scale!r}; give a number, e.g. 2.0")
    cap = config.importance_cap if config.importance_cap is not None else math.inf
    weight = torch.exp(inputs.log_ratio.detach()).clamp(max=cap)
    token_loss = -scale * weight * inputs.advantages * inputs.logprobs
    metrics = {
        "reinforce_weight_mean": weight.mean(),
        "reinforce_weight_max": Maximum(weight.max().item()),
        "reinforce_scale": float(scale),
    }
    return token_mean(token_loss, inputs), metrics


def wide_clip_grpo(inputs: LossInputs, config: LossConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """grpo under defaults of its own: a wider upper clip and mean-only advantages."""
    return grpo(inputs, config)


wide_clip_grpo.loss_defaults = LossDefaults(clip_high=0.5, advantage_mode="mean_only")


def unreduced(inputs: LossInputs, config: LossConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """A mistake: the per-token losses, not reduced to the micro-batch's share."""
    return -inputs.advantages * inputs.logprobs, {}


def badly_declared(inputs: LossInputs, config: LossConfig) -> tuple[torch.Tensor, dict[str, float]]:
    return grpo(inputs, config)


badly_declared.loss_defaults = {"clip_high": 0.3}  # a mistake: not a LossDefaults

NOT_A_LOSS = 3
