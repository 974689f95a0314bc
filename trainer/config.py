"""Trainer configuration: described pydantic models, loaded from YAML plus key=value overrides."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from core.advantages import AdvantageMode
from core.imports import load_attribute
from core.overrides import apply_overrides
from trainer.trackers import check_report_to

# A Hugging Face hub id: 'name' or 'org/name' (letters, digits, '-', '_', '.').
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?")


def is_hub_id(name: str) -> bool:
    """Whether `name` has the shape of a Hugging Face hub id ('name' or 'org/name'), not of a path."""
    return _HUB_ID.fullmatch(name) is not None


def check_model_source(model: str) -> str:
    """`model` if it is a local model directory (with config.json), a storage URL holding one, or
    could be a hub id; a path that names no model directory raises ValueError saying the fix,
    before anything loads it.
    ('org/name' that is no directory here is taken for a hub id: transformers downloads it.)"""
    from storage.models import check_model_url, is_model_url

    if is_model_url(model):  # fetched by each process that loads it (storage.models.local_model)
        return check_model_url(model)
    path = Path(model).expanduser()
    build = "`clotho model tiny DIR` builds a small one"
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(
                f"{model!r} holds no config.json: not a Hugging Face model directory; point at one ({build})"
            )
        return model
    if path.exists():
        raise ValueError(f"{model!r} is a file; give a Hugging Face model directory ({build}) or a hub id")
    if not is_hub_id(model):
        raise ValueError(
            f"{model!r} does not exist; give a Hugging Face model directory ({build}) or a hub id such as "
            "Qwen/Qwen2.5-0.5B-Instruct"
        )
    return model


# The built-in losses by short name; `loss.name` takes either these or any such import path.
BUILTIN_LOSSES = {
    "grpo": "trainer.losses:grpo",
    "dr_grpo": "trainer.losses:dr_grpo",
    "dapo": "trainer.losses:dapo",
    "gspo": "trainer.losses:gspo",
    # the off-policy corrections by name (trainer.corrections)
    "mis_token": "trainer.corrections:mis_token",
    "mis_sequence": "trainer.corrections:mis_sequence",
    "icepop": "trainer.corrections:icepop",
    "cispo": "trainer.corrections:cispo",
    "dppo": "trainer.corrections:dppo",
}


@dataclass(frozen=True)
class LossDefaults:
    """What a loss runs with where the config leaves it unset. A loss function that needs other
    values than these declares them next to itself: `my_loss.loss_defaults = LossDefaults(...)`."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    advantage_mode: AdvantageMode = "grpo"
    # The settings the loss reads from config.options, with their defaults; a loss that declares
    # any refuses others (a typo would otherwise run with the default unnoticed).
    options: Mapping[str, float] = field(default_factory=dict)


class LossConfig(BaseModel):
    """Which policy loss to optimize and its clip, importance-weight and KL settings."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(
        default="grpo",
        description=(
            "The loss function: a built-in (grpo, dr_grpo, dapo, gspo; see trainer.losses) or the "
            "import path 'package.module:function' of any function with the signature documented "
            "in trainer.losses. The built-in names are short for 'trainer.losses:grpo' and so on."
        ),
    )
    clip_low: float | None = Field(
        default=None,
        ge=0.0,
        lt=1.0,
        description="Ratios below 1 - clip_low stop pushing a token down. null: the loss's "
        "default (0.2; 3e-4 for gspo).",
    )
    clip_high: float | None = Field(
        default=None,
        ge=0.0,
        description="Ratios above 1 + clip_high stop pushing a token up. null: the loss's "
        "default (0.2; 0.28 for dapo, 4e-4 for gspo).",
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
    dpo_beta: float = Field(
        default=0.1,
        gt=0.0,
        description="dpo groups: beta, the strength of the pull towards the reference (the implicit "
        "reward is beta * (logp - ref) summed over a sequence's trained tokens).",
    )
    dpo_variant: Literal["dpo", "ipo"] = Field(
        default="dpo",
        description="dpo groups: dpo, -log sigmoid(beta * h) with h the chosen-minus-rejected log "
        "ratio to the reference (sums over tokens); or ipo, (h - 1 / (2 beta))^2 on per-token means.",
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="A loss's own settings (YAML values), read by it as config.options, over the defaults it "
        "declares (LossDefaults.options): the corrections' thresholds (trainer.corrections), a custom "
        "loss's settings. --set loss.options.high=5 sets one.",
    )

    _function: Callable[..., Any] = PrivateAttr()
    _defaults: LossDefaults = PrivateAttr()

    @model_validator(mode="after")
    def _load_the_loss(self) -> LossConfig:
        self._function = load_loss(self.name)
        self._defaults = loss_defaults(self._function, self.name)
        if self.clip_low is None:
            self.clip_low = self._defaults.clip_low
        if self.clip_high is None:
            self.clip_high = self._defaults.clip_high
        declared = self._defaults.options
        if declared and (unknown := sorted(set(self.options) - set(declared))):
            raise ValueError(
                f"loss.options: {unknown} not settings of loss {self.name}; it takes "
                + ", ".join(f"{key} (default {value})" for key, value in declared.items())
            )
        self.options = {**declared, **self.options}
        if self.importance_cap is not None and self.importance_cap < 1.0 + self.clip_high:
            raise ValueError(
                f"importance_cap: {self.importance_cap} < 1 + clip_high ({1.0 + self.clip_high} "
                f"with loss {self.name}); a cap inside the clip range would undo the clip; raise "
                "it (2.0 is usual) or use null"
            )
        return self

    @property
    def function(self) -> Callable[..., Any]:
        """The loss function `name` names, imported when the config was validated."""
        return self._function

    @property
    def defaults(self) -> LossDefaults:
        """The loss function's declared defaults (LossDefaults() when it declares none)."""
        return self._defaults

    @property
    def clips(self) -> tuple[float, float]:
        """(clip_low, clip_high): null in a config, the loss's defaults once validated."""
        assert self.clip_low is not None and self.clip_high is not None, "validation fills both"
        return self.clip_low, self.clip_high


def load_loss(name: str) -> Callable[..., Any]:
    """The function a `loss.name` names: a built-in's short name or 'package.module:function'."""
    path = BUILTIN_LOSSES.get(name, name)
    if ":" not in path:
        raise ValueError(
            f"loss.name: {name!r} is neither a built-in loss ({', '.join(BUILTIN_LOSSES)}) nor an "
            "import path; write one of those or 'package.module:function'"
        )
    function = load_attribute(path, "loss.name")
    if not callable(function):
        raise ValueError(
            f"loss.name: {name!r}: {path.rpartition(':')[2]} is not a function but of type "
            f"{type(function).__name__}; "
            "point at a function (inputs: LossInputs, config: LossConfig) -> (loss, metrics)"
        )
    return function


def loss_defaults(function: Callable[..., Any], name: str) -> LossDefaults:
    """The `loss_defaults` a loss function declares, LossDefaults() when it declares none."""
    defaults = getattr(function, "loss_defaults", LossDefaults())
    if not isinstance(defaults, LossDefaults):
        raise ValueError(
            f"loss.name: {name!r}: its loss_defaults is of type {type(defaults).__name__}; set "
            "it to trainer.config.LossDefaults(...)"
        )
    return defaults


class AdvantageConfig(BaseModel):
    """How a group's scores become advantages."""

    model_config = ConfigDict(extra="forbid")

    mode: AdvantageMode = Field(
        default="grpo",
        description="grpo: (score - group mean) / (group std + eps). mean_only: score - group mean "
        "(Dr. GRPO; no up-weighting of groups whose scores barely differ). leave_one_out: score - "
        "mean of the other scores (RLOO). Unset: the loss's default, mean_only for dr_grpo.",
    )
    eps: float = Field(default=1e-6, gt=0.0, description="Added to the std so equal scores give 0.")


class TrainerConfig(BaseModel):
    """Everything one training run needs besides the data: model, optimizer, batching, loss."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="Hugging Face model directory or hub name of the initial policy.")
    steps: int = Field(default=100, gt=0, description="Optimizer steps to run.")
    groups_per_step: int = Field(default=8, gt=0, description="Whole groups consumed by one optimizer step.")
    micro_batch_tokens: int = Field(
        default=4096,
        gt=0,
        description=(
            "Token budget of one packed micro-batch; every sequence must fit. A step's groups are "
            "packed into as many micro-batches as they need; gradients accumulate over all of them."
        ),
    )
    share_prompts: bool = Field(
        default=True,
        description=(
            "Lay out the prompt a group's sequences share once, each answer attending to it, where the "
            "packer's cost model says it is cheaper (short answers to long prompts; trainer.prefix_sharing). "
            "The same logprobs and gradients; false lays every sequence out whole."
        ),
    )
    lr: float = Field(default=1e-6, gt=0.0, le=1.0, description="AdamW learning rate (above 1 AdamW diverges).")
    grad_clip: float | None = Field(
        default=1.0, gt=0.0, description="Clip the global gradient norm to this; null disables."
    )
    max_lag: int = Field(
        default=1,
        ge=0,
        description="Skip (and count) groups sampled more than this many policy versions ago; "
        "0 trains strictly on-policy. Demonstrations (sft groups) are never stale.",
    )
    objective: Literal["auto", "rl", "sft", "dpo", "distill"] = Field(
        default="auto",
        description=(
            "How to learn from a group that does not name its objective (ScoredGroup.objective): "
            "rl (the policy loss on advantages), sft (negative log-likelihood of its trained "
            "tokens), dpo (a pair: the higher score chosen), distill (the policy loss on the "
            "teacher-minus-sampler logprob of each token), or auto: distill when every sequence "
            "has teacher_logprobs, sft for a group of one sequence without per-token advantages, "
            "whose group advantage would be 0 anyway, rl otherwise."
        ),
    )
    zero_stage: Literal[0, 1, 2, 3] = Field(
        default=0, description="DeepSpeed ZeRO stage: 0 replicates everything, 3 shards parameters."
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        default="float32", description="Training precision; bfloat16 on GPUs, float32 on CPU."
    )
    gradient_checkpointing: bool | None = Field(
        default=None,
        description="Keep only each decoder layer's input through the forward pass and recompute the layer in "
        "the backward: activation memory no longer grows with layers x micro_batch_tokens, for about a third "
        "more compute. None: on when a micro-batch's activations would pass 2 GiB (trainer.model."
        "activation_bytes: a real model at thousands of tokens), off for the small ones.",
    )
    save_every: int = Field(default=10, gt=0, description="Publish a checkpoint every this many steps.")
    publish_dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        default=None,
        description="The dtype of the published weights: the one the servers serve (clotho run sets it from "
        "servers.dtype), half the bytes to write and reload in bf16; None: the training dtype.",
    )
    full_every: int | None = Field(
        default=None,
        ge=1,
        description="Publish the weights in full every this many checkpoints and, between, as deltas on the one "
        "before (the changed bytes, XOR'd and compressed: a few percent of the full weights for a bf16 publish "
        "at a small learning rate); 1: always in full. Rank 0 keeps the previous publish's bytes in memory "
        "(2 bytes a parameter in bf16) and publishes in full where a delta would not halve the bytes. None: 10 "
        "for a publish in 16 bits, 1 in float32 (an update moves most fp32 mantissa bits: a delta is ~40% of "
        "the full weights, and retention keeps a kept delta's chain).",
    )
    state_every: int | None = Field(
        default=None,
        gt=0,
        description="Save the resume state (weights, optimizer, data position) every this many steps, a "
        "multiple of save_every; None: with every published checkpoint. A trainer killed between states "
        "resumes from the last one and trains the steps since again, from the same groups, to the "
        "checkpoints already published (checked against their stored logprobs).",
    )
    state_every_minutes: float | None = Field(
        default=None,
        gt=0,
        description="Also save the resume state with the first published checkpoint this many minutes after the "
        "last state; with it and no state_every, time alone decides (and the last step). A long step count "
        "between states costs replayed steps on a crash, a short one a state write (16 bytes a parameter) per "
        "checkpoint.",
    )
    state_in_storage: bool | None = Field(
        default=None,
        description="Copy each resume state to the run's storage ({run}/trainer-state) and resume from there, so "
        "ranks on hosts that share no disk, or a trainer that lost its host, resume; None: when the run's storage "
        "is not a local disk (a local run keeps its work dir in its storage already).",
    )
    keep_last: int | None = Field(
        default=3,
        ge=1,
        description="Keep only the last this many published checkpoints (plus every keep_every-th, BEST, the "
        "one LATEST names, any a server still serves or loads, and the steps a kept delta is built from); "
        "None keeps every one.",
    )
    keep_every: int | None = Field(
        default=None, gt=0, description="With keep_last: also keep every step divisible by this."
    )
    seed: int = Field(default=0, description="Seeds torch and the data order.")
    report_to: list[str] = Field(
        default_factory=list,
        description="Experiment trackers for each step's metrics, beside metrics.jsonl and TensorBoard: "
        "'wandb' (pip install wandb) or module:Class of your own (trainer.trackers).",
    )
    loss: LossConfig = Field(default_factory=LossConfig)
    advantages: AdvantageConfig = Field(default_factory=AdvantageConfig)

    @field_validator("model")
    @classmethod
    def _model_exists(cls, model: str) -> str:
        return check_model_source(model)

    @field_validator("report_to")
    @classmethod
    def _trackers_load(cls, names: list[str]) -> list[str]:
        return check_report_to(names)

    @model_validator(mode="after")
    def _loss_advantage_default(self) -> TrainerConfig:
        # Some losses come with their advantages (Dr. GRPO drops the std normalization along with
        # the length one); follow the loss unless told otherwise.
        if "mode" not in self.advantages.model_fields_set:
            self.advantages.mode = self.loss.defaults.advantage_mode
        return self

    @model_validator(mode="after")
    def _state_at_a_checkpoint(self) -> TrainerConfig:
        if self.state_every is not None and self.state_every % self.save_every:
            raise ValueError(
                f"state_every={self.state_every} is not a multiple of save_every={self.save_every}: a resume "
                f"state is saved with a published checkpoint; set state_every to {self.save_every * max(1, self.state_every // self.save_every)}"
            )
        return self

    @property
    def publish_full_every(self) -> int:
        """full_every, or its default for the published dtype (None: 10 in 16 bits, 1 in float32)."""
        if self.full_every is not None:
            return self.full_every
        return 1 if (self.publish_dtype or self.dtype) == "float32" else 10

    def state_due(self, step: int, minutes_since_state: float) -> bool:
        """Whether the checkpoint published at `step` takes a resume state with it: at the last step,
        every state_every steps, once state_every_minutes have passed since the last state, and
        with every checkpoint when neither is set."""
        if step == self.steps or (self.state_every is not None and step % self.state_every == 0):
            return True
        if self.state_every_minutes is not None:
            return minutes_since_state >= self.state_every_minutes
        return self.state_every is None

    @classmethod
    def from_yaml(cls, path: str | Path | None = None, overrides: Sequence[str] = ()) -> TrainerConfig:
        """Load a YAML file (or start empty) and apply CLI-style `a.b=value` overrides on top."""
        data: dict[str, Any] = {}
        if path is not None:
            loaded = yaml.safe_load(Path(path).read_text())
            if loaded is not None and not isinstance(loaded, dict):
                raise ValueError(f"{path}: top level is {type(loaded).__name__}; write a mapping of fields")
            data = loaded or {}
        return cls.model_validate(apply_overrides(data, overrides))
