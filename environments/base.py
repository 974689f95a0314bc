"""The Environment base class: items in, scored groups of token-exact rollouts out."""

from __future__ import annotations

import asyncio
import importlib
import logging
import traceback
from abc import ABC, abstractmethod
from collections.abc import Awaitable
from typing import Any, ClassVar, Coroutine, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from inference.client import Completion, PolicyClient, PolicyServerUnreachable
from environments.chat import ChatRenderer, ChatSession, Messages, load_tokenizer
from environments.scored_group import InvalidGroupError, ScoredGroup, ScoredSequence

T = TypeVar("T")

log = logging.getLogger(__name__)


class EnvironmentConfig(BaseModel):
    """Knobs every environment has; an environment subclasses this for its own."""

    model_config = ConfigDict(extra="forbid")

    group_size: int = Field(default=4, ge=1, description="Sequences per group (GRPO's n).")
    max_tokens: int = Field(default=32, ge=1, description="Most tokens sampled per assistant turn.")
    min_tokens: int = Field(default=0, ge=0, description="Fewest tokens per turn before EOS may end it.")
    temperature: float = Field(default=1.0, ge=0.0, description="Sampling temperature.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    seed: int = Field(default=0, description="Seed of the item stream.")
    cycle: bool = Field(default=True, description="Start over when items run out; else get_item returns None.")


class Item(BaseModel):
    """One unit of work handed out by get_item; environments subclass it with their fields."""

    id: str
    prompt: str | list[dict[str, Any]]
    answer: Any = None
    extras: dict[str, Any] = Field(default_factory=dict)


class RolloutFailure(BaseModel):
    """A rollout or group that failed: recorded as data, never allowed to crash its siblings."""

    env: str
    item_id: str
    error: str
    traceback: str = ""


class Environment(ABC):
    """Subclass this: set `name` and `config_class`, implement get_item, collect_trajectories, score.

    The base class owns the boring parts: the tokenizer and chat rendering, token bookkeeping,
    group assembly and validation, and turning failures into recorded data.
    """

    name: ClassVar[str]
    config_class: ClassVar[type[EnvironmentConfig]] = EnvironmentConfig
    # An environment may bring its own chat template (a Jinja string) and name it for the trainer.
    chat_template: ClassVar[str | None] = None
    chat_template_name: ClassVar[str | None] = None

    def __init__(
        self,
        config: EnvironmentConfig | dict[str, Any] | None = None,
        *,
        client: PolicyClient,
        tokenizer: Any,
    ):
        self.config = config if isinstance(config, self.config_class) else self.config_class(**(config or {}))
        self.client = client
        self.tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        self.vocab_size = len(self.tokenizer)
        self._renderer: ChatRenderer | None = None

    # ---- what an environment author writes -------------------------------------------------
    async def setup(self) -> None:
        """Loads data once (offline)."""

    @abstractmethod
    async def get_item(self) -> Item | None:
        """The next item, or None when finite data ran out and config.cycle is False."""

    @abstractmethod
    async def collect_trajectories(self, item: Item) -> ScoredGroup:
        """Inference and scoring together: any number of completions, one scored group."""

    @abstractmethod
    def score(self, item: Item, completion: str) -> float:
        """The reward of a final answer; deterministic for a fixed completion."""

    def gold_completion(self, item: Item) -> str | None:
        """A completion that must score top (for the conformance suite); None if there is none."""
        return None

    async def evaluate(self, num_items: int = 16) -> dict[str, float]:
        """Mean score and success rate of greedy answers on num_items items."""
        scores = []
        for _ in range(num_items):
            item = await self.get_item()
            if item is None:
                break
            group = await self.collect_trajectories(item)
            scores.extend(group.scores)
        if not scores:
            return {"mean_score": 0.0, "items": 0.0}
        return {
            "mean_score": sum(scores) / len(scores),
            "success_rate": sum(s > 0 for s in scores) / len(scores),
            "items": float(num_items),
        }

    # ---- helpers the base class owns -------------------------------------------------------
    @property
    def renderer(self) -> ChatRenderer:
        if self._renderer is None:
            self._renderer = ChatRenderer(self.tokenizer, self.chat_template, self.chat_template_name)
        return self._renderer

    def sampling(self) -> dict[str, Any]:
        config = self.config
        sampling = dict(max_tokens=config.max_tokens, temperature=config.temperature, top_p=config.top_p)
        if config.min_tokens:
            sampling["min_tokens"] = min(config.min_tokens, config.max_tokens)
        return sampling

    def chat(self, messages: Messages) -> ChatSession:
        """A new multi-turn session whose prompt is rendered with the environment's template."""
        return ChatSession(self.renderer, messages)

    async def sample_chat(self, messages: Messages, n: int | None = None) -> tuple[list[int], list[Completion]]:
        """Single-turn chat: one rendered prompt, n samples from it in one request."""
        prompt_ids = self.renderer.prompt_ids(messages)
        completions = await self.client.complete(prompt_ids, n=n or self.config.group_size, **self.sampling())
        return prompt_ids, completions

    async def complete_text(self, prompt: str, n: int | None = None) -> tuple[list[int], list[Completion]]:
        """Base-model mode: plain completion of text, no chat template."""
        prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        completions = await self.client.complete(prompt_ids, n=n or self.config.group_size, **self.sampling())
        return prompt_ids, completions

    async def with_policy_version(self, sampling: Awaitable[T]) -> tuple[int, T]:
        """The served policy version and the result of `sampling`, e.g.
        `version, (prompt_ids, completions) = await self.with_policy_version(self.sample_chat(msgs))`.

        The version is read while sampling starts, in parallel: a read before it would hold every
        group back by a round-trip that, on a busy server, waits for an engine step (0.07-0.35 s
        here against 2 s groups). The stamp is as exact either way: a reload pauses the server and
        drains the requests in flight, so only one that arrives during the pause can run on newer
        weights than it was stamped with, whichever order the two requests go in.
        """
        version = asyncio.ensure_future(self.client.weight_version())
        try:
            result = await sampling
        except BaseException:
            version.cancel()
            raise
        return await version, result  # errors keep their type (an unreachable server is retried)

    async def gather_sequences(self, rollouts: list[Coroutine[Any, Any, ScoredSequence]]) -> tuple[list[ScoredSequence], list[str]]:
        """Runs rollouts concurrently; a failed one is recorded as an error string, not raised."""
        results = await asyncio.gather(*rollouts, return_exceptions=True)
        sequences, errors = [], []
        for result in results:
            if isinstance(result, BaseException):
                if isinstance(result, asyncio.CancelledError):
                    raise result
                errors.append(f"{type(result).__name__}: {result}")
            else:
                sequences.append(result)
        return sequences, errors

    def make_group(
        self,
        item: Item,
        sequences: list[ScoredSequence],
        *,
        policy_version: int,
        extras: dict[str, Any] | None = None,
        errors: list[str] | None = None,
    ) -> ScoredGroup:
        """Assembles and validates a group against the run's vocabulary and group size."""
        if not sequences:
            raise RuntimeError(
                f"env {self.name} item {item.id}: every rollout failed; first error: "
                f"{(errors or ['none recorded'])[0]}"
            )
        group_extras = dict(extras or {})
        if errors:
            group_extras["rollout_errors"] = errors
        group = ScoredGroup(
            env=self.name,
            item_id=item.id,
            sequences=sequences,
            policy_version=policy_version,
            chat_template=self.renderer.template_name if self.chat_template else None,
            extras=group_extras,
        )
        group.check_limits(vocab_size=self.vocab_size, max_group_size=self.config.group_size)
        return group

    async def safe_collect(self, item: Item) -> ScoredGroup | RolloutFailure:
        """collect_trajectories, with any failure (invalid group included) returned as data.

        An unreachable policy server is not a bad rollout but a broken run: it is raised, so the
        caller (a Prefect task with retries) can wait for the server.
        """
        try:
            return await self.collect_trajectories(item)
        except (asyncio.CancelledError, PolicyServerUnreachable):
            raise
        except Exception as error:  # a bad rollout is data, not a crash
            log.warning("env %s item %s failed: %s", self.name, item.id, error)
            return RolloutFailure(
                env=self.name,
                item_id=item.id,
                error=f"{type(error).__name__}: {error}",
                traceback=traceback.format_exc(limit=8),
            )


def load_environment_class(import_path: str) -> type[Environment]:
    """'package.module:ClassName' -> the class; found by import path, no registry."""
    module_name, _, class_name = import_path.partition(":")
    if not class_name:
        raise ValueError(f"environment {import_path!r}: use 'module.path:ClassName'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"environment {import_path!r}: cannot import {module_name}: {error}") from error
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ValueError(f"environment {import_path!r}: {class_name} is not an Environment subclass")
    return cls


__all__ = [
    "Environment",
    "EnvironmentConfig",
    "InvalidGroupError",
    "Item",
    "RolloutFailure",
    "load_environment_class",
]
