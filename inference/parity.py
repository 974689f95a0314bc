"""Logprob parity between a served policy and a transformers forward pass of the same weights."""

from __future__ import annotations

from pathlib import Path


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
