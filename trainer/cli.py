"""`clotho train`: the trainer loop from the command line, one process or under torchrun/deepspeed.

    clotho train --run RUN_URL --model PATH --steps N [--config trainer.yaml] [--set key.path=value]
    deepspeed --num_gpus 2 --module trainer.cli --run RUN_URL --model PATH --steps N
    torchrun --nproc_per_node 2 -m trainer.cli -- --run RUN_URL --model PATH --steps N

torchrun needs the `--`: it abbreviates its own options and would take `--run` for `--run-path`.
"""

from __future__ import annotations

import logging
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
    from trainer.data import DataTimeoutError
    from trainer.entry import TrainingInputError, prepare_training

    # Everything is checked before anything heavy loads or anything is written.
    try:
        start = prepare_training(run, model, steps, config, set_)
    except TrainingInputError as error:
        raise typer.BadParameter(error.message, param_hint=error.option) from None

    import torch

    from trainer.stopping import StopRequested, stop_at_step_boundaries
    from trainer.train import train

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop_at_step_boundaries()
    step = None
    try:
        for metrics in train(start.config, start.storage, start.run, work_dir=work_dir, data_timeout_s=data_timeout_s):
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
