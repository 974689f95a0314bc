"""The reload-watcher flow: keep policy servers at a run's newest verified checkpoint, under Prefect."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import acreate_table_artifact

from flows.artifacts import artifact_key
from inference.parity_guard import ParityGuard
from inference.reload import ServedPolicy
from inference.watcher import ReloadOutcome, ReloadWatcher
from storage.layout import split_run_url
from tasks.api_key import resolve_api_key


@flow(name="reload-watcher")
async def reload_watcher(
    run_url: str,
    servers: list[str],
    base_model: str,
    api_key_secret: str | None = None,
    served_model_name: str = "policy",
    dtype: str = "float32",
    poll_s: float = 5.0,
    max_polls: int | None = None,
    cache_dir: str = ".clotho/reload-cache",
) -> list[dict[str, Any]]:
    """Follows `run_url` (STORAGE_URL/RUN) and hot-reloads every server onto each STABLE checkpoint.

    No tasks: the flow is one long loop, so its memory stays flat however long it runs (Prefect keeps
    per-task state for a flow's life). Each poll that reloads, rejects or fails something updates a
    table artifact `reload-<run>`; max_polls=None runs until cancelled. Servers started with
    --api-key: api_key_secret names a Prefect Secret block holding the key (else $CLOTHO_API_KEY).
    """
    log = get_run_logger()
    api_key = await resolve_api_key(api_key_secret)
    _, run = split_run_url(run_url)
    key = artifact_key("reload", run)
    guard = ParityGuard.for_model(base_model, dtype=dtype, model_name=served_model_name)
    policies = [
        ServedPolicy(url.rstrip("/"), Path(base_model), api_key=api_key, model_name=served_model_name)
        for url in servers
    ]
    watcher = ReloadWatcher(run_url, policies, guard, cache_dir=cache_dir, poll_s=poll_s)

    async def report(outcomes: list[ReloadOutcome]) -> None:
        for outcome in outcomes:
            level = log.info if outcome.status in ("reloaded", "restored") else log.error
            level("%s: %s, serving version %d: %s", outcome.base_url, outcome.status, outcome.version, outcome.detail)
        await acreate_table_artifact(
            key=key,
            table=[asdict(outcome) for outcome in watcher.history[-20:]],
            description=f"Last reloads of {run_url}",
        )

    log.info("watching %s for %d server(s), parity tolerance %g", run_url, len(servers), guard.tolerance)
    history = await watcher.run(max_polls=max_polls, on_outcomes=report)
    return [asdict(outcome) for outcome in history]
