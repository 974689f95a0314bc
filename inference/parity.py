"""Logprob parity between a served policy and a transformers forward pass of the same weights."""

from __future__ import annotations

import json
from pathlib import Path

# A checkpoint's own logprobs of fixed token sequences, written beside its weights by the trainer
# that computed them (trainer.checkpointing.publish_step): a server that loaded those weights must
# give the same, so checking it needs no second copy of the model (ParityGuard.measure).
PARITY_REFERENCE = "parity.json"
PARITY_REFERENCE_FORMAT = 1


def reference_logprobs(model_or_dir, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
    """Logprob of each completion token given everything before it, by a transformers forward pass."""
    import torch

    model = load_reference_model(model_or_dir) if isinstance(model_or_dir, (str, Path)) else model_or_dir
    ids = torch.tensor([list(prompt_ids) + list(completion_ids)])
    with torch.no_grad():
        logits = model(ids).logits.float()
    # Token t is predicted by the logits at t - 1.
    logprobs = torch.log_softmax(logits[0, :-1], dim=-1)
    targets = ids[0, 1:]
    picked = logprobs.gather(-1, targets[:, None])[:, 0]
    return picked[len(prompt_ids) - 1 :].tolist()


def load_reference_model(model_dir: str | Path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def max_abs_difference(a: list[float], b: list[float]) -> float:
    if len(a) != len(b):
        raise ValueError(f"length mismatch: {len(a)} served logprobs vs {len(b)} reference")
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


def write_parity_reference(model, sequences: list[list[int]], out_dir: str | Path) -> None:
    """`model`'s logprob of every token of each sequence after its first, teacher-forced in one
    forward pass each (float32 weights: the reference is float32), to out_dir/PARITY_REFERENCE."""
    import torch

    if any(parameter.dtype != torch.float32 for parameter in model.parameters()):
        raise ValueError("a parity reference is computed in float32; this model's weights are not")
    was_training = model.training
    model.eval()
    try:
        logprobs = [reference_logprobs(model, sequence[:1], sequence[1:]) for sequence in sequences]
    finally:
        model.train(was_training)
    reference = {"format": PARITY_REFERENCE_FORMAT, "sequences": sequences, "logprobs": logprobs}
    (Path(out_dir) / PARITY_REFERENCE).write_text(json.dumps(reference))


def read_parity_reference(checkpoint_dir: str | Path) -> tuple[list[list[int]], list[list[float]]] | None:
    """(sequences, logprobs) stored with a checkpoint, or None when it has none (an outside model,
    a checkpoint older than the file, or one trained in another dtype or sharded with ZeRO-3)."""
    path = Path(checkpoint_dir) / PARITY_REFERENCE
    if not path.exists():
        return None
    return parse_parity_reference(path.read_text(), str(path))


def parse_parity_reference(text: str, where: str) -> tuple[list[list[int]], list[list[float]]]:
    """(sequences, logprobs) from a parity reference's text, read from `where`."""
    reference = json.loads(text)
    if reference.get("format") != PARITY_REFERENCE_FORMAT:
        raise ValueError(f"{where}: parity reference format {reference.get('format')!r}, expected {PARITY_REFERENCE_FORMAT}")
    return reference["sequences"], reference["logprobs"]
