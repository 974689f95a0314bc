"""A tracker of an outside author's (report_to: [tests.trainer.recording_tracker:Recorder]): each
call it gets, one JSON line in its directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class Recorder:
    def __init__(self, *, run: str, config: dict[str, Any], directory: Path):
        self._file = (directory / "recorded.jsonl").open("a")
        self._write({"call": "init", "run": run, "lr": config["lr"]})

    def _write(self, row: dict[str, Any]) -> None:
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._write({"call": "log", "step": step, **metrics})

    def close(self) -> None:
        self._write({"call": "close"})
        self._file.close()
