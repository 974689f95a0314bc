"""The `evaluate` flow: one checkpoint, one environment's held-out items, a result kept beside it.

    clotho evaluate --env NAME --checkpoint STEP_URL            a published step
    clotho evaluate --env NAME --checkpoint LATEST --run RUN    the run's newest
    clotho evaluate --env NAME --checkpoint BEST --run RUN      the run's best evaluated (checkpoints/BEST)
                    [--server URL]                              a running server serving that version

Without --server it serves the checkpoint with vLLM itself (the same server as training uses) and
stops it after; with --server it first checks that the server announces the checkpoint's version
(a hot-reloaded server does), so a result never belongs to other weights than it says. Runs the
environment's `evaluate` (greedy, held-out items: Environment.evaluate) and writes the report to
`{step}/evaluation-{env}.json` (deleted with the step by retention) and a table artifact
`evaluation-{run}`. An evaluation already written for that step and environment is not run again,
so a schedule that evaluates LATEST every few minutes evaluates each new checkpoint once.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
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


async def evaluate_on(
    url: str, api_key: str | None, env: str, env_config: dict[str, Any], tokenizer: str, items: int
) -> dict[str, float]:
    async with PolicyClient(url, api_key=api_key) as client:
        environment = await evaluated_environment(env, env_config, client, tokenizer)
        return await environment.evaluate(num_items=items)


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
    if server is not None:
        served = asyncio.run(_served_version(server, api_key))
        if served != info.policy_version:
            raise EvaluationError(
                f"--server {server} serves version {served}, not {info.policy_version} ({info.url}); reload it onto "
                "the checkpoint (clotho watch) or leave --server out to serve the checkpoint here"
            )
        report = asyncio.run(evaluate_on(server, api_key, env, env_config or {}, str(local), items))
    else:
        from inference.server import PolicyServer

        with PolicyServer(local, max_model_len=2048) as policy:
            report = asyncio.run(evaluate_on(policy.base_url, None, env, env_config or {}, str(local), items))
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


async def _served_version(server: str, api_key: str | None) -> int:
    async with PolicyClient(server, api_key=api_key) as client:
        return await client.weight_version()
