"""Per-step training metrics: micro-batch metrics merged into the step's, then one JSON line per
step and TensorBoard scalars, both under work_dir."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from trainer.trackers import Trackers

# What a loss returns beside its value: floats (Total, Maximum, Minimum among them) or 0-dim tensors.
LossMetrics = dict[str, Any]

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


# A micro-batch metric says by its type how a step combines it; a plain float is a mean weighted by
# trained tokens, which is right for anything measured per token (fractions, means, KL estimates).
class Total(float):
    """A metric the step adds up over its micro-batches: the loss (each one's is its share of the
    step's), counts."""


class Maximum(float):
    """A metric whose step value is the largest of its micro-batches'."""


class Minimum(float):
    """A metric whose step value is the smallest of its micro-batches'."""


def merge_metrics(micro_batch_metrics: Iterable[dict[str, float]]) -> dict[str, float]:
    """The step's metrics (plain floats) from its micro-batches': Total values add up, Maximum and
    Minimum take the extreme, plain floats are means weighted by each micro-batch's num_tokens."""
    merged: dict[str, float] = {}
    weights: dict[str, float] = {}
    for metrics in micro_batch_metrics:
        tokens = metrics.get("num_tokens", 0)
        for key, value in metrics.items():
            if isinstance(value, Total):
                merged[key] = merged.get(key, 0.0) + value
            elif isinstance(value, Maximum):
                merged[key] = max(merged.get(key, value), value)
            elif isinstance(value, Minimum):
                merged[key] = min(merged.get(key, value), value)
            else:
                merged[key] = merged.get(key, 0.0) + value * tokens
                weights[key] = weights.get(key, 0) + tokens
    for key, weight in weights.items():
        merged[key] = merged[key] / weight if weight else 0.0
    return {key: float(value) for key, value in merged.items()}


def merge_objective_metrics(
    micro_batch_metrics: Iterable[dict[str, dict[str, float]]], weights: dict[str, float]
) -> dict[str, float]:
    """The step's loss metrics from its micro-batches' {objective: metrics} (trainer.model).

    Each objective's metrics merge on their own (merge_metrics, weighted by that objective's
    tokens). The rl objective's keep their names (clip_fraction, ...); another's are prefixed with
    it ("sft/nll"). loss, num_tokens and num_sequences are the step's: the objectives' losses
    weighted by `weights` (their shares of the step's groups), the counts added up; with more than
    one objective each also keeps its own under its prefix ("rl/loss", "sft/loss").
    """
    by_objective: dict[str, list[dict[str, float]]] = {}
    for metrics in micro_batch_metrics:
        for objective, values in metrics.items():
            by_objective.setdefault(objective, []).append(values)
    merged = {objective: merge_metrics(values) for objective, values in by_objective.items()}
    flat: dict[str, float] = {}
    for objective, values in merged.items():
        for key, value in values.items():
            if objective != "rl" or (len(merged) > 1 and key in _STEP_TOTALS):
                flat[f"{objective}/{key}"] = value
            if objective == "rl":
                flat[key] = value
    flat["loss"] = sum(weights[o] * values.get("loss", 0.0) for o, values in merged.items())
    for key in _STEP_TOTALS[1:]:
        flat[key] = float(sum(values.get(key, 0.0) for values in merged.values()))
    return flat


_STEP_TOTALS = ("loss", "num_tokens", "num_sequences")


class MetricsLog:
    """Appends each step's metrics to `{directory}/metrics.jsonl` and TensorBoard event files in
    `{directory}/tensorboard/` (a resumed run appends; TensorBoard orders the points by step), and
    logs them to `trackers` (trainer.trackers: W&B or your own)."""

    def __init__(self, directory: Path, trackers: Trackers | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self._trackers = trackers or Trackers([])

        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / METRICS_FILE
        self._file = self.path.open("a")
        self._tensorboard = SummaryWriter(str(directory / TENSORBOARD_DIR))

    def write(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """Log step `step`'s metrics; returns the row written to metrics.jsonl."""
        # The wall time goes to the JSON line only: readers measure rates with it.
        row = {"step": step, **metrics, "time": time.time()}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        for name, value in metrics.items():
            self._tensorboard.add_scalar(f"train/{name}", value, step)
        self._tensorboard.flush()
        self._trackers.log(metrics, step)
        return row

    def close(self) -> None:
        self._file.close()
        self._tensorboard.close()
        self._trackers.close()


def read_metrics(directory: Path) -> list[dict[str, float]]:
    """Every step's metrics written to `directory`, in file order ([] when there are none)."""
    path = directory / METRICS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
