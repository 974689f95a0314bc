"""Demonstrations as groups of one: a dataset of (prompt, completion) rows, or any environment's gold
answers, sent through the same pipe as rollouts and trained with the sft objective."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from core.scored_group import ScoredGroup, ScoredSequence
from environments.base import Environment, EnvironmentConfig, Item, final_answer, prompt_messages
from environments.chat import Messages
from environments.loading import load_config, load_environment_class

# Local files load with the `datasets` builder their suffix names.
_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class SFTConfig(EnvironmentConfig):
    group_size: int = Field(default=1, ge=1, le=1, description="Always 1: a group is one demonstration.")
    data: str | None = Field(
        default=None,
        description="A dataset of demonstrations: a local .jsonl/.json/.parquet/.csv file, or a "
        "Hugging Face dataset id where the hub is reachable. Set this or `env`.",
    )
    split: str = Field(default="train", description="The split of `data` to learn from.")
    eval_data: str | None = Field(
        default=None,
        description="Held-out rows for `evaluate` (same columns as `data`); unset: the first rows "
        "of `data`, which the policy has trained on.",
    )
    prompt_column: str = Field(
        default="prompt", description="Column of the prompt: a string or a list of chat messages."
    )
    completion_column: str = Field(default="completion", description="Column of the answer to learn, a string.")
    env: str | None = Field(
        default=None,
        description="Learn another environment's gold answers instead: its name or 'module:Class'. "
        "Rewards and evaluation are that environment's.",
    )
    env_config: dict[str, Any] = Field(default_factory=dict, description="The `env` environment's config.")

    @model_validator(mode="after")
    def _one_source(self) -> SFTConfig:
        if (self.data is None) == (self.env is None):
            raise ValueError(
                "data / env: set exactly one: data=PATH_OR_DATASET_ID for a dataset of "
                "(prompt, completion) rows, or env=NAME to learn an environment's gold answers"
            )
        return self


class SFT(Environment):
    """One demonstration per group: the prompt as context, the completion (and the end of turn)
    as the trained tokens, scored by the source's reward. No inference: the trainer's sft
    objective needs no sampler logprobs (they are stored as 0.0)."""

    name = "sft"
    config_class = SFTConfig

    async def setup(self) -> None:
        self.source: Environment | None = None
        self.rows: list[dict[str, Any]] = []
        if self.config.env is not None:
            source_class = load_environment_class(self.config.env)
            self.source = source_class(
                load_config(source_class, self.config.env_config), client=self.client, tokenizer=self.tokenizer
            )
            await self.source.setup()
        else:
            self.rows = self._load_rows(self.config.data, self.config.split, "data")

    def _load_rows(self, source: str, split: str, field: str) -> list[dict[str, Any]]:
        import datasets

        path = Path(source)
        try:
            if path.suffix in _BUILDERS:
                if not path.exists():
                    raise FileNotFoundError(f"no such file {source}")
                dataset = datasets.load_dataset(_BUILDERS[path.suffix], data_files=str(path), split="train")
            else:
                dataset = datasets.load_dataset(source, split=split)
        except Exception as error:
            raise ValueError(
                f"{field}: cannot load {source!r} ({type(error).__name__}: {error}); give a local "
                f".jsonl/.json/.parquet/.csv file or a dataset id the hub can serve"
            ) from error
        missing = [
            c for c in (self.config.prompt_column, self.config.completion_column) if c not in dataset.column_names
        ]
        if missing:
            raise ValueError(
                f"{field}: {source!r} has no column {missing[0]!r} (columns: {dataset.column_names}); set "
                "prompt_column / completion_column to the columns that hold them"
            )
        if len(dataset) == 0:
            raise ValueError(f"{field}: {source!r} has no rows")
        return [dataset[index] for index in range(len(dataset))]

    def items(self, split: str) -> list[dict[str, Any]] | None:
        """The rows of data ("train"), of eval_data or else data's first rows ("eval"), as items
        whose id is the row's index; None when learning an environment's gold answers."""
        if self.source is not None:
            return None
        if split == "train":
            rows = self.rows
        else:
            rows = self._load_rows(self.config.eval_data, "train", "eval_data") if self.config.eval_data else self.rows
        columns = self.config.prompt_column, self.config.completion_column
        return [
            {"id": str(index), "prompt": row[columns[0]], "answer": row[columns[1]]} for index, row in enumerate(rows)
        ]

    async def get_item(self) -> Item | None:
        """Written, not items: with `env`, the items are that environment's, handed out by it."""
        if self.source is not None:
            return await self.source.get_item()
        return await super().get_item()

    def demonstration(self, item: Item) -> str:
        """The answer to learn for `item`: its row's completion or the source's gold answer."""
        if self.source is not None:
            gold = self.source.gold_completion(item)
            if gold is None:
                raise ValueError(
                    f"env: {self.source.name} has no gold_completion for item {item.id}; learn from a "
                    "dataset (data=...) or give the environment a gold_completion"
                )
            return gold
        if not isinstance(item.answer, str) or not item.answer:
            raise ValueError(
                f"{self.config.completion_column}: row {item.id} holds {item.answer!r}; a demonstration "
                "needs a non-empty string to train on"
            )
        return item.answer

    async def collect_trajectories(self, item: Item) -> ScoredGroup:
        answer = self.demonstration(item)
        messages = prompt_messages(item) + [{"role": "assistant", "content": answer}]
        prompt_ids = self.renderer.prompt_ids(prompt_messages(item))
        # What the sampler would have produced: the answer's ids, then EOS, which ends the turn.
        completion_ids = self.renderer.encode(answer)
        if self.renderer.eos_token_id is not None:
            completion_ids.append(self.renderer.eos_token_id)
        sequence = ScoredSequence.from_prompt(
            prompt_ids,
            completion_ids,
            [0.0] * len(completion_ids),
            score=self.reward(item, messages),
            messages=messages,
        )
        return self.make_group(item, [sequence], objective="sft")

    def reward(self, item: Item, messages: Messages) -> float:
        if self.source is not None:
            return self.source.reward(item, messages)
        return 1.0 if final_answer(messages).strip() == str(item.answer).strip() else 0.0

    def gold_completion(self, item: Item) -> str | None:
        return self.demonstration(item)

    async def answer_for_evaluation(self, item: Item) -> ScoredGroup:
        """The policy's own greedy answer, scored by reward: not the demonstration."""
        return await Environment.collect_trajectories(self, item)

    async def evaluate(self, num_items: int = 16) -> dict[str, float]:
        """Greedy answers of the policy: the source environment's own evaluation, or exact match
        on the "eval" rows (eval_data, else the first rows of data)."""
        if self.source is not None:
            return await self.source.evaluate(num_items)
        return await super().evaluate(num_items)
