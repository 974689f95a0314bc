"""Per-step training metrics: one JSON line per step and TensorBoard scalars, both under work_dir."""

from __future__ import annotations

import json
from pathlib import Path

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


class MetricsLog:
    """Appends each step's metrics to `{directory}/metrics.jsonl` and TensorBoard event files in
    `{directory}/tensorboard/` (a resumed run appends; TensorBoard orders the points by step)."""

    def __init__(self, directory: Path):
        from torch.utils.tensorboard import SummaryWriter

        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / METRICS_FILE
        self._file = self.path.open("a")
        self._tensorboard = SummaryWriter(str(directory / TENSORBOARD_DIR))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()
        for name, value in metrics.items():
            self._tensorboard.add_scalar(f"train/{name}", value, step)
        self._tensorboard.flush()

    def close(self) -> None:
        self._file.close()
        self._tensorboard.close()


def read_metrics(directory: Path) -> list[dict[str, float]]:
    """Every step's metrics written to `directory`, in file order ([] when there are none)."""
    path = directory / METRICS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
