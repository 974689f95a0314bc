"""Rollouts against a policy server started with an API key: the key given on the command line,
from CLOTHO_API_KEY, or from a Prefect Secret block (deployments); a wrong key stops at once."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from storage.reader import ShardReader
from tests.conftest import KEYED_SERVER_KEY as KEY

pytestmark = pytest.mark.integration

CLOTHO = str(Path(sys.executable).with_name("clotho"))


def rollout_command(server, storage: str, run: str, tokenizer) -> list[str]:
    return [
        CLOTHO,
        "rollout",
        "--env",
        "arithmetic",
        "--run",
        f"{storage}/{run}",
        "--server",
        server.base_url,
        "--groups",
        "4",
        "--tokenizer",
        str(tokenizer),
        "--set",
        "group_size=2",
        "--set",
        "max_tokens=4",
    ]


def environment(prefect_server, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "CLOTHO_API_KEY"}
    return {**env, **prefect_server.env(), **extra}


def test_a_keyed_server_serves_rollouts_with_its_key_and_refuses_others(
    prefect_server, keyed_server, tiny_model_dir, tmp_path
):
    storage = f"file://{tmp_path}/store"
    done = subprocess.run(
        rollout_command(keyed_server, storage, "keyed", tiny_model_dir) + ["--api-key", KEY],
        env=environment(prefect_server),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "'failures': 0" in done.stdout and "'groups': 4" in done.stdout, done.stdout[-2000:]
    groups = list(ShardReader(storage, "keyed").groups())
    assert len(groups) == 4 and all(len(g.sequences) == 2 for g in groups)
    # The key never enters the flow run's stored parameters.
    assert KEY not in done.stdout

    # CLOTHO_API_KEY works the same; a wrong one stops the run at once, naming server and option.
    from_variable = subprocess.run(
        rollout_command(keyed_server, storage, "from-variable", tiny_model_dir),
        env=environment(prefect_server, CLOTHO_API_KEY=KEY),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert from_variable.returncode == 0, from_variable.stderr[-3000:]
    # How long the command takes to start and fail on its own (imports, on a loaded machine many
    # seconds): the refusal must come within a few seconds of that, never after retries (> 15 s).
    started = time.monotonic()
    control = subprocess.run(
        rollout_command(keyed_server, storage, "control", tiny_model_dir) + ["--env", "no_such_environment"],
        env=environment(prefect_server),
        capture_output=True,
        text=True,
        timeout=120,
    )
    startup_s = time.monotonic() - started
    assert control.returncode == 2, control.stderr[-2000:]
    started = time.monotonic()
    refused = subprocess.run(
        rollout_command(keyed_server, storage, "refused", tiny_model_dir) + ["--api-key", "wrong"],
        env=environment(prefect_server),
        capture_output=True,
        text=True,
        timeout=120,
    )
    seconds = time.monotonic() - started
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    assert seconds < startup_s + 8, (seconds, startup_s)
    assert f"policy server {keyed_server.base_url} refused the API key given" in refused.stderr, refused.stderr[-2000:]
    assert "--api-key" in refused.stderr and "CLOTHO_API_KEY" in refused.stderr
    assert not list(ShardReader(storage, "refused").groups())


def test_a_deployment_reads_the_key_from_a_secret_block(
    prefect_server, keyed_server, tiny_model_dir, tmp_path, monkeypatch
):
    from prefect.blocks.system import Secret
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.rollout import rollout
    from inference.client import PolicyServerAuthError
    from tasks.rollout import EnvSpec

    monkeypatch.delenv("CLOTHO_API_KEY", raising=False)
    storage = f"file://{tmp_path}/store"
    spec = EnvSpec(import_path="arithmetic", config={"group_size": 2, "max_tokens": 4})
    with temporary_settings({PREFECT_API_URL: prefect_server.api_url}):
        Secret(value=KEY).save("policy-server-key", overwrite=True)
        summary = asyncio.run(
            rollout(
                environments=[spec],
                servers=[keyed_server.base_url],
                run_url=f"{storage}/secret",
                tokenizer=str(tiny_model_dir),
                groups=3,
                api_key_secret="policy-server-key",
            )
        )
        assert summary["totals"]["groups"] == 3 and summary["totals"]["failures"] == 0
        with pytest.raises(PolicyServerAuthError, match="refused no API key"):
            asyncio.run(
                rollout(
                    environments=[spec],
                    servers=[keyed_server.base_url],
                    run_url=f"{storage}/no-key",
                    tokenizer=str(tiny_model_dir),
                    groups=3,
                )
            )
        with pytest.raises(ValueError, match="no such Secret block"):
            asyncio.run(
                rollout(
                    environments=[spec],
                    servers=[keyed_server.base_url],
                    run_url=f"{storage}/no-block",
                    tokenizer=str(tiny_model_dir),
                    groups=3,
                    api_key_secret="missing-block",
                )
            )
