"""The Prefect `train` flow: the trainer loop as a flow run, its metrics in logs and artifacts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from flows.artifacts import artifact_key
from storage.checkpoints import latest_checkpoint
from trainer.entry import prepare_training
from trainer.metrics import read_metrics
from trainer.train import default_work_dir, format_metrics
from trainer.train import train as training_steps

# The metrics table's first columns, in this order; whatever else the steps logged (a custom loss's
# metrics, say) follows. The markdown report draws CURVES.
TABLE_COLUMNS = (
    "step",
    "loss",
    "score_mean",
    "sft/nll",
    "dpo/loss",
    "dpo/accuracy",
    "dpo/reward_margin",
    "distill/kl_to_teacher",
    "advantage_std",
    "clip_fraction",
    "importance_weight_mean",
    "importance_weight_max",
    "sampler_kl",
    "grad_norm",
    "stale_groups_skipped",
    "staleness_mean",
    "padding_waste",
    "tokens_per_s",
)
CURVES = (
    "loss",
    "score_mean",
    "sft/nll",
    "dpo/loss",
    "dpo/accuracy",
    "distill/kl_to_teacher",
    "clip_fraction",
    "importance_weight_mean",
    "tokens_per_s",
)
_BARS = "▁▂▃▄▅▆▇█"


@flow(name="train")
def train(
    run_url: str,
    model: str,
    steps: int,
    config_path: str | None = None,
    overrides: list[str] | None = None,
    work_dir: str | None = None,
    data_timeout_s: float = 600.0,
) -> dict[str, Any]:
    """Train `steps` optimizer steps in total (resuming if the run has state) in this process.

    run_url: STORAGE_URL/RUN, whose rollouts it reads and where it publishes checkpoints.
    Several ranks: launch `clotho train` under torchrun or deepspeed instead.
    """
    logger = get_run_logger()
    start = prepare_training(run_url, model, steps, config_path, overrides or [])  # as `clotho train` starts
    storage, run = start.storage, start.run
    key = artifact_key("train", run)
    progress = create_progress_artifact(0.0, key=f"{key}-progress", description=f"steps of {steps}")
    for metrics in training_steps(
        start.config,
        storage,
        run,
        work_dir=Path(work_dir) if work_dir else None,
        data_timeout_s=data_timeout_s,
    ):
        logger.info("step %d: %s", metrics["step"], format_metrics(metrics))
        update_progress_artifact(progress, 100.0 * metrics["step"] / steps)

    history = read_metrics(Path(work_dir) if work_dir else default_work_dir(storage, run))
    columns = table_columns(history)
    create_table_artifact(
        [{name: row.get(name) for name in columns} for row in history],
        key=f"{key}-metrics",
        description=f"Per-step trainer metrics of run {run}",
    )
    checkpoint = latest_checkpoint(storage, run)
    create_markdown_artifact(
        report(run, history, checkpoint.url if checkpoint else None),
        key=f"{key}-report",
        description=f"Training curves of run {run}",
    )
    return {
        "run": run,
        "steps": history[-1]["step"] if history else 0,
        "checkpoint": checkpoint.url if checkpoint else None,
        "final_metrics": history[-1] if history else {},
    }


def table_columns(history: list[dict[str, float]]) -> list[str]:
    """TABLE_COLUMNS that some step logged, then every other logged metric in first-seen order."""
    logged = list(dict.fromkeys(name for row in history for name in row))
    return [name for name in TABLE_COLUMNS if name in logged] + [name for name in logged if name not in TABLE_COLUMNS]


def report(run: str, history: list[dict[str, float]], checkpoint: str | None) -> str:
    """Markdown: one sparkline per curve with its first, last, min and max, and the checkpoint."""
    lines = [f"# Training run `{run}`", "", f"Latest checkpoint: `{checkpoint or 'none yet'}`", ""]
    lines += ["| metric | curve | first | last | min | max |", "|---|---|---|---|---|---|"]
    for name in CURVES:
        values = [row[name] for row in history if name in row]
        if values:
            lines.append(
                f"| {name} | {sparkline(values)} | {values[0]:.4g} | {values[-1]:.4g} "
                f"| {min(values):.4g} | {max(values):.4g} |"
            )
    return "\n".join(lines)


def sparkline(values: list[float], width: int = 60) -> str:
    """The values as block characters, averaged into at most `width` buckets."""
    buckets = [values[i * len(values) // width : (i + 1) * len(values) // width] for i in range(width)]
    points = [sum(b) / len(b) for b in buckets if b] if len(values) > width else values
    low, high = min(points), max(points)
    scale = (len(_BARS) - 1) / (high - low) if high > low else 0.0
    return "".join(_BARS[round((v - low) * scale)] for v in points)
