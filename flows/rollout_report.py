"""What the rollout flow shows in the Prefect UI: progress, per-env stats, shard links and events."""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    update_progress_artifact,
)
from prefect.events import emit_event

from core.scored_group import ScoredGroup
from environments.base import RolloutFailure
from flows.artifacts import Card, artifact_key, update_artifact_data


@dataclass
class RolloutStats:
    """Running totals for one environment; bounded memory however long the flow runs."""

    env: str
    groups: int = 0
    sequences: int = 0
    failures: int = 0
    tokens: int = 0
    trained_tokens: int = 0
    score_sum: float = 0.0
    score_sq_sum: float = 0.0
    last_error: str = ""
    failure_reasons: dict[str, int] = field(default_factory=dict)  # RolloutFailure.reason -> count
    recent_scores: list[float] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)  # the environment's own (Environment.metrics)

    def add(self, result: ScoredGroup | RolloutFailure) -> None:
        if isinstance(result, RolloutFailure):
            self.failures += 1
            self.failure_reasons[result.reason] = self.failure_reasons.get(result.reason, 0) + 1
            self.last_error = result.error[:300]
            return
        self.groups += 1
        for sequence in result.sequences:
            self.sequences += 1
            self.tokens += len(sequence.tokens)
            self.trained_tokens += sequence.num_trained_tokens
            self.score_sum += sequence.score
            self.score_sq_sum += sequence.score**2
        self.recent_scores = (self.recent_scores + result.scores)[-256:]

    @property
    def mean_score(self) -> float:
        return self.score_sum / self.sequences if self.sequences else 0.0

    @property
    def std_score(self) -> float:
        if not self.sequences:
            return 0.0
        return max(self.score_sq_sum / self.sequences - self.mean_score**2, 0.0) ** 0.5

    def row(self) -> dict[str, Any]:
        row = {
            "env": self.env,
            "groups": self.groups,
            "sequences": self.sequences,
            "mean score": round(self.mean_score, 4),
            "score std": round(self.std_score, 4),
            "recent mean score": round(statistics.fmean(self.recent_scores), 4) if self.recent_scores else 0.0,
            "tokens": self.tokens,
            "trained tokens": self.trained_tokens,
            "failures": self.failures,
            "failures by reason": format_reasons(self.failure_reasons),
            "last error": self.last_error,
        }
        return row | {name: value for name, value in self.metrics.items() if name not in row}


def format_reasons(counts: dict[str, int]) -> str:
    """'timeout: 2, ragged: 1': failure counts by reason, the most frequent first."""
    return ", ".join(f"{reason}: {count}" for reason, count in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


# Seconds between progress-artifact updates. Each update is an API call and an artifact event, CPU
# taken from a host that may also run the model; the UI refreshes a flow run's page every few
# seconds anyway.
PROGRESS_INTERVAL_S = 5.0


class Progress:
    """A progress artifact updated at most every PROGRESS_INTERVAL_S (each update is an API call);
    the final count is sent by close(), after the last group is stored.

    Updates come from concurrent group tasks, so they are serialized and always send the newest
    count: an older count can never land after a newer one and leave the bar behind.
    """

    def __init__(self, artifact_id, total: int | None, open_ended: str = "runs until cancelled"):
        self.artifact_id = artifact_id
        self.total = total
        self.open_ended = open_ended  # without a total: what ends the flow, shown beside the count
        self.done = 0
        self._sent: int | None = None
        self._last = 0.0
        self._lock = asyncio.Lock()

    async def update(self, done: int, force: bool = False) -> None:
        self.done = max(self.done, done)
        if self.artifact_id is None:
            return
        async with self._lock:
            due = force or time.monotonic() - self._last >= PROGRESS_INTERVAL_S
            if not due or self._sent == self.done:
                return
            self._last, sent = time.monotonic(), self.done
            if self.total:
                await update_progress_artifact(
                    self.artifact_id,
                    progress=100.0 * sent / self.total,
                    description=f"{sent} of {self.total} groups done",
                )
            else:  # no fraction to show: a count, not a bar stuck at 0%
                await update_artifact_data(self.artifact_id, self.open_ended_text(sent))
            self._sent = sent

    def open_ended_text(self, done: int) -> str:
        return f"**{done} groups done**, open-ended: {self.open_ended}"

    async def close(self) -> None:
        """Send the final count (the last update may have been throttled)."""
        await self.update(self.done, force=True)


async def progress_artifact(total: int | None, run: str, open_ended: str = "runs until cancelled") -> Progress:
    """The flow's progress card (key rollout-progress-RUN): a bar of groups done of `total`, or
    without one a count saying what ends the flow (`open_ended`), replaced in place."""
    key = artifact_key("rollout-progress", run)
    if total:
        artifact_id = await create_progress_artifact(progress=0.0, key=key, description=f"groups done of {total}")
        return Progress(artifact_id, total)
    progress = Progress(None, None, open_ended)
    progress.artifact_id = await create_markdown_artifact(
        key=key, markdown=progress.open_ended_text(0), description="groups done"
    )
    return progress


def emit_shard_event(url: str, run: str, env: str | None) -> None:
    emit_event(
        event="clotho.shard.written",
        resource={"prefect.resource.id": f"clotho.shard.{url}", "prefect.resource.name": url.rsplit("/", 1)[-1]},
        payload={"url": url, "run": run, "env": env},
    )


def failures_by_reason(stats) -> dict[str, int]:
    """Failure counts by reason summed over environments' RolloutStats."""
    total: dict[str, int] = {}
    for one in stats:
        for reason, count in one.failure_reasons.items():
            total[reason] = total.get(reason, 0) + count
    return dict(sorted(total.items()))


def stats_table(stats: dict[str, RolloutStats]) -> list[dict[str, Any]]:
    """One row per environment, every row with every column (environments' metrics differ)."""
    rows = [s.row() for s in stats.values()]
    columns = list(dict.fromkeys(column for row in rows for column in row))
    return [{column: row.get(column) for column in columns} for row in rows]


def stats_card(run: str) -> Card:
    """The per-environment table (failures by reason included), kept current while the flow runs."""
    return Card(
        "table",
        artifact_key("rollout-env-stats", run),
        f"Per-environment stats of run {run}",
        interval_s=PROGRESS_INTERVAL_S,
    )


async def publish_report(
    stats: dict[str, RolloutStats],
    shards: list[str],
    seconds: float,
    run: str,
    storage: str,
    task_runs: int = 0,
    card: Card | None = None,
) -> dict[str, Any]:
    rows = stats_table(stats)
    totals = {
        "groups": sum(s.groups for s in stats.values()),
        "failures": sum(s.failures for s in stats.values()),
        "failures_by_reason": failures_by_reason(stats.values()),
        "tokens": sum(s.tokens for s in stats.values()),
        "shards": len(shards),
        "task_runs": task_runs,
        "seconds": round(seconds, 2),
    }
    totals["groups_per_s"] = round(totals["groups"] / seconds, 3) if seconds else 0.0
    await (card or stats_card(run)).show(rows, force=True)
    links = "\n".join(f"- `{url}`" for url in shards)  # file:// and s3:// URLs: no link a browser could follow
    await create_markdown_artifact(
        key=artifact_key("rollout-shards", run),
        markdown=f"# Shards written ({len(shards)})\n\nRun `{run}` in `{storage}`\n\n{links or '(none)'}\n\n"
        f"Inspect with `clotho shards ls {storage.rstrip('/')}/{run}`",
        description=f"Shards of run {run}",
    )
    return {"totals": totals, "environments": rows, "shards": shards}
