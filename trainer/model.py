"""The policy model: load a Hugging Face causal LM and score packed micro-batches with it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from trainer.config import LossConfig
from trainer.losses import dpo, policy_loss, sft
from trainer.packing import DEFAULT_HOOKS, AttentionMaskHook, PackedBatch
from trainer.step import ObjectiveShare

# The loss of each objective but rl and distill, whose loss is the configured one (LossConfig.name).
OBJECTIVE_LOSSES = {"sft": sft, "dpo": dpo}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_policy(model: str, dtype: str = "float32") -> torch.nn.Module:
    """A causal LM from a directory or hub name, with sdpa attention (it takes the packed 4D mask).

    Weights load in `dtype`; under bf16 DeepSpeed keeps its own fp32 master copy.
    """
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        model, dtype=DTYPES[dtype], attn_implementation="sdpa"
    )


def token_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    predictors: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logprob of each input token under the logits that predict it, at a temperature.

    logits [batch, seq, vocab], input_ids [batch, seq] -> [batch, seq], float32 or wider;
    temperature a float or [batch, seq], the temperature of each position's logits.

    Next-token prediction: token t is predicted by the logits at position t - 1, so
    result[:, t] = log_softmax(logits[:, t - 1] / temperature[:, t - 1])[input_ids[:, t]],
    result[:, 0] = 0. The first token of a sequence has no prediction and is never trained; in
    packed rows the first token of each later sequence gets a meaningless value (its "prediction"
    comes from the previous sequence) and packing masks it out. `temperature` must be the one the
    sampler's logprobs are at (PackedBatch.temperatures). `predictors` [batch, seq]
    (PackedBatch.predictors, with shared prefixes) names the position whose logits predict each
    token instead: result[:, t] = log_softmax(logits[:, predictors[:, t]])[input_ids[:, t]] for t >= 1.
    """
    if logits.shape[:2] != input_ids.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and input_ids {tuple(input_ids.shape)}: the first two "
            "dimensions must match; pass the model's logits for exactly these input_ids"
        )
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.to(logits.device)[..., None]
    if predictors is not None:
        scaled = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
        by = predictors[:, 1:]
        rows = torch.arange(logits.shape[0], device=logits.device)[:, None]
        predicted = scaled[rows, by, input_ids[:, 1:]] - torch.logsumexp(scaled, dim=-1).gather(1, by)
        return torch.nn.functional.pad(predicted, (1, 0), value=0.0)
    if isinstance(temperature, torch.Tensor):
        temperature = temperature[:, :-1]
    scaled = logits[:, :-1].to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    picked = scaled.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    predicted = picked - torch.logsumexp(scaled, dim=-1)
    return torch.nn.functional.pad(predicted, (1, 0), value=0.0)


def packed_logprobs(
    model: torch.nn.Module,
    batch: PackedBatch,
    hooks: Sequence[AttentionMaskHook] = DEFAULT_HOOKS,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Logprob of every token of a packed micro-batch under `model`, each sequence at its
    temperature (batch.temperatures): [rows, L] float32 (see token_logprobs).

    Sequences are kept apart by restarting position_ids and by the block-diagonal boolean mask
    [rows, 1, L, L] (hooks applied per sequence); transformers passes a 4D mask to sdpa as it is.
    Rows of one sequence each with plain causal attention run with neither (PackedBatch.needs_mask).
    """
    input_ids = batch.input_ids.to(device)
    temperature = 1.0 if batch.temperatures is None else batch.temperatures
    if not batch.needs_mask(hooks):  # one sequence a row, plain causal: sdpa's causal kernel
        return token_logprobs(model(input_ids=input_ids, use_cache=False).logits, input_ids, temperature)
    output = model(
        input_ids=input_ids,
        position_ids=batch.position_ids.to(device),
        attention_mask=batch.attention_mask(hooks).to(device),
        use_cache=False,
    )
    predictors = batch.predictors.to(device) if batch.predictors is not None else None
    return token_logprobs(output.logits, input_ids, temperature, predictors=predictors)


def micro_batch_loss(
    model: torch.nn.Module,
    batch: PackedBatch,
    config: LossConfig,
    *,
    objectives: Mapping[str, ObjectiveShare],
    world_size: int = 1,
    reference: torch.nn.Module | None = None,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, dict[str, dict[str, float]]]:
    """The loss of one packed micro-batch as a share of its step's loss, and each objective's
    metrics: {objective: metrics} for the objectives it holds.

    One forward pass; each objective's loss (rl: the configured policy loss) runs on its own
    sequences' trained tokens, divides by that objective's step counts over `world_size` (the
    step's `objectives`, from build_step) and is weighted by its share of the step's groups.
    `reference` is the frozen model that scores what has no stored reference logprobs: every
    token for the KL penalty (config.kl_coef > 0), dpo tokens (batch.needs_reference says when).
    """
    logprobs = packed_logprobs(model, batch, device=device)
    ref_logprobs = batch.stored_ref_logprobs.to(device) if batch.stored_ref_logprobs is not None else None
    if batch.needs_reference(kl=config.kl_coef > 0):
        if reference is None:
            raise ValueError(
                "reference: this micro-batch has dpo tokens (or a KL penalty) without stored ref_logprobs "
                "and no reference model was given; pass the frozen reference (trainer.train loads it)"
            )
        with torch.no_grad():
            computed = packed_logprobs(reference, batch, device=device)
        if ref_logprobs is None:
            ref_logprobs = computed
        else:
            ref_logprobs = torch.where(batch.has_stored_ref.to(device), ref_logprobs, computed)
    # Connected to the graph even with nothing to train, so every rank runs the same backward.
    total = logprobs.sum() * 0.0
    metrics = {}
    old_logprobs, advantages = batch.old_logprobs.to(device), batch.advantages.to(device)
    sequence_ids = batch.sequence_ids.to(device)
    for objective in batch.objectives:
        share = objectives[objective]
        loss, metrics[objective] = policy_loss(
            logprobs,
            old_logprobs,
            advantages,
            batch.objective_mask(objective).to(device),
            config,
            sequence_ids=sequence_ids,
            ref_logprobs=ref_logprobs,
            step_num_sequences=share.num_sequences / world_size,
            step_num_tokens=share.num_trained_tokens / world_size,
            function=OBJECTIVE_LOSSES.get(objective),
        )
        total = total + share.weight * loss
    return total, metrics


def gradient_norm(module: torch.nn.Module) -> float:
    """The L2 norm of all of `module`'s gradients together (0.0 when it has none)."""
    norms = [p.grad.detach().float().norm() for p in module.parameters() if p.grad is not None]
    return torch.stack(norms).norm().item() if norms else 0.0


def idle_micro_batch() -> PackedBatch:
    """A one-slot micro-batch with nothing to train: its loss is 0 with a zero gradient.

    Data-parallel ranks must run the same number of forward and backward passes (ZeRO gathers and
    reductions are collective), so a rank with fewer micro-batches than the others runs these.
    """
    return PackedBatch(
        input_ids=torch.zeros(1, 1, dtype=torch.long),
        position_ids=torch.zeros(1, 1, dtype=torch.long),
        sequence_ids=torch.full((1, 1), -1, dtype=torch.long),
        mask=torch.zeros(1, 1, dtype=torch.bool),
        old_logprobs=torch.zeros(1, 1),
        advantages=torch.zeros(1, 1),
        sequence_lengths=[],
        sequence_extras=[],
        sequence_objectives=[],
    )


def rank_micro_batches(
    batches: Sequence[PackedBatch], rank: int, world_size: int
) -> list[PackedBatch]:
    """This rank's share of a step's micro-batches: every world_size-th one, then idle ones so
    every rank runs ceil(len(batches) / world_size) of them."""
    mine = list(batches[rank::world_size])
    per_rank = -(-len(batches) // world_size)
    return mine + [idle_micro_batch() for _ in range(per_rank - len(mine))]
