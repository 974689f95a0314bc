"""The rollout flow on a remote environment (`clotho env serve` in its own process): its groups land
in shards like a local one's, and a service killed mid-run leaves the finished groups stored and
the failures recorded in the flow's report."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest


@pytest.mark.integration
def test_a_remote_environment_killed_mid_run_leaves_its_finished_groups_stored_and_its_failures_recorded(
    prefect_server, policy_server, tiny_model_dir, tmp_path, monkeypatch
) -> None:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    import environments.remote
    from clotho.flow_runtime import drain_prefect_reporting
    from environments.testing import serve_environment
    from flows.rollout import rollout
    from storage.reader import ShardReader
    from tasks.rollout import EnvSpec

    monkeypatch.setattr(environments.remote, "GET_ITEM_TRIES", 2)  # give the dead service up quickly
    monkeypatch.setattr(environments.remote, "GET_ITEM_FIRST_WAIT_S", 0.2)
    served = serve_environment("arithmetic")
    run_dir = tmp_path / "store" / "remote"

    def kill_after_two_shards() -> None:
        deadline = time.monotonic() + 300
        while len(list(Path(run_dir).rglob("*.parquet"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        served.process.kill()

    killer = threading.Thread(target=kill_after_two_shards, daemon=True)
    killer.start()
    spec = EnvSpec(import_path=served.url, config={"group_size": 2, "max_tokens": 8})
    try:
        with temporary_settings({PREFECT_API_URL: prefect_server.api_url}):
            summary = asyncio.run(
                rollout(
                    environments=[spec],
                    servers=[policy_server.base_url],
                    run_url=f"file://{tmp_path}/store/remote",
                    tokenizer=str(tiny_model_dir),
                    groups=10_000,
                    max_concurrent_groups=2,
                    shard_max_groups=4,
                )
            )
            drain_prefect_reporting()
    finally:
        killer.join(timeout=5)
        served.stop()
    totals = summary["totals"]
    [row] = summary["environments"]
    groups = list(ShardReader(f"file://{tmp_path}/store", "remote").groups())
    assert totals["groups"] >= 8 and len(groups) == totals["groups"]  # every finished group is stored, once
    assert len({g.group_id for g in groups}) == len(groups) and all(g.env == "arithmetic" for g in groups)
    assert totals["failures"] >= 1 and served.url in row["last error"]
    assert totals["groups"] < 10_000
