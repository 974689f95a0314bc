"""Reload test helpers: checkpoints with noise, a dropped tensor or an edited config; what a server serves."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from inference.parity import PARITY_REFERENCE, max_abs_difference, reference_logprobs
from inference.reload import ServedPolicy

PROBE = [17, 101, 23, 250, 7, 64, 9]  # not one of the guard's prompts: checks what every client sees


def perturbed_checkpoint(
    base_dir: Path,
    out_dir: Path,
    *,
    seed: int,
    scale: float = 0.02,
    drop: tuple[str, ...] = (),
    config_changes: dict | None = None,
) -> Path:
    """A copy of base_dir whose every tensor has Gaussian noise added, as save_pretrained would write it
    (a tied model's copy has no lm_head.weight, like transformers' own)."""
    import torch
    from safetensors.torch import load_file, save_file

    # base may be a published step; its parity reference is its own weights', not these
    shutil.copytree(base_dir, out_dir, ignore=shutil.ignore_patterns("STABLE", PARITY_REFERENCE))
    tensors = load_file(base_dir / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    noisy = {
        name: t + scale * torch.randn(t.shape, generator=generator) for name, t in tensors.items() if name not in drop
    }
    save_file(noisy, out_dir / "model.safetensors", metadata={"format": "pt"})
    if config_changes:
        config = json.loads((out_dir / "config.json").read_text())
        (out_dir / "config.json").write_text(json.dumps({**config, **config_changes}, indent=2))
    return out_dir


async def served_matches(policy: ServedPolicy, checkpoint_dir, prompt=PROBE, max_tokens=16) -> float:
    """Largest |served - transformers| logprob over a greedy completion of `prompt`."""
    async with policy.client() as client:
        [completion] = await client.complete(prompt, max_tokens=max_tokens, temperature=0.0)
    return max_abs_difference(completion.logprobs, reference_logprobs(checkpoint_dir, prompt, completion.token_ids))


async def is_paused(policy: ServedPolicy) -> bool:
    async with policy.client() as client:
        return (await client.request("GET", "/is_paused")).json()["is_paused"]


async def announced(policy: ServedPolicy) -> int:
    async with policy.client() as client:
        return await client.weight_version()


def next_step(policy: ServedPolicy) -> int:
    """A version this server has neither served nor rejected (tests share the server, not the run)."""
    return max([policy.version, *policy.rejected]) + 1
