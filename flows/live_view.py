"""What the Prefect UI shows of a pipeline run while it goes: its effective config, each reload,
evaluation and phase as an event, and the live card: one markdown artifact per run (key
`pipeline-RUN-live`), created when the run starts and updated in place (not a new version per step)
at most every LIVE_INTERVAL_S while steps land, and once more at the end. The card holds what a
person watching a run looks for: where the run is and how long it has left, the policy version the
servers serve and its reload time, throughput and staleness, the reward over steps as a chart, the
latest steps newest first, a few sampled completions of the newest group with their scores and
the held-out evaluations, every number rounded."""

from __future__ import annotations

import asyncio
import functools
import math
import time
from pathlib import Path
from typing import Any

from prefect.artifacts import acreate_markdown_artifact, acreate_progress_artifact, aupdate_progress_artifact
from prefect.events import emit_event

from flows.artifacts import Card, artifact_key
from flows.completions import LatestCompletions, completions_markdown
from flows.pipeline_config import Phase, PipelineConfig
from flows.pipeline_report import Curve, PipelineLog, StepLog, progress_line, staleness_table
from storage.layout import split_run_url
from storage.progress import read_trainer_position

LIVE_INTERVAL_S = 5.0
LATEST_STEPS = 10
CHART_WIDTH, CHART_HEIGHT = 60, 10
# The latest-steps table: (column, metric), the first metric of a column the step has.
STEP_COLUMNS = (
    ("step", ("step",)),
    ("reward", ("score_mean",)),
    ("sft nll", ("sft/nll",)),
    ("loss", ("loss",)),
    ("policy", ("policy_version",)),
    ("staleness max", ("staleness_max",)),
    ("groups/s", ("groups_per_s",)),
    ("tokens", ("tokens",)),
    ("step s", ("step_time_s",)),
    ("data wait s", ("data_wait_s",)),
)


def rounded(value: Any) -> str:
    """4 significant digits, integers as integers, None as a dash."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, int) or float(value).is_integer() and abs(value) < 1e6:
        return str(int(value))
    return f"{value:.4g}"


def text_chart(
    series: dict[str, tuple[str, list[tuple[float, float]]]], width: int = CHART_WIDTH, height: int = CHART_HEIGHT
) -> str:
    """A line chart in text (it renders in every Prefect UI and in the API's JSON): each series is
    (mark, [(x, y), ...]); x spans the width, y the height, later series drawn over earlier ones."""
    points = [point for _, values in series.values() for point in values]
    if not points:
        return "(no values yet)"
    xs, ys = [x for x, _ in points], [y for _, y in points]
    x_low, x_high = min(xs), max(xs)
    y_low, y_high = min(min(ys), 0.0), max(max(ys), 1e-9)
    grid = [[" "] * width for _ in range(height)]
    for mark, values in series.values():
        for x, y in values:
            column = round((x - x_low) / (x_high - x_low) * (width - 1)) if x_high > x_low else 0
            row = round((y - y_low) / (y_high - y_low) * (height - 1))
            grid[height - 1 - row][column] = mark
    labels = [f"{y_high - (y_high - y_low) * i / (height - 1):.2f}" for i in range(height)]
    pad = max(len(label) for label in labels)
    lines = [f"{label:>{pad}} ┤{''.join(cells)}" for label, cells in zip(labels, grid)]
    lines.append(" " * pad + " └" + "─" * width)
    start, end = f"step {x_low:.0f}", f"step {x_high:.0f}"
    lines.append(" " * (pad + 2) + start + end.rjust(width - len(start)))
    lines.append(" " * (pad + 2) + "   ".join(f"{mark} {name}" for name, (mark, _) in series.items()))
    return "\n".join(lines)


def live_markdown(
    run: str,
    phase: str,
    total_steps: int,
    steps: list[dict[str, Any]],
    curve: list[dict[str, Any]],
    reload_s: dict[int, float],
    elapsed_s: float,
    staleness: dict[str, float],
    seconds_per_step: float | None = None,
    finished: bool = False,
    best: dict[str, Any] | None = None,
    completions: list[dict[str, Any]] | None = None,
) -> str:
    """The card's text for the run so far: `steps` are the trainer's metrics rows, `curve` the
    held-out evaluations, `reload_s` the reload time of each served version, `seconds_per_step`
    the recent pace (StepLog.seconds_per_step), `best` the best evaluated checkpoint (Curve.best),
    `completions` a few sampled completions of the newest group (flows.completions)."""
    step = int(steps[-1]["step"]) if steps else 0
    state = "finished" if finished else "running"
    head = [f"# Run `{run}`: {state}", ""]
    facts = [f"**{phase}** phase, step **{step}** of {total_steps} ({100 * step / max(total_steps, 1):.0f}%)"]
    facts.append(f"{elapsed_s / 60:.1f} min elapsed")
    if seconds_per_step and not finished and step < total_steps:
        facts.append(
            f"at most ~{seconds_per_step * (total_steps - step) / 60:.1f} min left at {seconds_per_step:.2f} s a step"
        )
    if reload_s:
        version = max(reload_s)
        facts.append(f"servers serve policy **v{version}** (reloaded in {reload_s[version]:.2f} s)")
    if steps and steps[-1].get("groups_per_s") is not None:
        facts.append(f"{steps[-1]['groups_per_s']:.2f} groups/s trained")
    if best is not None:
        facts.append(
            f"best checkpoint **step {best['step']}** (held-out {best['reward']:.3f}, kept as checkpoints/BEST)"
        )
    total = sum(staleness.values())
    if total:
        facts.append(
            "staleness of trained groups: "
            + ", ".join(f"{lag} behind {100 * count / total:.0f}%" for lag, count in staleness.items())
        )
    lines = head + [" · ".join(facts), "", "## Reward over steps", "", "```text"]
    trained = [(row["step"], row["score_mean"]) for row in steps if row.get("score_mean") is not None]
    held_out = [(row["step"], row["reward"]) for row in curve]
    lines += [
        text_chart({"training reward (sampled)": ("·", trained), "held-out reward (greedy)": ("o", held_out)}),
        "```",
        "",
    ]
    losses = [(row["step"], row["loss"]) for row in steps if row.get("loss") is not None]
    if losses:
        lines += [
            "## Loss over steps",
            "",
            "```text",
            text_chart({"loss": ("·", losses)}, height=CHART_HEIGHT // 2),
            "```",
            "",
        ]
    shown = [(name, metrics) for name, metrics in STEP_COLUMNS if any(m in row for row in steps for m in metrics)]
    if steps:
        lines += [f"## Latest {min(LATEST_STEPS, len(steps))} steps, newest first", ""]
        lines += ["| " + " | ".join(name for name, _ in shown) + " |", "|" + "---|" * len(shown)]
        for row in reversed(steps[-LATEST_STEPS:]):
            cells = [rounded(next((row[m] for m in metrics if m in row), None)) for _, metrics in shown]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    lines += completions_markdown(completions or [], "Latest sampled completions (the newest group stored)")
    lines += [
        f"Scores and failures by reason per environment, as groups land: artifact `{artifact_key('rollout-env-stats', run)}`.",
        "",
    ]
    if curve:
        lines += [
            "## Held-out evaluations, newest first",
            "",
            "| version | phase | reward | minutes |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {row['step']} | {row['phase']} | {rounded(row['reward'])} | {row['minutes']:.1f} |"
            for row in reversed(curve)
        ]
    return "\n".join(lines)


def emit_pipeline_event(run: str, row: dict[str, Any]) -> None:
    """A reload, an evaluation or a phase's start as a Prefect event (`clotho.pipeline.reload`, ...)
    about the run, in the UI's event feed beside the flow run's own (emitted in the flow run, so
    related to it)."""
    emit_event(
        event=f"clotho.pipeline.{row['event']}",
        resource={"prefect.resource.id": f"clotho.run.{run}", "prefect.resource.name": run},
        payload=row,
    )


def config_markdown(config: PipelineConfig, path: str | None, overrides: list[str] | None) -> str:
    """The config the run uses, every default filled in, as YAML: the flow run's parameters show
    only the file's path and the overrides."""
    import yaml

    source = (
        f"`{path}`" + (f" with `{' '.join(f'--set {o}' for o in overrides)}`" if overrides else "")
        if path
        else "a dict"
    )
    return f"# Effective config\n\nFrom {source}.\n\n```yaml\n{yaml.safe_dump(config.model_dump(mode='json'), sort_keys=False)}```\n"


class RunView:
    """A pipeline run as the Prefect UI shows it while it goes: the trainer's steps (StepLog), the
    held-out curve, the reloads, evaluations and phases (PipelineLog, each also an event), a progress
    artifact, the live card, and the step and staleness tables, each one artifact updated in place."""

    def __init__(self, config: PipelineConfig, run: str, work_dir: Path):
        """`work_dir`: where the pipeline writes its own log (pipeline.jsonl, TensorBoard)."""
        self.config, self.run = config, run
        self.key = artifact_key("pipeline", run)
        self.started = time.monotonic()
        storage, run_name = split_run_url(config.run)
        position = read_trainer_position(storage, run_name)
        self.steps = StepLog(storage, run_name, after_step=position.steps if position else 0)
        self.curve = Curve()
        self.completions = LatestCompletions(storage, run_name, interval_s=LIVE_INTERVAL_S)
        self.measured = PipelineLog(work_dir, on_event=functools.partial(emit_pipeline_event, run))
        self.live = Card(
            "markdown",
            f"{self.key}-live",
            f"Run {run} as it goes: reward chart, latest steps, served version",
            interval_s=LIVE_INTERVAL_S,
        )
        self.metrics_card = Card("table", f"{self.key}-metrics", f"Trainer metrics of run {run}, newest step first")
        self.staleness_card = Card(
            "table",
            f"{self.key}-staleness",
            f"Trained groups of run {run} by how many policy versions old their samples were (max_lag {config.max_lag})",
        )
        self.phase = config.phases[0].name
        self.progress = None
        self.shown_version: int | None = None  # the served version the live card last showed

    def minutes(self) -> float:
        return (time.monotonic() - self.started) / 60

    async def open(self, config_path: str | None, overrides: list[str] | None) -> None:
        """The progress bar, the effective config and the live card, there from the start."""
        self.progress = await acreate_progress_artifact(
            0.0, key=f"{self.key}-progress", description=f"steps of {self.config.total_steps}"
        )
        await acreate_markdown_artifact(
            config_markdown(self.config, config_path, overrides),
            key=f"{self.key}-config",
            description=f"Run {self.run}: the effective config, overrides applied",
        )
        await self.show_live()

    async def show_live(self, finished: bool = False) -> None:
        """The live card, at most every LIVE_INTERVAL_S; at once when the servers serve a new
        version (a reload is what a person watching waits for) and at the end."""
        served = max(self.measured.reload_s, default=None)
        await asyncio.to_thread(self.completions.update, finished)  # reads storage, at most every interval

        def markdown() -> str:  # built only when the card is due an update
            steps = self.steps
            self.shown_version = served
            return live_markdown(
                self.run,
                self.phase,
                self.config.total_steps,
                steps.rows,
                self.curve.rows,
                self.measured.reload_s,
                time.monotonic() - self.started,
                steps.staleness_histogram(),
                steps.seconds_per_step(),
                finished,
                self.curve.best,
                self.completions.latest,
            )

        await self.live.show(markdown, force=finished or served != self.shown_version)

    async def show_new_steps(self, phase: Phase, log) -> None:
        """The trainer's new steps: a log line each, the progress bar, the live card."""
        self.phase = phase.name
        for metrics in await asyncio.to_thread(self.steps.new):  # reads storage (retried for up to a minute)
            log.info(
                progress_line(
                    phase.name,
                    metrics,
                    time.monotonic() - self.started,
                    self.config.total_steps,
                    self.steps.seconds_per_step(),
                )
            )
            await aupdate_progress_artifact(self.progress, 100.0 * metrics["step"] / self.config.total_steps)
        await self.show_live()

    async def show_tables(self) -> None:
        """The step table and the staleness histogram, each one card replaced in place."""
        await self.metrics_card.show(self.steps.table(self.measured.reload_s))
        if histogram := self.steps.staleness_histogram():
            await self.staleness_card.show(staleness_table(histogram))

    async def close(self) -> None:
        await aupdate_progress_artifact(self.progress, 100.0)
        await self.show_tables()  # with the last reloads
        await self.show_live(finished=True)
