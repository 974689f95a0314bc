"""Policy losses (grpo, dr_grpo, dapo, gspo) as pure functions over per-token tensors.

Notation, per trained token t of sequence i:
    logp_t  the trainer's logprob of the token under the current weights (carries the gradient)
    mu_t    the sampler's logprob of the same token, stored in the ScoredGroup (`old_logprobs`)
    A_t     the token's advantage
    r_t     = exp(logp_t - mu_t), the importance ratio to the sampler

Per-token objective (maximized; the loss is its negation):
    J_t = min(w_t * A_t, clip(r_t, 1 - clip_low, 1 + clip_high) * A_t)
    w_t = r_t truncated at `importance_cap` C: its value is min(r_t, C) and its gradient is
          min(r_t, C) * grad logp_t, so truncated tokens still learn, with a bounded weight.

Why this is the whole off-policy correction: the ratio is taken to the sampler mu, not to a trainer
copy of the old policy, so r_t already is the importance weight pi/mu for staleness and for any
sampler-trainer numeric mismatch. PPO clipping zeroes the gradient where the ratio left the trust
region in the advantage's direction; the one place it leaves the weight unbounded is A_t < 0 with
r_t > 1 + clip_high, and that is exactly where the cap bites (as in truncated importance sampling,
"Your efficient RL framework secretly brings you off-policy RL training", and dual-clip PPO, which
instead zeroes those gradients). Its gradient with respect to logp_t is therefore:
    0                    where the clip is active (A_t > 0 and r_t > 1 + clip_high,
                                                   or A_t < 0 and r_t < 1 - clip_low)
    min(r_t, C) * A_t    everywhere else.

gspo replaces r_t by the sequence ratio s_i = exp(mean over the sequence's trained tokens of
(logp - mu)) in the GSPO-token form: s_i's value with the gradient of logp_t, which equals GSPO
exactly when A is constant over the sequence and still honours per-token advantage overrides.

Normalization, chosen so that gradients do not depend on how a step is cut into micro-batches:
    grpo, gspo   (sum over sequences of each one's mean token loss) / step_num_sequences
    dapo         (sum of token losses) / step_num_tokens
    dr_grpo      (sum of token losses) / (step_num_sequences * constant_normalizer)
Pass the whole optimizer step's counts and sum (never average) the micro-batch losses; the step's
loss is then that sum. Left out, the counts are this call's own. With data-parallel ranks whose
gradients are averaged, pass the global counts divided by the world size.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from trainer.config import LossConfig


def token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Logprob of each input token under the logits that predict it.

    logits [batch, seq, vocab], input_ids [batch, seq] -> [batch, seq], float32 or wider.

    Next-token prediction: token t is predicted by the logits at position t - 1, so
    result[:, t] = log_softmax(logits[:, t - 1] / temperature)[input_ids[:, t]], result[:, 0] = 0.
    The first token of a sequence has no prediction and is never trained; in packed rows the first
    token of each later sequence gets a meaningless value (its "prediction" comes from the previous
    sequence) and packing masks it out. `temperature` must match the sampler's logprobs.
    """
    if logits.shape[:2] != input_ids.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and input_ids {tuple(input_ids.shape)}: the first two "
            "dimensions must match; pass the model's logits for exactly these input_ids"
        )
    scaled = logits[:, :-1].to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    picked = scaled.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    predicted = picked - torch.logsumexp(scaled, dim=-1)
    return torch.nn.functional.pad(predicted, (1, 0), value=0.0)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: LossConfig,
    *,
    sequence_ids: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    step_num_sequences: float | None = None,
    step_num_tokens: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy loss of one micro-batch and its metrics (plain floats).

    logprobs      [batch, seq]  trainer logprobs, with gradient (see `token_logprobs`)
    old_logprobs  [batch, seq]  the sampler's logprobs
    advantages    [batch, seq]
    mask          [batch, seq]  bool, True where the token is trained; nothing else is read there
    sequence_ids  [batch, seq]  int >= 0 on trained tokens: which sequence of its row a token is
                                in (packed rows); None: each row is one sequence (padded batches)
    ref_logprobs  [batch, seq]  a frozen reference model's logprobs; required when kl_coef > 0

    The KL penalty adds kl_coef * (exp(ref - logp) - (ref - logp) - 1) per token (the k3 estimator,
    non-negative and unbiased), reduced like the policy term. Counts: see the module docstring.

    Metrics, over trained tokens: loss; clip_fraction (gradient zeroed by the clip); capped_fraction
    (weight truncated by importance_cap); importance_weight_mean/max/min (the ratio the loss used:
    per token, or the sequence's for gspo); sampler_kl (mean of r - 1 - log r, an estimate of
    KL(sampler || policy): staleness plus numeric mismatch); kl (to the reference, when given);
    num_tokens; num_sequences.
    """
    _check_shapes(
        logprobs,
        old_logprobs=old_logprobs,
        advantages=advantages,
        mask=mask,
        sequence_ids=sequence_ids,
        ref_logprobs=ref_logprobs,
    )
    if config.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("ref_logprobs: missing while loss.kl_coef > 0; pass them or set kl_coef=0")

    # Work on the trained tokens only, as flat [tokens] vectors: values at untrained positions
    # (padding, prompts, garbage logprobs across packed boundaries) can then never leak in as NaN.
    trained = mask.bool()
    dtype = torch.promote_types(logprobs.dtype, torch.float32)  # bf16 is too coarse for ratios
    logp = logprobs[trained].to(dtype)
    token_log_ratio = logp - old_logprobs[trained].to(dtype)
    advantage = advantages[trained].to(dtype)
    sequence, num_sequences = _dense_sequence_index(trained, sequence_ids)
    num_tokens = logp.numel()
    if num_tokens == 0:
        # Keep the graph connected so every rank runs the same backward, with a zero gradient.
        return logprobs.sum() * 0.0, {"loss": 0.0, "num_tokens": 0, "num_sequences": 0}

    if config.name == "gspo":
        sequence_log_ratio = _segment_mean(token_log_ratio.detach(), sequence, num_sequences)
        log_ratio = sequence_log_ratio[sequence] + logp - logp.detach()
    else:
        log_ratio = token_log_ratio
    token_loss = -_clipped_objective(log_ratio, advantage, config)
    kl = None
    if ref_logprobs is not None:
        ref_minus_logp = ref_logprobs[trained].to(dtype) - logp
        kl = torch.exp(ref_minus_logp) - ref_minus_logp - 1.0
        token_loss = token_loss + config.kl_coef * kl

    if config.name in ("grpo", "gspo"):
        total = _segment_mean(token_loss, sequence, num_sequences).sum()
        loss = total / (step_num_sequences or num_sequences)
    elif config.name == "dapo":
        loss = token_loss.sum() / (step_num_tokens or num_tokens)
    else:
        loss = token_loss.sum() / (
            (step_num_sequences or num_sequences) * config.constant_normalizer
        )

    metrics = _metrics(loss, log_ratio.detach(), token_log_ratio.detach(), advantage, kl, config)
    metrics["num_tokens"] = num_tokens
    metrics["num_sequences"] = num_sequences
    return loss, metrics


def _clipped_objective(
    log_ratio: torch.Tensor, advantage: torch.Tensor, config: LossConfig
) -> torch.Tensor:
    """min(w A, clip(r) A) per token, [tokens] -> [tokens]; w is r truncated at the cap."""
    if config.importance_cap is None:
        weight = torch.exp(log_ratio)
    else:
        # Value min(r, C) with the ratio's own gradient direction; in log space so a huge ratio
        # never overflows (inf times the zero gradient of a clamp is NaN).
        excess = torch.relu(log_ratio - math.log(config.importance_cap)).detach()
        weight = torch.exp(log_ratio - excess)
    low, high = math.log(1.0 - config.clip_low), math.log1p(config.clip_high)
    clipped_ratio = torch.exp(log_ratio.clamp(low, high))
    return torch.minimum(weight * advantage, clipped_ratio * advantage)


@torch.no_grad()
def _metrics(
    loss: torch.Tensor,
    log_ratio: torch.Tensor,
    token_log_ratio: torch.Tensor,
    advantage: torch.Tensor,
    kl: torch.Tensor | None,
    config: LossConfig,
) -> dict[str, float]:
    ratio = torch.exp(log_ratio)
    clip_active = ((advantage > 0) & (ratio > 1.0 + config.clip_high)) | (
        (advantage < 0) & (ratio < 1.0 - config.clip_low)
    )
    capped = torch.zeros_like(clip_active)
    if config.importance_cap is not None:
        capped = ~clip_active & (ratio > config.importance_cap)
    values = {
        "loss": loss,
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
    return dict(
        zip(
            values, torch.stack([v.detach().float() for v in values.values()]).tolist(), strict=True
        )
    )


def _check_shapes(logprobs: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs: shape {tuple(logprobs.shape)}; pass [batch, seq] tensors")
    for name, tensor in tensors.items():
        if tensor is not None and tensor.shape != logprobs.shape:
            raise ValueError(
                f"{name}: shape {tuple(tensor.shape)} != logprobs {tuple(logprobs.shape)}; "
                "give every per-token tensor the same [batch, seq] shape"
            )


def merge_metrics(micro_batch_metrics: Iterable[dict[str, float]]) -> dict[str, float]:
    """Combine the metrics of a step's micro-batches into the step's.

    loss and num_* add up (each micro-batch loss is already a share of the step's), *_max and *_min
    take the extreme, everything else is a mean weighted by trained tokens.
    """
    merged: dict[str, float] = {}
    weights: dict[str, float] = {}
    for metrics in micro_batch_metrics:
        tokens = metrics.get("num_tokens", 0)
        for key, value in metrics.items():
            if key == "loss" or key.startswith("num_"):
                merged[key] = merged.get(key, 0) + value
            elif key.endswith("_max"):
                merged[key] = max(merged.get(key, value), value)
            elif key.endswith("_min"):
                merged[key] = min(merged.get(key, value), value)
            else:
                merged[key] = merged.get(key, 0.0) + value * tokens
                weights[key] = weights.get(key, 0) + tokens
    for key, weight in weights.items():
        merged[key] = merged[key] / weight if weight else 0.0
    return merged


def _dense_sequence_index(
    trained: torch.Tensor, sequence_ids: torch.Tensor | None
) -> tuple[torch.Tensor, int]:
    """For each trained token (in mask order), the index 0..n-1 of its sequence; and n.

    Sequences are told apart by (row, sequence id), so ids may restart in every packed row.
    """
    rows, columns = trained.shape
    row = torch.arange(rows, device=trained.device)[:, None].expand(rows, columns)
    if sequence_ids is None:
        key = row
    else:
        ids = sequence_ids.long()
        key = row * (int(ids.max()) + 1 if ids.numel() else 1) + ids
    unique, index = torch.unique(key[trained], return_inverse=True)
    return index, unique.numel()


def _segment_mean(values: torch.Tensor, segment: torch.Tensor, num_segments: int) -> torch.Tensor:
    """Mean of `values` [tokens] within each segment that `segment` [tokens] names -> [segments]."""
    sums = torch.zeros(num_segments, dtype=values.dtype, device=values.device).index_add(
        0, segment, values
    )
    counts = torch.bincount(segment, minlength=num_segments).to(values.dtype)
    return sums / counts
