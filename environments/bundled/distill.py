"""On-policy distillation: any environment's samples, scored token by token by a teacher model.

The student (the policy being trained) samples as the source environment always does; a teacher
server then scores the very tokens sampled (vLLM prompt_logprobs: no sampling, no re-tokenization)
and the group goes to the trainer as `distill`: each sampled token's advantage is the teacher's
logprob minus the student's (the per-token reverse KL, as in on-policy distillation), trained
through the policy loss. Two ways to use it:

- the `distill` environment: `{env: arithmetic, env_config: {...}, teacher_url: http://...}`
  wraps any environment by name;
- `with_teacher_logprobs(group, teacher)` in an environment's own collect_trajectories.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from pydantic import Field

from core.scored_group import ScoredGroup
from environments.base import Environment, EnvironmentConfig, Item
from environments.loading import load_config, load_environment_class
from inference.client import PolicyClient


async def teacher_logprobs(teacher: PolicyClient, tokens: list[int], mask: list[bool]) -> list[float]:
    """The teacher's logprob of each trained token of a sequence (0.0 where not trained)."""
    scored = await teacher.prompt_logprobs(tokens)
    return [value if trained else 0.0 for value, trained in zip(scored, mask, strict=True)]


async def with_teacher_logprobs(group: ScoredGroup, teacher: PolicyClient) -> ScoredGroup:
    """`group` with every sequence's teacher_logprobs filled, marked objective="distill"."""
    scored = await asyncio.gather(*(teacher_logprobs(teacher, s.tokens, s.mask) for s in group.sequences))
    sequences = [
        s.model_copy(update={"teacher_logprobs": values}) for s, values in zip(group.sequences, scored, strict=True)
    ]
    return group.model_copy(update={"sequences": sequences, "objective": "distill"})


class DistillConfig(EnvironmentConfig):
    env: str = Field(description="The environment whose samples the teacher scores: its name or 'module:Class'.")
    env_config: dict[str, Any] = Field(default_factory=dict, description="The `env` environment's config.")
    teacher_url: str = Field(
        description="Base URL of the teacher's vLLM server (it must serve the policy's tokenizer)."
    )
    teacher_model: str = Field(default="policy", description="The model name the teacher server serves.")
    teacher_api_key_env: str | None = Field(
        default=None, description="Environment variable holding the teacher server's API key, if it needs one."
    )


class Distill(Environment):
    """The source environment's groups, with the teacher's per-token logprobs: objective distill.
    Items, rewards (kept as scores, for the curves) and evaluation are the source's."""

    name = "distill"
    config_class = DistillConfig

    async def setup(self) -> None:
        source_class = load_environment_class(self.config.env)
        self.source = source_class(
            load_config(source_class, self.config.env_config), client=self.client, tokenizer=self.tokenizer
        )
        await self.source.setup()
        api_key = os.environ.get(self.config.teacher_api_key_env) if self.config.teacher_api_key_env else None
        self.teacher = PolicyClient(self.config.teacher_url, model=self.config.teacher_model, api_key=api_key)

    async def get_item(self) -> Item | None:
        """Written, not items or new_item: the items are the source environment's, handed out by it."""
        return await self.source.get_item()

    def reward(self, item: Item, messages: list[dict]) -> float:
        return self.source.reward(item, messages)

    async def collect_trajectories(self, item: Item) -> ScoredGroup:
        group = await self.source.collect_trajectories(item)
        return await with_teacher_logprobs(group, self.teacher)

    async def evaluate(self, num_items: int = 16) -> dict[str, float]:
        return await self.source.evaluate(num_items)
