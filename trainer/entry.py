"""How a trainer starts, whoever starts it (`clotho train`, the `train` flow, the pipeline's trainer
node): one function checks everything before anything heavy loads or anything is written."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from trainer.config import TrainerConfig


class TrainingInputError(ValueError):
    """A bad input to a trainer start, with the option it came from (`--run`, `--model`, `--set`,
    `--config`) so a command line can name it."""

    def __init__(self, option: str, message: str):
        super().__init__(f"{option}: {message}")
        self.option, self.message = option, message


@dataclass(frozen=True)
class TrainingStart:
    config: TrainerConfig  # its model a directory on this host
    storage: str
    run: str


def prepare_training(
    run_url: str,
    model: str,
    steps: int,
    config_path: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    announce: bool = True,
) -> TrainingStart:
    """The run URL parsed, the trainer's config read (the file, then `overrides`, then `model` and
    `steps`, which win), a model in storage fetched to this host once (storage.models), the model's
    tokenizer checked against the run's shards, and, on rank 0 with `announce`, the trainer's
    position written (storage.progress.announce_trainer: the samplers of its first steps start now,
    before torch loads). TrainingInputError names the input at fault."""
    import yaml
    from pydantic import ValidationError

    from core.validation import describe_validation_error
    from storage.cli import check_run_url
    from storage.models import local_model
    from storage.progress import announce_trainer
    from storage.reader import TokenizerMismatchError
    from trainer.data import check_run_tokenizer

    try:
        storage, run = check_run_url(run_url)
    except ValueError as error:
        raise TrainingInputError("--run", str(error)) from None
    try:
        # JSON quoting keeps a path a string.
        config = TrainerConfig.from_yaml(config_path, [*overrides, f"model={json.dumps(model)}", f"steps={steps}"])
    except ValidationError as error:
        message = describe_validation_error(error, TrainerConfig)
        if message.startswith("model: "):
            raise TrainingInputError("--model", message.removeprefix("model: ")) from None
        raise TrainingInputError("--config/--set" if config_path else "--set", message) from None
    except yaml.YAMLError as error:
        raise TrainingInputError("--config", f"not valid YAML ({' '.join(str(error).split())}); fix the file") from None
    except ValueError as error:  # an override that does not apply, a file that is not a mapping
        raise TrainingInputError("--set", str(error)) from None
    config = config.model_copy(update={"model": local_model(config.model)})
    try:
        check_run_tokenizer(storage, run, config.model)
    except TokenizerMismatchError as error:
        raise TrainingInputError("--model", str(error)) from None
    except (FileNotFoundError, PermissionError) as error:  # a bucket that is not there, credentials refused
        raise TrainingInputError("--run", " ".join(str(error).split())) from None
    if announce and int(os.environ.get("RANK", "0")) == 0:
        announce_trainer(
            storage,
            run,
            groups_per_step=config.groups_per_step,
            save_every=config.save_every,
            max_lag=config.max_lag,
            end_step=config.steps,
        )
    return TrainingStart(config, storage, run)
