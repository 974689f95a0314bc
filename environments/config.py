"""What every environment is configured with (EnvironmentConfig, subclassed for an environment's
own knobs) and what it hands out (Item, subclassed for its own fields)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class EnvironmentConfig(BaseModel):
    """Knobs every environment has; an environment subclasses this for its own."""

    model_config = ConfigDict(extra="forbid")

    group_size: int = Field(default=4, ge=1, le=4096, description="Sequences per group (GRPO's n), 1..4096.")
    max_tokens: int = Field(default=32, ge=1, description="Most tokens sampled per assistant turn.")
    min_tokens: int = Field(default=0, ge=0, description="Fewest tokens per turn before EOS may end it.")
    temperature: float = Field(default=1.0, ge=0.0, description="Sampling temperature.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    seed: int = Field(default=0, description="Seed of the item stream.")
    eval_seed: int = Field(
        default=1_000_003,
        description="Seed of the held-out stream `evaluate` draws from (environments with a test split "
        "override get_eval_item instead).",
    )
    cycle: bool = Field(default=True, description="Start over when items run out; else get_item returns None.")
    group_timeout_s: float | None = Field(
        default=1800.0,
        gt=0,
        description="A group still sampling or scoring after this many seconds is cut and recorded as a "
        "failure (reason timeout), its requests cancelled; null: no limit. The cut lands at the group's next "
        "await: code that blocks the event loop (a busy loop in reward) is not cut, so run such code in the "
        "sandbox (environments.sandbox) or asyncio.to_thread.",
    )
    max_group_tokens: int | None = Field(
        default=1_048_576,
        ge=1,
        description="Most tokens in one group, prompts included (4 bytes each in a shard, plus the mask and "
        "logprobs); a bigger group is recorded as a failure (reason too-large), never stored; null: no limit.",
    )


class Item(BaseModel):
    """One unit of work handed out by get_item; environments subclass it with their fields."""

    id: str
    prompt: str | list[dict[str, Any]]
    answer: Any = None
    extras: dict[str, Any] = Field(default_factory=dict)
