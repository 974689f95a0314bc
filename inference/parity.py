"""Logprob parity between a served policy and a transformers forward pass of the same weights."""

from __future__ import annotations

import json
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path

# A checkpoint's own logprobs of fixed token sequences, written beside its weights by the trainer
# that computed them (trainer.publishing.publish_step): a server that loaded those weights must
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


@contextmanager
def running_on(model, weights: Mapping | None):
    """`model`'s forward passes run on `weights` (name -> tensor, the state dict's names: the weights
    as published, e.g. rounded to bf16) instead of its own parameters, upcast to their dtype. Each
    submodule's own parameters are swapped while that submodule runs and restored after it, so the
    copy held is one submodule's, not a second model. Yields the names of the parameters swapped so
    far: a forward that read a parameter outside its module's own forward left it out.
    None: the model as it is."""
    import torch

    swapped: set[str] = set()
    if weights is None:
        yield None
        return
    handles = []
    for prefix, module in model.named_modules():
        own = [
            (f"{prefix}.{name}" if prefix else name, parameter)
            for name, parameter in module.named_parameters(recurse=False)
        ]
        if not own:
            continue
        missing = [name for name, _ in own if name not in weights]
        if missing:
            raise ValueError(f"the published weights have no {missing[0]}")
        if type(module) is torch.nn.Embedding and module.max_norm is None:
            # The rows looked up, upcast, instead of the whole table: an embedding over a real
            # vocabulary is 545 MB in fp32 at the 0.5B shape, faulted in at every publish.
            ((name, parameter),) = own

            def look_up(module, args, output, name=name, parameter=parameter):
                swapped.add(name)
                return torch.nn.functional.embedding(args[0], weights[name]).to(parameter.dtype)

            handles.append(module.register_forward_hook(look_up))
            continue
        saved: list = []

        def swap(module, args, own=own, saved=saved) -> None:
            for name, parameter in own:
                saved.append((parameter, parameter.data))
                parameter.data = weights[name].to(parameter.dtype)
                swapped.add(name)

        def restore(module, args, output, saved=saved) -> None:
            while saved:
                parameter, data = saved.pop()
                parameter.data = data

        handles += [module.register_forward_pre_hook(swap), module.register_forward_hook(restore, always_call=True)]
    try:
        yield swapped
    finally:
        for handle in handles:
            handle.remove()


def model_logprobs(model, sequences: list[list[int]], weights: Mapping | None = None) -> list[list[float]]:
    """`model`'s logprob of every token of each sequence after its first, teacher-forced in one
    forward pass of them all, in eval mode, on `weights` where given (running_on). Raises
    ValueError when a parameter was read outside its module's forward, so the weights given were
    not all used."""
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
        with running_on(model, weights) as swapped, torch.no_grad():
            logits = model(ids).logits.float()
    finally:
        for module, mode in modes:
            module.training = mode
    picked = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    logprobs = [picked[row, : len(sequence) - 1].tolist() for row, sequence in enumerate(sequences)]
    if weights is not None:
        unused = sorted({name for name, _ in model.named_parameters(remove_duplicate=False)} - swapped)
        if unused:
            raise ValueError(f"{type(model).__name__} reads {unused[0]} outside its module's forward")
    return logprobs


def write_parity_reference(
    model, sequences: list[list[int]], out_dir: str | Path, weights: Mapping | None = None
) -> None:
    """`model_logprobs` of each sequence (float32 weights: the reference is float32) to
    out_dir/PARITY_REFERENCE. `weights`: the tensors published, when they are not the model's own
    parameters (rounded to the served dtype): a server must give the logprobs of what it loaded,
    and an fp32 trainer's small steps mostly vanish in the rounding (at lr 1e-6 a 0.5B model's
    fp32 logprobs move ~0.1 a step while its bf16 weights barely change)."""
    import torch

    if any(parameter.dtype != torch.float32 for parameter in model.parameters()):
        raise ValueError("a parity reference is computed in float32; this model's weights are not")
    logprobs = model_logprobs(model, sequences, weights)
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
