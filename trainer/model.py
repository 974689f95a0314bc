"""The policy model: load a Hugging Face causal LM and score packed micro-batches with it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from trainer import attention
from trainer.config import LossConfig
from trainer.losses import dpo, policy_loss, sft
from trainer.packing import PackedBatch
from trainer.step import ObjectiveShare

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# The loss of each objective but rl and distill, whose loss is the configured one (LossConfig.name).
OBJECTIVE_LOSSES = {"sft": sft, "dpo": dpo}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_policy(model: str, dtype: str = "float32") -> PreTrainedModel:
    """A causal LM from a directory or hub name, with the trainer's attention (trainer.attention:
    sdpa, or variable-length attention over packed rows).

    Weights load in `dtype`; under bf16 DeepSpeed keeps its own fp32 master copy.
    """
    from transformers import AutoModelForCausalLM

    attention.register()
    return AutoModelForCausalLM.from_pretrained(model, dtype=DTYPES[dtype], attn_implementation=attention.NAME)


# The most fp32 logits one chunk of positions materialises (hidden_logprobs): 64 MiB is 110 positions
# at Qwen's 151,936-entry vocabulary and the whole micro-batch at the small models' 512.
LOGIT_CHUNK_BYTES = 64 * 2**20
# What the decoder's forward returns logits for: none (the LM head runs per chunk instead).
NO_LOGITS = torch.empty(0, dtype=torch.long)


# Gradient checkpointing's default (TrainerConfig.gradient_checkpointing None) turns it on past this.
ACTIVATION_BUDGET_BYTES = 2 * 2**30


def activation_bytes(config: Any, tokens: int, element_bytes: int = 4) -> int:
    """About what a decoder keeps for the backward pass of `tokens` tokens without checkpointing:
    per layer and token, ~10 hidden-sized tensors (norms, q/k/v/o, residuals) and ~4 of the MLP's
    intermediate size (gate, up, their product, the activation). Measured at the qwen2.5-0.5b shape
    at 8192 tokens: past 15 GB without checkpointing; this says 22 GB, a bound, not a forecast."""
    per_token = 10 * config.hidden_size + 4 * config.intermediate_size
    return tokens * config.num_hidden_layers * per_token * element_bytes


def wants_gradient_checkpointing(config: Any, tokens: int) -> bool:
    """The default: on when a micro-batch's activations would pass ACTIVATION_BUDGET_BYTES."""
    return activation_bytes(config, tokens) > ACTIVATION_BUDGET_BYTES


def enable_gradient_checkpointing(model: PreTrainedModel) -> None:
    """Recompute each decoder layer in the backward pass (transformers' gradient checkpointing,
    non-reentrant), keeping the model in eval mode otherwise.

    transformers checkpoints a layer only while that layer is in training mode, so the layers' own
    flag is set and nothing else's: dropout and every other submodule stay as load_policy left
    them (eval: the trainer's logprobs equal the sampler's for the same weights).
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"gradient_checkpointing: {type(model).__name__} does not support it in transformers; set it false"
        )
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    for module in model.modules():
        if isinstance(module, GradientCheckpointingLayer):
            module.training = True


def _picked_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float | torch.Tensor, entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log_softmax(logits / temperature)[targets] and, with `entropy`, the entropy of that
    distribution (no gradient; else None), in fp32 or wider: logits [..., vocab], targets and a
    tensor temperature [...]."""
    if isinstance(temperature, torch.Tensor):
        temperature = temperature[..., None]
    scaled = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    normalizer = torch.logsumexp(scaled, dim=-1)
    picked = scaled.gather(-1, targets[..., None]).squeeze(-1) - normalizer
    if not entropy:
        return picked, None
    with torch.no_grad():
        return picked, normalizer - (scaled.softmax(-1) * scaled).sum(-1)


def _predictions(
    input_ids: torch.Tensor, temperature: float | torch.Tensor, predictors: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, float | torch.Tensor]:
    """For tokens 1.. of each row: the position whose logits predict it [batch, seq - 1], the token
    itself, and the temperature at that position (a float stays a float)."""
    batch, length = input_ids.shape
    if predictors is None:
        by = torch.arange(length - 1, device=input_ids.device).expand(batch, -1)
    else:
        by = predictors[:, 1:].to(input_ids.device)
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.to(input_ids.device).gather(1, by)
    return by, input_ids[:, 1:], temperature


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

    This takes the whole [batch, seq, vocab] logits; the trainer scores from the hidden states in
    chunks instead (hidden_logprobs), which never holds them all.
    """
    if logits.shape[:2] != input_ids.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and input_ids {tuple(input_ids.shape)}: the first two "
            "dimensions must match; pass the model's logits for exactly these input_ids"
        )
    by, targets, temperature = _predictions(input_ids, temperature, predictors)
    rows = torch.arange(logits.shape[0], device=logits.device)[:, None]
    predicted, _ = _picked_logprobs(logits[rows, by], targets, temperature, entropy=False)
    return torch.nn.functional.pad(predicted, (1, 0), value=0.0)


def hidden_logprobs(
    hidden: torch.Tensor,
    head: torch.nn.Linear,
    input_ids: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    predictors: torch.Tensor | None = None,
    chunk_bytes: int = LOGIT_CHUNK_BYTES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """token_logprobs from the LM head's input, [batch, seq] each: the logprobs (with gradient) and
    each position's entropy at its temperature (without; 0 at position 0, like the logprobs).

    hidden [batch, seq, hidden] is what `head` (the LM head) reads. The logits are made a chunk of
    positions at a time, at most `chunk_bytes` of fp32 logits each, and under grad each chunk is
    checkpointed: its backward makes them again instead of keeping them, so neither pass holds
    [positions, vocab] beyond one chunk (chunked log-probs, as prime-rl's and verl's). Logits that
    fit in one chunk are made once and kept, as a plain forward would.
    """
    by, targets, temperature = _predictions(input_ids, temperature, predictors)
    features = hidden.gather(1, by[..., None].expand(-1, -1, hidden.shape[-1])).flatten(0, 1)
    targets = targets.flatten()
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.flatten()
    vocab = getattr(head, "out_features", None) or head.weight.shape[0]
    chunk = max(1, chunk_bytes // (4 * vocab))

    def score(features: torch.Tensor, targets: torch.Tensor, temperature: float | torch.Tensor):
        return _picked_logprobs(head(features), targets, temperature)

    logprobs, entropies = [], []
    for start in range(0, len(targets), chunk) or [0]:  # one empty chunk keeps the graph connected
        part = slice(start, start + chunk)
        inputs = (
            features[part],
            targets[part],
            temperature[part] if isinstance(temperature, torch.Tensor) else temperature,
        )
        if torch.is_grad_enabled() and features.requires_grad and len(targets) > chunk:
            picked, entropy = torch.utils.checkpoint.checkpoint(score, *inputs, use_reentrant=False)
        else:
            picked, entropy = score(*inputs)
        logprobs.append(picked)
        entropies.append(entropy)
    shape = input_ids.shape[0], input_ids.shape[1] - 1
    logprob, entropy = (
        torch.nn.functional.pad(torch.cat(parts).view(shape), (1, 0), value=0.0) for parts in (logprobs, entropies)
    )
    return logprob, entropy


def packed_logprobs(
    model: torch.nn.Module,
    batch: PackedBatch,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob of every token of a packed micro-batch under `model`, each sequence at its
    temperature (batch.temperatures), and each position's entropy: [rows, L] float32 each (see
    token_logprobs, hidden_logprobs).

    Sequences are kept apart by restarting position_ids and (trainer.attention) by their boundaries
    for variable-length attention, or by the block-diagonal boolean mask [rows, 1, L, L] where a
    sequence continues a shared prefix (PackedBatch.needs_mask). Rows of one sequence each
    with plain causal attention need neither (sdpa's causal kernel). The model runs without its LM
    head; hidden_logprobs applies it in chunks.
    """
    input_ids = batch.input_ids.to(device)
    temperature = 1.0 if batch.temperatures is None else batch.temperatures
    inputs = dict(input_ids=input_ids, use_cache=False, logits_to_keep=NO_LOGITS, output_hidden_states=True)
    predictors = None
    if batch.needs_mask():
        inputs.update(position_ids=batch.position_ids.to(device), attention_mask=batch.attention_mask().to(device))
        predictors = batch.predictors.to(device) if batch.predictors is not None else None
    elif batch.shares_rows():
        bounds, longest = batch.sequence_bounds()
        inputs.update(
            position_ids=batch.position_ids.to(device),
            cu_seq_lens_q=bounds,
            cu_seq_lens_k=bounds,
            max_length_q=longest,
            max_length_k=longest,
        )
    hidden = model(**inputs).hidden_states[-1]
    policy: Any = getattr(model, "module", model)  # a DeepSpeed engine holds the model as .module
    head = policy.get_output_embeddings()
    return hidden_logprobs(hidden, head, input_ids, temperature, predictors=predictors)


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
    logprobs, entropy = packed_logprobs(model, batch, device=device)
    ref_logprobs = batch.stored_ref_logprobs.to(device) if batch.stored_ref_logprobs is not None else None
    if batch.needs_reference(kl=config.kl_coef > 0):
        if reference is None:
            raise ValueError(
                "reference: this micro-batch has dpo tokens (or a KL penalty) without stored ref_logprobs "
                "and no reference model was given; pass the frozen reference (trainer.train loads it)"
            )
        with torch.no_grad():
            computed, _ = packed_logprobs(reference, batch, device=device)
        if ref_logprobs is None:
            ref_logprobs = computed
        elif batch.has_stored_ref is not None:  # some sequences stored theirs: the rest computed
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
        trained = batch.objective_mask(objective).to(device)
        if trained.any():  # a token-weighted mean over the step (trainer.metrics)
            metrics[objective]["entropy"] = entropy[trained].mean().item()
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
        sequence_objectives=[],
    )


def rank_micro_batches(batches: Sequence[PackedBatch], rank: int, world_size: int) -> list[PackedBatch]:
    """This rank's share of a step's micro-batches: every world_size-th one, then idle ones so
    every rank runs ceil(len(batches) / world_size) of them."""
    mine = list(batches[rank::world_size])
    per_rank = -(-len(batches) // world_size)
    return mine + [idle_micro_batch() for _ in range(per_rank - len(mine))]
