"""Other frameworks' environments, each served from its own virtual environment: the venvs are
built from the committed locks by the Makefile's rule (`make .venv-env-NAME/.installed`), once per
checkout, and each adapter runs behind `clotho env serve` like any remote environment."""

from __future__ import annotations

import asyncio
import functools
import subprocess
from pathlib import Path

import pytest

from core.scored_group import ScoredGroup
from environments.testing import ServedEnvironment, serve_environment

ROOT = Path(__file__).resolve().parents[2]


ADAPTERS = sorted(
    path.stem.removeprefix("env-") for path in (ROOT / "requirements").glob("env-*.lock") if path.stem != "env-base"
)


@functools.cache
def build_adapter_venvs() -> None:
    """Every adapter's venv at once, missing or stale ones built in parallel (pip is mostly waiting
    on downloads): the first interop test pays for all of them, once."""
    targets = [f".venv-env-{name}/.installed" for name in ADAPTERS]
    subprocess.run(["make", "--no-print-directory", f"-j{len(targets)}", *targets], cwd=ROOT, check=True)


def adapter_venv(name: str) -> Path:
    """.venv-env-NAME, built from requirements/env-base.lock + env-NAME.lock when missing or stale."""
    build_adapter_venvs()
    return ROOT / f".venv-env-{name}"


def serve_adapter(name: str, environment: str, options: tuple[str, ...] = ()) -> ServedEnvironment:
    """`clotho env serve ENVIRONMENT [OPTIONS]` from .venv-env-NAME."""
    return serve_environment(environment, clotho=adapter_venv(name) / "bin" / "clotho", timeout=600, options=options)


def rollout_groups(
    prefect_server,
    policy_server,
    tokenizer: str,
    env_url: str,
    config: dict,
    run_url: str,
    groups: int,
    concurrency: int = 2,
) -> tuple[dict, list[ScoredGroup]]:
    """Runs the rollout flow on a served environment (by URL) into run_url; its summary and every
    group read back from the shards."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from clotho.flow_runtime import drain_prefect_reporting
    from flows.rollout import rollout
    from storage.layout import split_run_url
    from storage.reader import ShardReader
    from tasks.rollout import EnvSpec

    with temporary_settings({PREFECT_API_URL: prefect_server.api_url}):
        summary = asyncio.run(
            rollout(
                environments=[EnvSpec(import_path=env_url, config=config)],
                servers=[policy_server.base_url],
                run_url=run_url,
                tokenizer=tokenizer,
                groups=groups,
                max_concurrent_groups=concurrency,
                api_key_secret=None,
            )
        )
        drain_prefect_reporting()  # while the server is still the one they report to
    storage, run = split_run_url(run_url)
    return summary, list(ShardReader(storage, run).groups())


@pytest.fixture(scope="session")
def api_key(policy_server) -> str | None:
    return getattr(policy_server, "api_key", None)
