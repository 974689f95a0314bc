"""Any reasoning-gym procedural dataset as an environment, its difficulty following the recent reward.

Items are entries of the named reasoning-gym dataset (`basic_arithmetic`, `chain_sum`,
`leg_counting`, ...); the model answers inside <answer>...</answer> and the dataset's own
`score_answer` scores the tag's content (0.0 with no tag). With `curriculum` on, difficulty is the
dataset's reasoning-gym curriculum at one global level: every attribute at that level of its own
list (reasoning-gym's `set_global_level`). The level rises when the mean reward of the last `window`
groups of the current level reaches `raise_above` and falls when it drops below `lower_below`;
the rollout flow hands every stored group to `observe`, whichever server sampled it.
"""

from __future__ import annotations

import difflib
import logging
import random
import statistics
from collections import deque
from typing import Any

from pydantic import Field, field_validator, model_validator
from reasoning_gym.coaching import RangeAttributeDefinition, ScalarAttributeDefinition
from reasoning_gym.factory import DATASETS, create_curriculum, has_curriculum
from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer

from core.scored_group import ScoredGroup
from environments.base import Environment, EnvironmentConfig, Item, final_answer

log = logging.getLogger(__name__)

# Entries per dataset object: some datasets precompute `size` entries or refuse large sizes, so the
# stream is cut in chunks, chunk c seeded seed + c * CHUNK (entry i of a dataset draws from seed + i).
CHUNK = 500


class ReasoningGymConfig(EnvironmentConfig):
    dataset: str = Field(
        default="basic_arithmetic", description="The reasoning-gym dataset, e.g. chain_sum or leg_counting."
    )
    dataset_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Fields of the dataset's reasoning-gym config, e.g. {'operators': ['+', '-']}.",
    )
    curriculum: bool = Field(
        default=True,
        description="Difficulty follows the recent reward along the dataset's curriculum; off: dataset_kwargs alone.",
    )
    window: int = Field(
        default=16, ge=1, description="Groups of the current level whose mean reward decides a level change."
    )
    raise_above: float = Field(default=0.8, description="Mean reward at or above which the level rises.")
    lower_below: float = Field(default=0.2, description="Mean reward below which the level falls.")

    @field_validator("dataset")
    @classmethod
    def _known(cls, name: str) -> str:
        if name not in DATASETS:
            close = difflib.get_close_matches(name, DATASETS, n=3) or ["basic_arithmetic", "chain_sum", "leg_counting"]
            raise ValueError(
                f"reasoning-gym has no dataset {name!r}; e.g. {', '.join(close)} ({len(DATASETS)} in reasoning_gym.factory.DATASETS)"
            )
        return name

    @model_validator(mode="after")
    def _buildable(self) -> ReasoningGymConfig:
        if not self.lower_below < self.raise_above:
            raise ValueError(f"lower_below {self.lower_below} must be below raise_above {self.raise_above}")
        if owned := {"seed", "size"} & set(self.dataset_kwargs):
            raise ValueError(
                f"dataset_kwargs sets {sorted(owned)}, which the environment owns; set the environment's seed instead"
            )
        if self.curriculum and not has_curriculum(self.dataset):
            raise ValueError(f"dataset {self.dataset!r} has no reasoning-gym curriculum; set curriculum: false")
        if self.curriculum and (taken := curriculum_fields(self.dataset) & set(self.dataset_kwargs)):
            raise ValueError(
                f"dataset_kwargs sets {sorted(taken)}, which the curriculum controls; drop them or set curriculum: false"
            )
        try:
            settings = dataset_config(self, level=0, seed=self.seed)
            if hasattr(settings, "validate"):  # as reasoning_gym.create_dataset checks: not every config has one
                settings.validate()
        except (TypeError, ValueError, AssertionError) as error:
            raise ValueError(
                f"dataset {self.dataset!r} at level 0 ({type(error).__name__}: {error}); fix dataset_kwargs or set curriculum: false"
            ) from None
        return self


def curriculum_fields(name: str) -> set[str]:
    """The dataset config fields its curriculum sets."""
    names = set()
    for attribute in create_curriculum(name).attributes.values():
        if isinstance(attribute, RangeAttributeDefinition):
            names |= {attribute.lower_field_name, attribute.upper_field_name}
        elif isinstance(attribute, ScalarAttributeDefinition):
            names.add(attribute.field_name)
    return names


def dataset_config(config: ReasoningGymConfig, level: int, seed: int) -> Any:
    """The reasoning-gym config object of one level (validate() not yet called)."""
    fields = {**config.dataset_kwargs, "seed": seed, "size": CHUNK}
    if not config.curriculum:
        return DATASETS[config.dataset][1](**fields)
    curriculum = create_curriculum(config.dataset)
    curriculum.set_global_level(level)
    return curriculum.generate_configuration(fields)


def to_json(value: Any) -> Any:
    """The entry as JSON that from_json turns back exactly: scorers compare with the entry's own types
    (ARC grids are tuples of tuples), and plain JSON makes tuples lists and integer keys strings."""
    if isinstance(value, tuple):
        return {"__tuple__": [to_json(v) for v in value]}
    if isinstance(value, list):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        if all(isinstance(key, str) for key in value):
            return {key: to_json(v) for key, v in value.items()}
        return {"__items__": [[to_json(key), to_json(v)] for key, v in value.items()]}
    return value


def from_json(value: Any) -> Any:
    if isinstance(value, list):
        return [from_json(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"__tuple__"}:
            return tuple(from_json(v) for v in value["__tuple__"])
        if set(value) == {"__items__"}:
            return {from_json(key): from_json(v) for key, v in value["__items__"]}
        return {key: from_json(v) for key, v in value.items()}
    return value


class ReasoningGymItem(Item):
    level: int = Field(description="The curriculum level the entry was drawn at.")
    entry: dict[str, Any] = Field(
        description="The reasoning-gym entry (question, answer, metadata), as to_json writes it."
    )


class Curriculum:
    """A level in 0..top that follows the mean reward of the last `window` groups drawn at it."""

    def __init__(self, top: int, window: int, raise_above: float, lower_below: float):
        self.level, self.top = 0, top
        self.raise_above, self.lower_below = raise_above, lower_below
        self.recent: deque[float] = deque(maxlen=window)

    def observe(self, level: int, scores: list[float]) -> None:
        # Groups drawn before the last change say nothing about the current level.
        if level != self.level or not scores:
            return
        self.recent.append(statistics.fmean(scores))
        if len(self.recent) < (self.recent.maxlen or 0):
            return
        mean = statistics.fmean(self.recent)
        if mean >= self.raise_above and self.level < self.top:
            self.move(self.level + 1)
        elif mean < self.lower_below and self.level > 0:
            self.move(self.level - 1)

    def move(self, level: int) -> None:
        self.level = level
        self.recent.clear()


class ReasoningGym(Environment):
    """One user question per item (reasoning-gym's default system prompt asks for the answer tag)."""

    name = "reasoning_gym"
    config_class = ReasoningGymConfig
    item_class = ReasoningGymItem

    async def setup(self) -> None:
        config = self.config
        # The highest global level is the longest attribute's last.
        attributes = create_curriculum(config.dataset).attributes.values() if config.curriculum else []
        top = max((len(attribute.levels) - 1 for attribute in attributes), default=0)
        self.curriculum = Curriculum(top, config.window, config.raise_above, config.lower_below)
        self._datasets: dict[tuple[int, int], Any] = {}

    def dataset(self, level: int, chunk: int = 0) -> Any:
        """The dataset of a level's config for one chunk of the stream. Chunk 0 of a level also
        scores the level's items (no scorer reads the seed), so it stays; others go once passed."""
        key = (level, chunk)
        if key not in self._datasets:
            if chunk:
                self._datasets = {k: d for k, d in self._datasets.items() if k[1] in (0, chunk)}
            seed = self.config.seed + chunk * CHUNK
            self._datasets[key] = DATASETS[self.config.dataset][0](config=dataset_config(self.config, level, seed))
        return self._datasets[key]

    def new_item(self, rng: random.Random, index: int) -> ReasoningGymItem:
        """The dataset's entry `index` at the curriculum's level (the dataset draws it, from config.seed)."""
        level = self.curriculum.level
        chunk, position = divmod(index, CHUNK)
        entry = self.dataset(level, chunk)[position]
        messages = [
            {"role": "system", "content": SYSTEM_PROMPTS["default"]},
            {"role": "user", "content": entry["question"]},
        ]
        return ReasoningGymItem(
            id=f"{self.config.dataset}-{self.config.seed}-{index}",
            prompt=messages,
            answer=entry["answer"],
            level=level,
            entry=to_json(entry),
        )

    def reward(self, item: ReasoningGymItem, messages: list[dict]) -> float:
        answer = extract_answer(final_answer(messages))
        if answer is None:
            return 0.0
        try:
            return float(self.dataset(item.level).score_answer(answer, from_json(item.entry)))
        except Exception:  # noqa: BLE001 - some scorers parse the answer and raise on what they cannot read: a wrong answer
            return 0.0

    def gold_completion(self, item: ReasoningGymItem) -> str | None:
        # Puzzles with many solutions (graph_color, rubiks_cube, ...) have no single answer to give.
        return None if item.entry["answer"] is None else f"<answer>{item.entry['answer']}</answer>"

    async def observe(self, group: ScoredGroup) -> None:
        self.record(group.extras["item"]["level"], group.scores)

    def record(self, level: int, scores: list[float]) -> None:
        """Feeds one group's scores to the curriculum; a level whose config reasoning-gym rejects
        (some curricula overshoot their dataset's limits) becomes the top."""
        before = self.curriculum.level
        self.curriculum.observe(level, scores)
        if self.curriculum.level > before:
            try:
                self.dataset(self.curriculum.level)
            except (TypeError, ValueError, AssertionError) as error:
                log.warning(
                    "%s level %d: %s; staying at level %d", self.config.dataset, self.curriculum.level, error, before
                )
                self.curriculum.top = before
                self.curriculum.move(before)

    def metrics(self) -> dict[str, float]:
        recent = self.curriculum.recent
        return {
            "curriculum level": float(self.curriculum.level),
            "level mean reward": statistics.fmean(recent) if recent else 0.0,
        }
