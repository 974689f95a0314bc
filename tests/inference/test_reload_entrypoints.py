"""The watcher's entry points on a live server: `clotho watch`, `clotho serve --run`, the Prefect flow."""

import asyncio
import json
from pathlib import Path

import httpx
import pytest
import typer
from typer.testing import CliRunner

from clotho.testing.reloading import announced, next_step, perturbed_checkpoint, served_matches
from inference.cli import watch_command, watch_server
from inference.reload import ServedPolicy
from storage.checkpoints import CheckpointInfo, publish_checkpoint

pytestmark = pytest.mark.integration


def publish_next(policy: ServedPolicy, root: str, tmp_path: Path, seed: int) -> tuple[CheckpointInfo, Path]:
    checkpoint = perturbed_checkpoint(policy.weights_dir, tmp_path / "new", seed=seed)
    return publish_checkpoint(checkpoint, root, "run", next_step(policy)), checkpoint


def now_serving(policy: ServedPolicy, info: CheckpointInfo) -> None:
    """The entry points track the server in their own ServedPolicy; keep the shared fixture's in step."""
    policy.version, policy.weights_dir = info.step, Path(info.url.removeprefix("file://"))


def test_watch_command_once_brings_external_servers_up_to_date(untied_policy, tmp_path):
    policy, root = untied_policy, f"file://{tmp_path}/store"
    info, checkpoint = publish_next(policy, root, tmp_path, seed=31)
    app = typer.Typer()
    app.command()(watch_command)
    args = [
        "--run",
        f"{root}/run",
        "--server",
        policy.base_url,
        "--base-model",
        str(policy.weights_dir),
        "--once",
        "--cache-dir",
        str(tmp_path / "cache"),
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert f"reloaded -> version {info.step}" in result.output
    now_serving(policy, info)
    assert asyncio.run(announced(policy)) == info.step
    assert asyncio.run(served_matches(policy, checkpoint)) < 1e-4


def test_watch_command_names_a_bad_run_url(tmp_path):
    app = typer.Typer()
    app.command()(watch_command)
    args = ["--run", "s3://bucket-only", "--server", "http://127.0.0.1:1", "--base-model", str(tmp_path)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "STORAGE_URL/RUN" in result.output


async def test_serve_watch_follows_the_run_until_stopped(untied_policy, tmp_path):
    policy, root = untied_policy, f"file://{tmp_path}/store"
    stop = asyncio.Event()
    watch = watch_server(policy.server, f"{root}/run", poll_s=0.2, cache_dir=tmp_path / "cache", stop=stop)
    watching = asyncio.create_task(watch)
    info, checkpoint = await asyncio.to_thread(publish_next, policy, root, tmp_path, 41)
    for _ in range(200):
        if await announced(policy) == info.step:
            break
        await asyncio.sleep(0.1)
    stop.set()
    outcomes = await watching
    assert [(o.status, o.version) for o in outcomes][-1] == ("reloaded", info.step)
    now_serving(policy, info)
    assert await served_matches(policy, checkpoint) < 1e-4


@pytest.fixture(scope="module")
def prefect_api(prefect_server):
    """The session's Prefect server (tests/conftest.py), as this module's API."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: prefect_server.api_url}):
        yield prefect_server.api_url


async def test_reload_flow_reloads_and_reports_an_artifact(untied_policy, prefect_api, tmp_path):
    from prefect.logging.handlers import APILogHandler

    from flows.reload import reload_watcher

    policy, root = untied_policy, f"file://{tmp_path}/store"
    info, checkpoint = publish_next(policy, root, tmp_path, seed=51)
    outcomes = await reload_watcher(
        f"{root}/run", [policy.base_url], str(policy.weights_dir), max_polls=1, cache_dir=str(tmp_path / "cache")
    )
    await APILogHandler.aflush()  # before the module's Prefect server goes away
    assert [(o["status"], o["version"]) for o in outcomes] == [("reloaded", info.step)]
    now_serving(policy, info)
    assert await served_matches(policy, checkpoint) < 1e-4
    async with httpx.AsyncClient(base_url=prefect_api) as api:
        artifact = (await api.get("/artifacts/reload-run/latest")).json()
    assert artifact["type"] == "table" and json.loads(artifact["data"])[0]["status"] == "reloaded"
