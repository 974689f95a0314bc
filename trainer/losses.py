"""Losses: one function signature; the policy losses grpo, dr_grpo, dapo and gspo, the sft loss of
demonstrations, and the pieces they are made of, as pure functions over the trained tokens.

Objectives. Every group is trained with one objective (trainer.data.group_objective): "rl" groups
with the configured policy loss below, "sft" groups with `sft`, the negative log-likelihood of
their trained tokens, "dpo" pairs with `dpo` (or IPO), "distill" groups with the configured policy
loss on per-token advantages teacher - sampler logprob (trainer.step.training_sequences). Each
objective's loss divides by its own share of the step's counts and is weighted by its share of
the step's groups (trainer.step.ObjectiveShare), so a step of one objective is exactly that
objective's loss.

Writing a loss. A loss is one function, chosen by `loss.name` in the trainer config: a built-in's
short name or the import path of any function ("package.module:function") of this signature:

    def my_loss(inputs: LossInputs, config: LossConfig) -> tuple[torch.Tensor, dict[str, float]]

`inputs` holds one micro-batch's trained tokens as flat [tokens] vectors (never empty) and the
optimizer step's counts. The loss returns this micro-batch's share of the step's loss, a 0-dim
tensor (normalize by the step's counts, as below, so that micro-batch losses add up to the step's),
and its metrics: floats or 0-dim tensors, merged over the step as means weighted by trained tokens,
unless a float is wrapped as trainer.metrics.Total (adds up), Maximum or Minimum. `loss`,
`num_tokens` and `num_sequences` are added for it. Settings come from `config`: the shared fields
(clip_low, clip_high, importance_cap, kl_coef) and `config.options`, a custom loss's own. A loss
that wants other defaults than clip 0.2 / 0.2 and grpo advantages declares them next to itself,
`my_loss.loss_defaults = LossDefaults(clip_high=0.28)` (trainer.config). The public helpers below
(clipped_token_loss, clipped_objective, kl_to_reference, ratio_metrics, sequence_mean, token_mean,
constant_normalized, segment_mean; in trainer.loss_terms, importable from here) are there to reuse:
dapo is three lines of them.

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

The KL penalty adds kl_coef * (exp(ref - logp) - (ref - logp) - 1) per token (the k3 estimator,
non-negative and unbiased), reduced like the policy term.

Normalization, chosen so that gradients do not depend on how a step is cut into micro-batches:
    grpo, gspo   (sum over sequences of each one's mean token loss) / step_num_sequences
    dapo         (sum of token losses) / step_num_tokens
    dr_grpo      (sum of token losses) / (step_num_sequences * constant_normalizer)
Pass the whole optimizer step's counts and sum (never average) the micro-batch losses; the step's
loss is then that sum. Left out, the counts are this call's own. With data-parallel ranks whose
gradients are averaged, pass the global counts divided by the world size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from trainer.config import LossConfig, LossDefaults
from trainer.loss_terms import (  # noqa: F401 - public here too, for custom losses
    LossInputs,
    clipped_objective,
    clipped_token_loss,
    constant_normalized,
    kl_to_reference,
    ratio_metrics,
    segment_mean,
    sequence_mean,
    token_mean,
)
from trainer.metrics import LossMetrics, Total


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
    function: Callable[..., Any] | None = None,
) -> tuple[torch.Tensor, LossMetrics]:
    """The configured loss (`config.function`, or `function`: another objective's, such as `sft`)
    of one micro-batch, and its metrics (floats).

    logprobs      [batch, seq]  trainer logprobs, with gradient (see `trainer.model.token_logprobs`)
    old_logprobs  [batch, seq]  the sampler's logprobs
    advantages    [batch, seq]
    mask          [batch, seq]  bool, True where the token is trained; nothing else is read there
    sequence_ids  [batch, seq]  int >= 0 on trained tokens: which sequence of its row a token is
                                in (packed rows); None: each row is one sequence (padded batches)
    ref_logprobs  [batch, seq]  a frozen reference model's logprobs; required when kl_coef > 0

    Picks out the trained tokens as LossInputs and calls the loss on them (a micro-batch without
    any gives 0 with a zero gradient, and the loss is not called). The metrics are the loss's (see
    `ratio_metrics` for the built-ins') plus loss, num_tokens and num_sequences.
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
    sequence, num_sequences = _dense_sequence_index(trained, sequence_ids)
    num_tokens = logp.numel()
    if num_tokens == 0:
        # Keep the graph connected so every rank runs the same backward, with a zero gradient.
        return logprobs.sum() * 0.0, {"loss": Total(0.0), "num_tokens": Total(0), "num_sequences": Total(0)}
    inputs = LossInputs(
        logprobs=logp,
        sampler_logprobs=old_logprobs[trained].to(dtype),
        advantages=advantages[trained].to(dtype),
        sequence=sequence,
        num_sequences=num_sequences,
        ref_logprobs=None if ref_logprobs is None else ref_logprobs[trained].to(dtype),
        step_num_sequences=step_num_sequences or num_sequences,
        step_num_tokens=step_num_tokens or num_tokens,
    )
    function = function or config.function
    loss, metrics = function(inputs, config)
    name = config.name if function is config.function else function.__name__
    return loss, _metric_floats(loss, metrics, inputs, name)


# --- the built-in losses -------------------------------------------------------------------------


def grpo(inputs: LossInputs, config: LossConfig) -> tuple[torch.Tensor, LossMetrics]:
    """PPO-clip per token, mean over each sequence, summed over sequences / step_num_sequences."""
    token_loss, metrics = clipped_token_loss(inputs, inputs.log_ratio, config)
    return sequence_mean(token_loss, inputs), metrics


def dr_grpo(inputs: LossInputs, config: LossConfig) -> tuple[torch.Tensor, LossMetrics]:
    """PPO-clip per token, summed / (step_num_sequences * constant_normalizer): neither long nor
    short answers are re-weighted; with mean_only advantages by default (Dr. GRPO)."""
    token_loss, metrics = clipped_token_loss(inputs, inputs.log_ratio, config)
    return constant_normalized(token_loss, inputs, config.constant_normalizer), metrics


def dapo(inputs: LossInputs, config: LossConfig) -> tuple[torch.Tensor, LossMetrics]:
    """PPO-clip per token with a raised upper clip, mean over all the step's trained tokens."""
    token_loss, metrics = clipped_token_loss(inputs, inputs.log_ratio, config)
    return token_mean(token_loss, inputs), metrics


def gspo(inputs: LossInputs, config: LossConfig) -> tuple[torch.Tensor, LossMetrics]:
    """PPO-clip on each sequence's length-normalized ratio s_i (GSPO-token), normalized as grpo."""
    sequence_log_ratio = segment_mean(inputs.log_ratio.detach(), inputs.sequence, inputs.num_sequences)
    log_ratio = sequence_log_ratio[inputs.sequence] + inputs.logprobs - inputs.logprobs.detach()
    token_loss, metrics = clipped_token_loss(inputs, log_ratio, config)
    return sequence_mean(token_loss, inputs), metrics


def sft(inputs: LossInputs, config: LossConfig) -> tuple[torch.Tensor, LossMetrics]:
    """Supervised fine-tuning on a demonstration: NLL_t = -logp_t, summed / step_num_tokens (the
    token mean over the step's sft tokens). Reads neither sampler logprobs nor advantages."""
    nll = -inputs.logprobs
    return token_mean(nll, inputs), {"nll": nll.detach().mean()}


def dpo(inputs: LossInputs, config: LossConfig) -> tuple[torch.Tensor, LossMetrics]:
    """Preference pairs (DPO, or IPO with loss.dpo_variant=ipo), summed / the step's pairs.

    The sequences come as pairs in order, the chosen first: advantages +1 on the chosen's tokens,
    -1 on the rejected's (trainer.step.training_sequences). With rho(y) = logp(y) - ref(y) summed
    over a sequence's trained tokens (ipo: their mean, as in the IPO paper and TRL) and
    h = rho(chosen) - rho(rejected):
        dpo  -log sigmoid(beta * h)        ipo  (h - 1 / (2 beta))^2
    Metrics, exact step means over pairs: accuracy (h > 0), reward_margin (beta * h), chosen_reward
    and rejected_reward (beta * rho)."""
    if inputs.ref_logprobs is None:
        raise ValueError(
            "dpo: no reference logprobs; store ref_logprobs in the pair's sequences or let the trainer "
            "hold its reference model (it does whenever a step has dpo groups without them)"
        )
    log_ratio = inputs.logprobs - inputs.ref_logprobs
    if config.dpo_variant == "ipo":
        rho = segment_mean(log_ratio, inputs.sequence, inputs.num_sequences)
    else:
        rho = torch.zeros(inputs.num_sequences, dtype=log_ratio.dtype, device=log_ratio.device).index_add(
            0, inputs.sequence, log_ratio
        )
    sign = torch.zeros(inputs.num_sequences, dtype=log_ratio.dtype, device=log_ratio.device).index_reduce(
        0, inputs.sequence, inputs.advantages, "amax", include_self=False
    )
    if inputs.num_sequences % 2 or not (bool((sign[0::2] == 1).all()) and bool((sign[1::2] == -1).all())):
        raise ValueError(
            "dpo: the sequences are not (chosen, rejected) pairs in order; pack dpo groups with "
            "trainer.step.training_sequences, which keeps each pair together"
        )
    beta = config.dpo_beta
    h = rho[0::2] - rho[1::2]
    losses = (h - 1.0 / (2.0 * beta)) ** 2 if config.dpo_variant == "ipo" else -torch.nn.functional.logsigmoid(beta * h)
    pairs = inputs.step_num_sequences / 2.0
    with torch.no_grad():
        metrics = {
            "accuracy": Total((h > 0).sum().item() / pairs),
            "reward_margin": Total((beta * h).sum().item() / pairs),
            "chosen_reward": Total((beta * rho[0::2]).sum().item() / pairs),
            "rejected_reward": Total((beta * rho[1::2]).sum().item() / pairs),
        }
    return losses.sum() / pairs, metrics


# "Clip-higher" lets low-probability tokens still grow (DAPO); a length-normalized sequence ratio
# sits much closer to 1 than a token's, so GSPO's range is tiny (GSPO paper).
dr_grpo.loss_defaults = LossDefaults(advantage_mode="mean_only")  # type: ignore[attr-defined]
dapo.loss_defaults = LossDefaults(clip_high=0.28)  # type: ignore[attr-defined]
gspo.loss_defaults = LossDefaults(clip_low=3e-4, clip_high=4e-4)  # type: ignore[attr-defined]


# --- the micro-batch plumbing --------------------------------------------------------------------


def _metric_floats(loss: torch.Tensor, metrics: LossMetrics, inputs: LossInputs, name: str) -> dict[str, float]:
    """The loss's metrics as floats, with loss, num_tokens and num_sequences added."""
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(
            f"loss.name {name!r}: returned a loss of {shape}; return a 0-dim tensor, the token "
            "losses reduced (e.g. trainer.losses.sequence_mean) along with a metrics dict"
        )
    if not isinstance(metrics, dict):
        raise ValueError(
            f"loss.name {name!r}: returned {type(metrics).__name__} as metrics; return "
            "(loss, {name: float or 0-dim tensor}), {} when there is nothing to report"
        )
    tensors = [key for key, value in metrics.items() if isinstance(value, torch.Tensor)]
    for key in tensors:
        if metrics[key].numel() != 1:
            raise ValueError(
                f"loss.name {name!r}: metric {key!r} has shape {tuple(metrics[key].shape)}; "
                "reduce it to one value (.mean(), .max())"
            )
    # One transfer for the loss and every tensor metric.
    read = [metrics[key].detach().float().reshape(()) for key in tensors]
    stacked = torch.stack([loss.detach().float(), *read])
    loss_value, *values = stacked.tolist()
    return {
        "loss": Total(loss_value),
        **{key: value for key, value in metrics.items() if key not in tensors},
        **dict(zip(tensors, values, strict=True)),
        "num_tokens": Total(inputs.num_tokens),
        "num_sequences": Total(inputs.num_sequences),
    }


def _check_shapes(logprobs: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs: shape {tuple(logprobs.shape)}; pass [batch, seq] tensors")
    for name, tensor in tensors.items():
        if tensor is not None and tensor.shape != logprobs.shape:
            raise ValueError(
                f"{name}: shape {tuple(tensor.shape)} != logprobs {tuple(logprobs.shape)}; "
                "give every per-token tensor the same [batch, seq] shape"
            )


def _dense_sequence_index(trained: torch.Tensor, sequence_ids: torch.Tensor | None) -> tuple[torch.Tensor, int]:
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
