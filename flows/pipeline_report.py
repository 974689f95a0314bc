"""What the pipeline shows while it runs and after: the trainer's steps as it publishes their
metrics to the run's storage, a progress line per step, the evaluation curve, and the run's summary."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from storage.progress import read_step_metrics
from trainer.metrics import TENSORBOARD_DIR

# The per-step table's columns (what a person watches in a run), then the rest as logged.
TABLE_COLUMNS = (
    "step",
    "score_mean",
    "sft/nll",
    "loss",
    "policy_version",
    "staleness_mean",
    "staleness_max",
    "stale_groups_skipped",
    "utilization",
    "idle_fraction",
    "groups",
    "groups_per_s",
    "tokens_per_s",
    "reload_s",
    "step_time_s",
    "data_wait_s",
)
PIPELINE_LOG = "pipeline.jsonl"


class StepLog:
    """The trainer's steps as it finishes them, each step's metrics row read from the run's storage
    (storage.progress.read_step_metrics): the trainer runs in another process, maybe on other hosts."""

    WINDOW = 10

    def __init__(self, storage: str, run: str, *, after_step: int = 0, since: float | None = None):
        """Rows of steps after `after_step` (a resumed run's old steps are not this run's) written
        at or after `since` (a row an earlier trainer wrote for a step this one trains again is
        waited for until this one writes it; None: now)."""
        self.storage, self.run = storage, run
        self.next_step = after_step + 1
        self.since = time.time() if since is None else since
        self.rows: list[dict[str, float]] = []

    @property
    def last_step(self) -> int:
        return int(self.rows[-1]["step"]) if self.rows else 0

    def new(self) -> list[dict[str, float]]:
        """Steps written since the last call, in step order (a read per step, and one that finds none)."""
        rows = []
        while (row := read_step_metrics(self.storage, self.run, self.next_step)) is not None and row[
            "time"
        ] >= self.since:
            # Groups per second of wall time over the last WINDOW steps.
            window = self.rows[-self.WINDOW :]
            if window and row["time"] > window[0]["time"]:
                consumed = row.get("groups_consumed", 0) - window[0].get("groups_consumed", 0)
                row["groups_per_s"] = consumed / (row["time"] - window[0]["time"])
            self.rows.append(row)
            rows.append(row)
            self.next_step += 1
        return rows

    def table(self, reloads: dict[int, float] | None = None) -> list[dict[str, Any]]:
        """One row per step, newest first, the columns a person watches (TABLE_COLUMNS: every metric
        stays in metrics.jsonl and TensorBoard) rounded to 4 significant digits; `reloads` (version
        -> seconds) adds the reload of the checkpoint the step published."""
        rows = [{**row, "reload_s": (reloads or {}).get(int(row["step"]))} for row in reversed(self.rows)]
        columns = [c for c in TABLE_COLUMNS if any(row.get(c) is not None for row in rows)]
        return [{name: significant(row.get(name)) for name in columns} for row in rows]

    def seconds_per_step(self) -> float | None:
        """Wall time per step over the last WINDOW steps (None before two steps)."""
        window = self.rows[-self.WINDOW :]
        if len(window) < 2:
            return None
        return (window[-1]["time"] - window[0]["time"]) / (window[-1]["step"] - window[0]["step"] or 1)

    def staleness_histogram(self) -> dict[str, float]:
        """Trained groups by how many versions behind the trained policy they were sampled."""
        histogram: dict[str, float] = {}
        for row in self.rows:
            for key, value in row.items():
                if key.startswith("staleness/"):
                    lag = key.split("/", 1)[1]
                    histogram[lag] = histogram.get(lag, 0) + value
        return dict(sorted(histogram.items(), key=lambda item: int(item[0])))

    def summary(self) -> dict[str, Any]:
        """Over the whole run: utilization and idle fraction (the trainer's own running totals),
        the staleness of what was trained, and the speed."""
        if not self.rows:
            return {}
        last = self.rows[-1]
        seconds = last["time"] - self.rows[0]["time"]
        return {
            "utilization": last.get("utilization"),
            "idle_fraction": last.get("idle_fraction"),
            "staleness_histogram": self.staleness_histogram(),
            "stale_groups_skipped": sum(r.get("stale_groups_skipped", 0) for r in self.rows),
            "groups_per_s": (last.get("groups_consumed", 0) - self.rows[0].get("groups_consumed", 0)) / seconds
            if seconds > 0
            else None,
            "tokens_per_s": sum(r.get("tokens", 0) for r in self.rows)
            / sum(r.get("step_time_s", 0) for r in self.rows),
        }


def significant(value: Any, digits: int = 4) -> Any:
    """A float to `digits` significant digits (integers and None as they are)."""
    if isinstance(value, float) and math.isfinite(value) and value != 0:
        return round(value, digits - 1 - math.floor(math.log10(abs(value))))
    return value


def staleness_table(histogram: dict[str, float]) -> list[dict[str, Any]]:
    """The staleness histogram as a Prefect table: versions behind, groups, share of the trained."""
    total = sum(histogram.values()) or 1.0
    return [
        {"versions_behind": int(lag), "groups": int(count), "share": round(count / total, 4)}
        for lag, count in histogram.items()
    ]


class PipelineLog:
    """What the pipeline measures itself, beside the trainer's steps: each reload (seconds from the
    watcher finding a checkpoint to every server serving it, parity check included) and each
    evaluation, as JSON lines in `{work_dir}/pipeline.jsonl` and TensorBoard scalars
    (`pipeline/reload_s`, `eval/reward`) next to the trainer's."""

    def __init__(self, work_dir: Path, on_event: Callable[[dict[str, Any]], None] | None = None):
        """`on_event` is also called with every row (the pipeline emits each as a Prefect event)."""
        from torch.utils.tensorboard import SummaryWriter

        work_dir.mkdir(parents=True, exist_ok=True)
        self.on_event = on_event
        self._file = (work_dir / PIPELINE_LOG).open("a")
        self._tensorboard = SummaryWriter(str(work_dir / TENSORBOARD_DIR))
        self.reload_s: dict[int, float] = {}

    def _write(self, row: dict[str, Any], scalars: dict[str, float] | None = None, step: int = 0) -> None:
        self._file.write(json.dumps({**row, "time": time.time()}) + "\n")
        self._file.flush()
        if self.on_event is not None:
            self.on_event(row)
        if not scalars:
            return
        for name, value in scalars.items():
            self._tensorboard.add_scalar(name, value, step)
        self._tensorboard.flush()

    async def reloads(self, outcomes: list[Any]) -> None:
        """The watcher's `on_outcomes`: the slowest server's reload time for each version."""
        for outcome in outcomes:
            if outcome.status == "reloaded" and outcome.total_s is not None:
                seconds = max(self.reload_s.get(outcome.version, 0.0), outcome.total_s)
                self.reload_s[outcome.version] = seconds
                row = {
                    "event": "reload",
                    "version": outcome.version,
                    "server": outcome.base_url,
                    "reload_s": outcome.total_s,
                    "fetch_s": outcome.fetch_s,
                    "swap_s": outcome.swap_s,
                    "parity_s": outcome.parity_s,
                }
                self._write(row, {"pipeline/reload_s": seconds}, outcome.version)
            elif outcome.status == "rejected":
                self._write(
                    {
                        "event": "reload_rejected",
                        "server": outcome.base_url,
                        "serving": outcome.version,
                        "reason": outcome.detail,
                    }
                )

    def phase(self, name: str, end_step: int) -> None:
        """A phase begins: its trainer and rollout flows start now."""
        self._write({"event": "phase", "phase": name, "end_step": end_step})

    def evaluation(self, row: dict[str, Any]) -> None:
        self._write({"event": "evaluation", **row}, {"eval/reward": row["reward"]}, row["step"])

    def summary(self) -> dict[str, float]:
        if not self.reload_s:
            return {}
        values = sorted(self.reload_s.values())
        return {"reloads": len(values), "reload_s_median": values[len(values) // 2], "reload_s_max": values[-1]}

    def close(self) -> None:
        self._file.close()
        self._tensorboard.close()


def progress_line(
    phase: str, metrics: dict[str, float], seconds: float, total_steps: int, seconds_per_step: float | None = None
) -> str:
    """One line per step: where the run is (step of total, time so far and left), the reward, the
    served policy, and how busy the trainer and samplers are."""
    reward = metrics.get("score_mean")
    shown = f"reward {reward:.3f}" if reward is not None else f"sft nll {metrics.get('sft/nll', float('nan')):.3f}"
    left = total_steps - metrics["step"]
    eta = f", ~{seconds_per_step * left / 60:.1f} min left at most" if seconds_per_step and left > 0 else ""
    return (
        f"[{phase}] step {metrics['step']:.0f}/{total_steps} {shown} policy v{metrics.get('policy_version', 0):.0f} "
        f"utilization {metrics.get('utilization', 0):.2f} idle {metrics.get('idle_fraction', 0):.2f} "
        f"groups/s {metrics.get('groups_per_s', 0):.2f} ({seconds / 60:.1f} min{eta})"
    )


class Curve:
    """The evaluation curve: one row per evaluated version, the same greedy measure in every phase."""

    def __init__(self):
        self.rows: list[dict[str, Any]] = []
        self.changed = asyncio.Event()
        # The best evaluated checkpoint, {"step", "reward", "checkpoint"}, once one is marked
        # (storage.checkpoints.mark_best: kept by retention).
        self.best: dict[str, Any] | None = None

    def describe_best(self) -> str:
        best = self.best
        return (
            "no checkpoint evaluated yet"
            if best is None
            else f"best: step {best['step']} (held-out {best['reward']:.3f})"
        )

    def add(self, phase: str, step: int, reward: float, minutes: float, **measured: Any) -> dict[str, Any]:
        """An evaluation of version `step`; `measured`: what else it measured (items, seconds)."""
        row = {"phase": phase, "step": step, "reward": reward, "minutes": round(minutes, 3), **measured}
        self.rows.append(row)
        self.changed.set()
        return row

    async def wait_for(self, step: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(row["step"] >= step for row in self.rows) and time.monotonic() < deadline:
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                break


def report_markdown(run: str, curve: Curve, summary: dict[str, Any]) -> str:
    lines = [
        f"# Pipeline run `{run}`",
        "",
        f"{summary.get('steps', 0)} steps in {summary.get('minutes', 0):.1f} minutes.",
        "",
    ]
    for name in (
        "sample_utilization",
        "utilization",
        "idle_fraction",
        "groups_per_s",
        "tokens_per_s",
        "reload_s_median",
    ):
        if summary.get(name) is not None:
            lines.append(f"- {name}: {summary[name]:.3g}")
    if summary.get("staleness_histogram"):
        histogram = summary["staleness_histogram"]
        total = sum(histogram.values()) or 1
        shares = ", ".join(
            f"{lag} behind: {count:.0f} ({100 * count / total:.0f}%)" for lag, count in histogram.items()
        )
        lines.append(f"- trained groups by how many policy versions behind their samples were: {shares}")
    if curve.best is not None:
        lines.append(
            f"- {curve.describe_best()}, kept as `{curve.best['checkpoint']}` (`checkpoints/BEST`; "
            "`clotho evaluate --checkpoint BEST --run RUN`)"
        )
    if curve.rows:
        lines += ["", "| phase | step | reward (greedy, held out) | minutes |", "|---|---|---|---|"]
        lines += [f"| {r['phase']} | {r['step']} | {r['reward']:.3f} | {r['minutes']:.1f} |" for r in curve.rows]
    if completions := summary.get("completions"):
        from flows.completions import completions_markdown

        lines += ["", *completions_markdown(completions["first"], "Sampled completions: the first group stored")]
        lines += completions_markdown(completions["last"], "Sampled completions: the last group stored")
    return "\n".join(lines)
