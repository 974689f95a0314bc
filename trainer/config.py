"""Trainer configuration: described pydantic models, loaded from YAML plus key=value overrides."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

# Clip ranges each loss is usually run with, applied when the config does not set them.
# DAPO raises the upper clip ("clip-higher") so low-probability tokens can still grow; GSPO clips a
# length-normalized sequence ratio, which sits much closer to 1, so its range is tiny (GSPO paper).
_DEFAULT_CLIPS = {
    "grpo": (0.2, 0.2),
    "dr_grpo": (0.2, 0.2),
    "dapo": (0.2, 0.28),
    "gspo": (3e-4, 4e-4),
}


class LossConfig(BaseModel):
    """Which policy loss to optimize and its clip, importance-weight and KL settings."""

    model_config = ConfigDict(extra="forbid")

    name: Literal["grpo", "dr_grpo", "dapo", "gspo"] = Field(
        default="grpo",
        description=(
            "grpo: PPO-clip per token, mean over each sequence then over sequences. "
            "dapo: same clip (asymmetric by default), mean over all trained tokens of the step. "
            "dr_grpo: per-token sums divided by a constant (constant_normalizer per sequence), so "
            "neither long nor short answers are re-weighted. gspo: one clipped ratio per sequence."
        ),
    )
    clip_low: float = Field(
        default=0.2,
        ge=0.0,
        lt=1.0,
        description="Ratios below 1 - clip_low stop pushing a token down. Default: 3e-4 for gspo.",
    )
    clip_high: float = Field(
        default=0.2,
        ge=0.0,
        description="Ratios above 1 + clip_high stop pushing a token up. Default: 0.28 for dapo, "
        "4e-4 for gspo, else 0.2.",
    )
    importance_cap: float | None = Field(
        default=2.0,
        description=(
            "Truncated importance sampling: the weight pi/mu of a token's gradient (mu: the "
            "sampler's probability) never exceeds this. PPO clipping leaves it unbounded only "
            "for negative advantages, where a stale or mismatched sampler can otherwise blow up "
            "the step. Must be >= 1 + clip_high; null disables."
        ),
    )
    kl_coef: float = Field(
        default=0.0,
        ge=0.0,
        description="Weight of the KL penalty to a frozen reference model; 0 turns it off.",
    )
    constant_normalizer: int = Field(
        default=1024,
        gt=0,
        description="dr_grpo only: each sequence's token sum is divided by this constant (the "
        "generation budget in the Dr. GRPO paper) instead of its length. It only scales the step.",
    )

    @model_validator(mode="after")
    def _per_loss_defaults(self) -> LossConfig:
        low, high = _DEFAULT_CLIPS[self.name]
        if "clip_low" not in self.model_fields_set:
            self.clip_low = low
        if "clip_high" not in self.model_fields_set:
            self.clip_high = high
        if self.importance_cap is not None and self.importance_cap < 1.0 + self.clip_high:
            raise ValueError(
                f"importance_cap: {self.importance_cap} < 1 + clip_high ({1.0 + self.clip_high}); "
                "a cap inside the clip range would undo the clip; raise it (2.0 is usual) or "
                "use null"
            )
        return self


class AdvantageConfig(BaseModel):
    """How a group's scores become advantages."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["grpo", "mean_only"] = Field(
        default="grpo",
        description="grpo: (score - group mean) / (group std + eps). mean_only: score - group mean "
        "(Dr. GRPO; no up-weighting of groups whose scores barely differ). Defaults to mean_only "
        "when loss.name is dr_grpo.",
    )
    eps: float = Field(default=1e-6, gt=0.0, description="Added to the std so equal scores give 0.")


class TrainerConfig(BaseModel):
    """Everything one training run needs besides the data: model, optimizer, batching, loss."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(
        description="Hugging Face model directory or hub name of the initial policy."
    )
    steps: int = Field(default=100, gt=0, description="Optimizer steps to run.")
    groups_per_step: int = Field(
        default=8, gt=0, description="Whole groups consumed by one optimizer step."
    )
    micro_batch_tokens: int = Field(
        default=4096,
        gt=0,
        description=(
            "Token budget of one packed micro-batch; every sequence must fit. A step's groups are "
            "packed into as many micro-batches as they need; gradients accumulate over all of them."
        ),
    )
    lr: float = Field(default=1e-6, gt=0.0, description="AdamW learning rate.")
    grad_clip: float | None = Field(
        default=1.0, gt=0.0, description="Clip the global gradient norm to this; null disables."
    )
    max_staleness: int = Field(
        default=1,
        ge=0,
        description="Skip (and count) groups sampled more than this many policy versions ago; "
        "0 trains strictly on-policy.",
    )
    zero_stage: Literal[0, 1, 2, 3] = Field(
        default=0, description="DeepSpeed ZeRO stage: 0 replicates everything, 3 shards parameters."
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        default="float32", description="Training precision; bfloat16 on GPUs, float32 on CPU."
    )
    save_every: int = Field(
        default=10, gt=0, description="Publish a checkpoint every this many steps."
    )
    seed: int = Field(default=0, description="Seeds torch and the data order.")
    loss: LossConfig = Field(default_factory=LossConfig)
    advantages: AdvantageConfig = Field(default_factory=AdvantageConfig)

    @model_validator(mode="after")
    def _dr_grpo_advantages(self) -> TrainerConfig:
        # Dr. GRPO drops both the length and the std normalization; follow it unless told not to.
        if self.loss.name == "dr_grpo" and "mode" not in self.advantages.model_fields_set:
            self.advantages.mode = "mean_only"
        return self

    @classmethod
    def from_yaml(
        cls, path: str | Path | None = None, overrides: Sequence[str] = ()
    ) -> TrainerConfig:
        """Load a YAML file (or start empty) and apply CLI-style `a.b=value` overrides on top."""
        data: dict[str, Any] = {}
        if path is not None:
            loaded = yaml.safe_load(Path(path).read_text())
            if loaded is not None and not isinstance(loaded, dict):
                raise ValueError(
                    f"{path}: top level is {type(loaded).__name__}; write a mapping of fields"
                )
            data = loaded or {}
        return cls.model_validate(apply_overrides(data, overrides))


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of `data` with each `dotted.key=value` set; values are YAML (1e-6, true, null)."""
    result = _deep_copy(data)
    for override in overrides:
        key, separator, raw = override.partition("=")
        if not separator or not key.strip():
            raise ValueError(f"override {override!r}: write it as key=value, e.g. loss.name=dapo")
        parts = key.strip().split(".")
        node = result
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                where = ".".join(parts[: depth + 1])
                raise ValueError(f"override {override!r}: {where} is a value, not a section")
            node = child
        node[parts[-1]] = yaml.safe_load(raw)
    return result


def _deep_copy(data: dict[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in data.items()}
