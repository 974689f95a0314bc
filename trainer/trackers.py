"""Experiment trackers beside the trainer's own metrics.jsonl and TensorBoard files, named by the
trainer config's `report_to` (as in transformers and TRL):

    trainer:
      report_to: [wandb]                          # pip install wandb; WANDB_PROJECT, WANDB_MODE, ... as usual
      report_to: [my_package.tracking:Tracker]    # your own class, see Tracker

A tracker gets each step's metrics once, on rank 0, named `train/NAME` as in TensorBoard. The
JSONL file stays the record: a tracker that fails to log is warned about once and the run goes on.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import uuid
from pathlib import Path
from typing import Any, Protocol

from core.imports import load_attribute

log = logging.getLogger(__name__)

BUILT_IN = {"wandb": ("wandb", "trainer.trackers:WandbTracker")}  # name: (package it needs, class)


class Tracker(Protocol):
    """`Tracker(run=..., config=..., directory=...)`: `run` the run's name, `config` the trainer
    config as JSON-ready values, `directory` the trainer's work dir (for files the tracker keeps)."""

    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def check_report_to(names: list[str]) -> list[str]:
    """Each name is a built-in tracker whose package is installed, or an importable module:Class;
    the error names the entry and the fix."""
    for name in names:
        if name in BUILT_IN:
            package = BUILT_IN[name][0]
            if importlib.util.find_spec(package) is None:
                raise ValueError(
                    f"'{name}' needs the {package} package, not installed here; pip install {package} (or drop it from report_to)"
                )
        elif ":" in name:
            _load(name)
        else:
            raise ValueError(
                f"'{name}' is neither a built-in tracker ({', '.join(BUILT_IN)}) nor module:Class of your own"
            )
    return names


def _load(path: str) -> type:
    tracker = load_attribute(path, "report_to")
    if not callable(tracker):
        raise ValueError(f"report_to: {path!r} is not a class")
    return tracker


def open_trackers(names: list[str], *, run: str, config: dict[str, Any], directory: Path) -> Trackers:
    return Trackers(
        [_load(BUILT_IN.get(name, (None, name))[1])(run=run, config=config, directory=directory) for name in names]
    )


class Trackers:
    """The run's trackers, each step's metrics logged to every one."""

    def __init__(self, trackers: list[Tracker]):
        self._trackers = trackers
        self._failed: set[int] = set()

    def log(self, metrics: dict[str, float], step: int) -> None:
        named = {f"train/{name}": value for name, value in metrics.items()}
        for index, tracker in enumerate(self._trackers):
            try:
                tracker.log(named, step)
            except Exception as error:  # noqa: BLE001 - the JSONL and TensorBoard files have the step
                if index not in self._failed:
                    log.warning(
                        "tracker %s failed to log step %d (%s); the run goes on, metrics.jsonl has every step",
                        type(tracker).__name__,
                        step,
                        error,
                    )
                self._failed.add(index)

    def close(self) -> None:
        for tracker in self._trackers:
            tracker.close()


class WandbTracker:
    """Weights & Biases: one W&B run per clotho run, continued when the trainer resumes or starts
    the next phase (its id is kept in the work dir). Project from WANDB_PROJECT (default clotho);
    WANDB_MODE=offline writes it locally for `wandb sync` later."""

    ID_FILE = "wandb-run-id"

    def __init__(self, *, run: str, config: dict[str, Any], directory: Path):
        import wandb

        id_file = directory / self.ID_FILE
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id)
        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "clotho"),
            name=run,
            id=run_id,
            resume="allow",
            config=config,
            dir=str(directory),
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._run.log(metrics, step=step)

    def close(self) -> None:
        self._run.finish()
