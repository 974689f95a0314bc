"""The `evaluate` flow: one checkpoint, one environment's held-out items, a result kept beside it.

    clotho evaluate --env NAME --checkpoint STEP_URL            a published step
    clotho evaluate --env NAME --checkpoint LATEST --run RUN    the run's newest
    clotho evaluate --env NAME --checkpoint BEST --run RUN      the run's best evaluated (checkpoints/BEST)
                    [--server URL]                              a running server serving that version

Without --server it serves the checkpoint with vLLM itself (the same server as training uses) and
stops it after; with --server it checks that the server announces the checkpoint's version (a
hot-reloaded server does) and that every answer was sampled by it (evaluate_version, the one
evaluator), so a result never belongs to other weights than it says. Runs the
environment's `evaluate` (greedy, held-out items: Environment.evaluate) and writes the report to
`{step}/evaluation-{env}.json` (deleted with the step by retention) and a table artifact
`evaluation-{run}`. An evaluation already written for that step and environment is not run again,
so a schedule that evaluates LATEST every few minutes evaluates each new checkpoint once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact

from flows.artifacts import artifact_key
from inference.client import PolicyClient
from storage.checkpoints import (
    CheckpointError,
    CheckpointInfo,
    best_checkpoint,
    fetch_checkpoint,
    latest_checkpoint,
    read_checkpoint,
)
from storage.filesystem import resolve, storage_errors
from storage.layout import join, split_run_url
from tasks.api_key import API_KEY_VARIABLE


class EvaluationError(ValueError):
    """Bad evaluation input: says which and the fix."""


def result_url(checkpoint: CheckpointInfo, env: str) -> str:
    return join(checkpoint.url, f"evaluation-{re.sub(r'[^A-Za-z0-9_.-]', '_', env)}.json")


def find_checkpoint(checkpoint: str, run: str | None) -> CheckpointInfo:
    """A step URL, or LATEST / BEST of `run` (its newest, or the one its evaluator marked best)."""
    if checkpoint in ("LATEST", "BEST"):
        which = "newest" if checkpoint == "LATEST" else "best evaluated"
        if run is None:
            raise EvaluationError(
                f"--checkpoint {checkpoint} needs --run RUN_URL (whose {which} checkpoint to evaluate)"
            )
        root, name = split_run_url(run)
        try:
            info = (latest_checkpoint if checkpoint == "LATEST" else best_checkpoint)(root, name)
        except CheckpointError as error:
            raise EvaluationError(f"--checkpoint {checkpoint}: {error}") from None
        if info is None:
            raise EvaluationError(
                f"{run} has no published checkpoint yet"
                if checkpoint == "LATEST"
                else f"{run} has no best checkpoint: its pipeline marks one at each held-out evaluation that beats the "
                "ones before (a config with `evaluation:`); name a step URL or LATEST instead"
            )
        return info
    try:
        return read_checkpoint(checkpoint)
    except CheckpointError as error:
        raise EvaluationError(f"--checkpoint {checkpoint}: {error}") from None


async def evaluated_environment(env: str, env_config: dict[str, Any], client: PolicyClient, tokenizer: str) -> Any:
    """The environment `env` set up to answer through `client`: what both evaluators (this flow,
    and the pipeline's at every `evaluation.every` versions) call Environment.evaluate on."""
    from environments.loading import load_config, load_environment_class

    env_class = await asyncio.to_thread(load_environment_class, env)  # imports it
    settings = load_config(env_class, env_config)
    environment = await asyncio.to_thread(env_class, settings, client=client, tokenizer=tokenizer)  # a tokenizer
    await environment.setup()
    return environment


class VersionMoved(RuntimeError):
    """An evaluation's answers were not all sampled by the version it was to evaluate."""

    def __init__(self, version: int, sampled_by: set[int]):
        super().__init__(
            f"version {version} was evaluated, but its answers were sampled by versions {sorted(sampled_by)}"
        )
        self.version, self.sampled_by = version, sampled_by


@dataclass(frozen=True)
class Evaluation:
    version: int  # the one policy version that answered every item
    report: dict[str, float]  # Environment.evaluate's (evaluation_report)
    seconds: float  # answering time


async def evaluate_version(
    environment: Any,
    client: PolicyClient,
    items: int,
    *,
    expected: int | None = None,
    hold: contextlib.AbstractAsyncContextManager | None = None,
    on_version: Callable[[int], Awaitable[None]] | None = None,
) -> Evaluation:
    """The one evaluator (the pipeline's every `evaluation.every` versions, the `evaluate` flow's,
    `clotho evaluate`'s): the environment's held-out items answered concurrently (greedy,
    Environment.evaluate) by one policy version. `hold` (a reload watcher's) keeps the servers from
    reloading while it answers; the version is read inside it, and every answer's sampling version
    checked against it (a server that reloads itself could move under it anyway): VersionMoved
    when they differ, or when `expected` (a checkpoint's version) is not the version served.
    `on_version` is awaited with the version before any item is asked (the pipeline pins its
    checkpoint there, so retention keeps the weights this evaluation may find best)."""
    async with hold or contextlib.nullcontext():
        version = await client.weight_version()
        if expected is not None and version != expected:
            raise VersionMoved(expected, {version})
        if on_version is not None:
            await on_version(version)
        started = time.monotonic()
        report = await environment.evaluate(num_items=items)
        seconds = time.monotonic() - started
    sampled_by = {int(report.get("policy_version_first", version)), int(report.get("policy_version_last", version))}
    if sampled_by != {version}:
        raise VersionMoved(version, sampled_by)
    return Evaluation(version, report, seconds)


async def evaluate_on(
    url: str,
    api_key: str | None,
    env: str,
    env_config: dict[str, Any],
    tokenizer: str,
    items: int,
    expected: int | None,
) -> dict[str, float]:
    async with PolicyClient(url, api_key=api_key) as client:
        environment = await evaluated_environment(env, env_config, client, tokenizer)
        return (await evaluate_version(environment, client, items, expected=expected)).report


@flow(name="evaluate")
def evaluate(
    env: str,
    checkpoint: str = "LATEST",
    run_url: str | None = None,
    env_config: dict[str, Any] | None = None,
    items: int = 50,
    server: str | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """Evaluate `checkpoint` (a step URL, or LATEST of `run_url`) on `env`'s held-out items; the
    result (also at `{step}/evaluation-{env}.json`). A `server` started with --api-key: the key
    comes from the worker's CLOTHO_API_KEY, never a parameter (parameters show in the UI)."""
    logger = get_run_logger()
    api_key = os.environ.get(API_KEY_VARIABLE) or None
    info = find_checkpoint(checkpoint, run_url)
    target = result_url(info, env)
    fs, path = resolve(target)
    with storage_errors(target):
        if not force and fs.exists(path):
            logger.info("%s was already evaluated on %s: %s", info.url, env, target)
            return json.loads(fs.cat_file(path))
    local = fetch_checkpoint(info, Path(".clotho/evaluate-cache"))
    started = time.monotonic()
    version = info.policy_version
    if server is not None:
        try:
            report = asyncio.run(evaluate_on(server, api_key, env, env_config or {}, str(local), items, version))
        except VersionMoved as moved:
            raise EvaluationError(
                f"--server {server} serves version {', '.join(map(str, sorted(moved.sampled_by)))}, not {version} "
                f"({info.url}); reload it "
                "onto the checkpoint (clotho watch) and keep it there, or leave --server out to serve the checkpoint here"
            ) from None
    else:
        from inference.server import PolicyServer

        with PolicyServer(local, max_model_len=2048) as policy:
            # Its own server serves the checkpoint's weights and nothing else (announced as version 0).
            report = asyncio.run(evaluate_on(policy.base_url, None, env, env_config or {}, str(local), items, None))
    result = {
        "checkpoint": info.url,
        "step": info.step,
        "policy_version": info.policy_version,
        "env": env,
        "env_config": env_config or {},
        "items": items,
        "report": report,
        "seconds": round(time.monotonic() - started, 1),
        "evaluated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    with storage_errors(target):
        fs.pipe_file(path, json.dumps(result, indent=1).encode())
    run = split_run_url(info.run_url)[1]
    create_table_artifact(
        key=artifact_key("evaluation", run),
        table=[
            {
                "step": info.step,
                "env": env,
                **{k: round(v, 4) if isinstance(v, float) else v for k, v in report.items()},
            }
        ],
        description=f"{env} on {info.url}",
    )
    logger.info("step %d on %s: %s (%s)", info.step, env, json.dumps(report), target)
    return result
