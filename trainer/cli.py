"""`clotho train`: the trainer loop from the command line, one process or under torchrun/deepspeed.

    clotho train --run RUN_URL --model PATH --steps N [--config trainer.yaml] [--set key.path=value]
    deepspeed --num_gpus 2 --module trainer.cli --run RUN_URL --model PATH --steps N
    torchrun --nproc_per_node 2 -m trainer.cli -- --run RUN_URL --model PATH --steps N

torchrun needs the `--`: it abbreviates its own options and would take `--run` for `--run-path`.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import typer


def train_command(
    run: str = typer.Option(
        ..., help="Run URL STORAGE_URL/RUN (a path, file://, s3://): reads its rollouts, publishes its checkpoints."
    ),
    model: str = typer.Option(..., help="Initial policy: Hugging Face model directory or hub name."),
    steps: int = typer.Option(..., min=1, help="Total optimizer steps; a resumed run continues up to it."),
    config: Path = typer.Option(None, exists=True, dir_okay=False, help="Trainer YAML (TrainerConfig)."),
    set_: list[str] = typer.Option(
        [], "--set", help="Override a field, key.path=value with a YAML value: --set loss.name=dapo (repeatable)."
    ),
    work_dir: Path = typer.Option(
        None,
        help="Local directory for resume state and metrics "
        "(default RUN_URL/trainer, or .clotho/trainer/RUN for remote storage).",
    ),
    data_timeout_s: float = typer.Option(600.0, min=0.0, help="Seconds to wait for new groups before giving up."),
    local_rank: int = typer.Option(None, "--local_rank", hidden=True, help="Set by the deepspeed launcher."),
) -> None:
    """Train the policy on the run's rollout shards with DeepSpeed and publish checkpoints."""
    import yaml
    from pydantic import ValidationError

    from storage.cli import check_run_url
    from storage.progress import announce_trainer
    from storage.reader import TokenizerMismatchError
    from trainer.config import TrainerConfig
    from trainer.data import DataTimeoutError, check_run_tokenizer

    # Everything is checked before anything heavy loads or anything is written.
    try:
        storage, run_name = check_run_url(run)
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="--run") from None
    try:
        # --model and --steps win over the file and --set; JSON quoting keeps a path a string.
        trainer_config = TrainerConfig.from_yaml(config, [*set_, f"model={json.dumps(model)}", f"steps={steps}"])
    except ValidationError as error:
        from core.validation import describe_validation_error

        message = describe_validation_error(error, TrainerConfig)
        if message.startswith("model: "):  # --model, given on the command line
            raise typer.BadParameter(message.removeprefix("model: "), param_hint="--model") from None
        raise typer.BadParameter(message, param_hint="--config/--set" if config else "--set") from None
    except yaml.YAMLError as error:
        raise typer.BadParameter(
            f"not valid YAML ({' '.join(str(error).split())}); fix the file", param_hint="--config"
        ) from None
    except ValueError as error:  # an --set that does not apply, a file that is not a mapping
        raise typer.BadParameter(str(error), param_hint="--set") from None
    from storage.models import local_model

    # A model in storage: this host's copy, fetched once (storage.models).
    trainer_config = trainer_config.model_copy(update={"model": local_model(trainer_config.model)})
    try:
        check_run_tokenizer(storage, run_name, trainer_config.model)
    except TokenizerMismatchError as error:
        typer.echo(f"clotho train: --model: {error}", err=True)
        raise typer.Exit(2) from None
    except (FileNotFoundError, PermissionError) as error:  # a bucket that is not there, credentials refused
        typer.echo(f"clotho train: --run: {' '.join(str(error).split())}", err=True)
        raise typer.Exit(2) from None

    if int(os.environ.get("RANK", "0")) == 0:  # before torch loads: the samplers of its steps start now
        announce_trainer(
            storage,
            run_name,
            groups_per_step=trainer_config.groups_per_step,
            save_every=trainer_config.save_every,
            max_lag=trainer_config.max_lag,
            end_step=trainer_config.steps,
        )

    import torch

    from trainer.stopping import StopRequested, stop_at_step_boundaries
    from trainer.train import train

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop_at_step_boundaries()
    step = None
    try:
        for metrics in train(trainer_config, storage, run_name, work_dir=work_dir, data_timeout_s=data_timeout_s):
            step = metrics["step"]
    except DataTimeoutError as error:
        typer.echo(str(error), err=True)
        raise typer.Exit(2) from None
    except StopRequested as stop:
        done = f"after step {step}" if step is not None else "before its first step of this start"
        typer.echo(f"clotho train: stopped by {stop} {done}; run it again to resume", err=True)
        raise typer.Exit(128 + stop.signum) from None
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


app = typer.Typer(add_completion=False)
app.command()(train_command)

if __name__ == "__main__":
    app()
