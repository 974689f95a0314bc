"""Logprob parity between a served policy and a transformers forward pass of the same weights."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

# A checkpoint's own logprobs of fixed token sequences, written beside its weights by the trainer
# that computed them (trainer.publishing.publish_step): a server that loaded those weights must
# give the same, so checking it needs no second copy of the model (ParityGuard.measure).
PARITY_REFERENCE = "parity.json"
PARITY_REFERENCE_FORMAT = 2  # 2: a bf16 publish's logprobs computed in bf16 (in_dtype), not fp32 on rounded weights


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


@contextmanager
def in_dtype(model, dtype):
    """`model`'s forward passes computed as a server of its weights published in `dtype` (bf16)
    computes them: under autocast to `dtype` (each matmul's weights, bias and input rounded to it),
    with the embedding's rows and every other parameter (the norms') rounded to it too. So its
    logprobs are those of the weights as published, though the model holds fp32 parameters that
    moved by less than the rounding; and no rounded copy of the model is made (at the 0.5B shape
    0.37-0.59 s, against 0.89-1.1 s for an fp32 forward on each module's weights rounded and upcast).
    None or float32: the model as it is."""
    import torch

    if dtype is None or dtype == torch.float32:
        yield
        return
    handles = []
    for module in model.modules():
        own = list(module.parameters(recurse=False))
        if not own or isinstance(module, torch.nn.Linear):  # autocast rounds what a matmul reads
            continue
        if isinstance(module, torch.nn.Embedding):
            # The rows looked up, rounded: the same as looking them up in the rounded table, for a
            # few rows instead of the whole table (545 MB in fp32 at the 0.5B shape).
            handles.append(module.register_forward_hook(lambda module, args, output: output.to(dtype).to(output.dtype)))
            continue
        saved: list = []

        def swap(module, args, own=own, saved=saved) -> None:
            for parameter in own:
                saved.append((parameter, parameter.data))
                parameter.data = parameter.data.to(dtype).to(parameter.dtype)

        def restore(module, args, output, saved=saved) -> None:
            while saved:
                parameter, data = saved.pop()
                parameter.data = data

        handles += [module.register_forward_pre_hook(swap), module.register_forward_hook(restore, always_call=True)]
    try:
        # Without autocast's cache, which would hold every matmul's rounded weights until the end
        # (a second copy of the model in `dtype`).
        with torch.autocast(next(model.parameters()).device.type, dtype=dtype, cache_enabled=False):
            yield
    finally:
        for handle in handles:
            handle.remove()


def model_logprobs(model, sequences: list[list[int]], dtype=None) -> list[list[float]]:
    """`model`'s logprob of every token of each sequence after its first, teacher-forced in one
    forward pass of them all, in eval mode, computed as its weights published in `dtype` would be
    (in_dtype; None: as the model is)."""
    import torch

    # Each module's own flag comes back: a trainer's decoder layers train (gradient checkpointing)
    # inside a model in eval mode, which model.train(model.training) would undo.
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    # One forward of the sequences right-padded (a token never attends to the padding after it): a
    # forward of a big model costs its weights' reads more than its few tokens.
    longest = max(len(sequence) for sequence in sequences)
    ids = torch.tensor([list(sequence) + [0] * (longest - len(sequence)) for sequence in sequences])
    try:
        with in_dtype(model, dtype), torch.no_grad():
            logits = model(ids).logits.float()
    finally:
        for module, mode in modes:
            module.training = mode
    picked = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    return [picked[row, : len(sequence) - 1].tolist() for row, sequence in enumerate(sequences)]


def write_parity_reference(model, sequences: list[list[int]], out_dir: str | Path, dtype=None) -> None:
    """`model_logprobs` of each sequence, its fp32 weights computed as published in `dtype` (None:
    as they are), to out_dir/PARITY_REFERENCE. A server must give the logprobs of what it loaded,
    and an fp32 trainer's small steps mostly vanish in the rounding (at lr 1e-6 a 0.5B model's fp32
    logprobs move ~0.1 a step while its bf16 weights barely change)."""
    import torch

    if any(parameter.dtype != torch.float32 for parameter in model.parameters()):
        raise ValueError("a parity reference is computed from float32 weights; this model's are not")
    logprobs = model_logprobs(model, sequences, dtype)
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
        raise ValueError(
            f"{where}: parity reference format {reference.get('format')!r}, expected {PARITY_REFERENCE_FORMAT}"
        )
    return reference["sequences"], reference["logprobs"]
