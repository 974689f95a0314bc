"""Bad environment output (ragged tokens/mask, NaN scores, an empty group, out-of-vocabulary ids,
an exception, a hang, a group of 10 MiB of tokens): each group is recorded as a failure with its
reason, the rollout flow goes on and completes, only good groups are stored, and the failure counts
by reason show in the flow run's stats table artifact."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import httpx
import pytest

from environments.base import RolloutFailure
from flows.artifacts import artifact_key
from flows.rollout_report import RolloutStats, failures_by_reason
from storage.inspection import verify
from storage.reader import ShardReader
from tests.reliability.bad_environments import BAD_OUTPUTS, Good, Hang, Huge

MODULE = "tests.reliability.bad_environments"
GOOD_ITEMS, BAD_ITEMS = 4, 2
HANG_TIMEOUT_S = 2.0
FLOW_LIMIT_S = 300.0


def test_failures_are_counted_by_reason():
    stats = RolloutStats(env="e")
    for reason in ["timeout", "ragged", "timeout"]:
        stats.add(RolloutFailure(env="e", item_id="i", error=f"{reason} error", reason=reason))
    assert stats.failures == 3 and stats.failure_reasons == {"timeout": 2, "ragged": 1}
    assert stats.row()["failures by reason"] == "timeout: 2, ragged: 1"
    other = RolloutStats(env="f", failure_reasons={"ragged": 4})
    assert failures_by_reason([stats, other]) == {"ragged": 5, "timeout": 2}


def test_a_huge_error_message_is_kept_short():
    failure = RolloutFailure.of("e", "i", ValueError("x" * 10**7))
    assert len(failure.error) < 2100 and failure.error.endswith("(10,000,012 characters)")
    assert failure.reason == "exception"


def api(server, path: str, body: dict) -> list[dict]:
    response = httpx.post(f"{server.api_url}{path}", json=body, timeout=30)
    response.raise_for_status()
    return response.json()


@pytest.mark.integration
def test_bad_groups_are_recorded_with_their_reason_and_the_flow_completes(
    prefect_server, policy_server, policy_tokenizer, tmp_path
):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.rollout import rollout
    from tasks.rollout import EnvSpec

    sampling = {"group_size": 2, "max_tokens": 4}
    specs = [EnvSpec(import_path=f"{MODULE}:Good", config={**sampling, "items": GOOD_ITEMS})]
    expected_items = GOOD_ITEMS
    for env_class in BAD_OUTPUTS:
        config = {**sampling, "items": 1 if env_class is Huge else BAD_ITEMS}
        if env_class is Hang:
            config["group_timeout_s"] = HANG_TIMEOUT_S
        specs.append(EnvSpec(import_path=f"{MODULE}:{env_class.__name__}", config=config))
        expected_items += config["items"]
    storage = f"file://{tmp_path}/store"
    name = f"bad-output-{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    with temporary_settings({PREFECT_API_URL: prefect_server.api_url}):
        flow_run = rollout.with_options(flow_run_name=name)(
            environments=specs,
            servers=[policy_server.base_url],
            run_url=f"{storage}/bad",
            tokenizer=policy_tokenizer,
            groups=expected_items,
            max_concurrent_groups=4,
            task_run_s=1.0,
        )
        summary = asyncio.run(asyncio.wait_for(flow_run, FLOW_LIMIT_S))  # a hang not cut fails, never blocks
    seconds = time.monotonic() - started

    # The flow ran to its end and says so in Prefect.
    [flow_run] = api(prefect_server, "/flow_runs/filter", {"flow_runs": {"name": {"any_": [name]}}})
    assert flow_run["state"]["type"] == "COMPLETED"

    # Only the good groups are stored, each once, in shards that verify.
    groups = list(ShardReader(storage, "bad").groups())
    assert sorted(g.item_id for g in groups) == [f"good-{i}" for i in range(1, GOOD_ITEMS + 1)]
    assert all(not check.problems for check in verify(f"{storage}/bad"))

    # Every bad group is a recorded failure of its kind, in the summary and the UI's table.
    expected = {
        env_class.name: (1 if env_class is Huge else BAD_ITEMS, reason)
        for env_class, (reason, _) in BAD_OUTPUTS.items()
    }
    totals = summary["totals"]
    assert totals["groups"] == GOOD_ITEMS and totals["failures"] == sum(count for count, _ in expected.values())
    by_reason: dict[str, int] = {}
    for count, reason in expected.values():
        by_reason[reason] = by_reason.get(reason, 0) + count
    assert totals["failures_by_reason"] == dict(sorted(by_reason.items()))

    [table] = api(
        prefect_server,
        "/artifacts/filter",
        {
            "artifacts": {
                "flow_run_id": {"any_": [flow_run["id"]]},
                "key": {"any_": [artifact_key("rollout-env-stats", "bad")]},
            },
        },
    )
    rows = {row["env"]: row for row in json.loads(table["data"])}
    assert rows[Good.name]["groups"] == GOOD_ITEMS and rows[Good.name]["failures"] == 0
    for env_class, (reason, phrase) in BAD_OUTPUTS.items():
        row, (count, _) = rows[env_class.name], expected[env_class.name]
        assert (row["groups"], row["failures"]) == (0, count), row
        assert row["failures by reason"] == f"{reason}: {count}", row
        assert phrase in row["last error"], row
    print(f"\n{expected_items} items ({len(BAD_OUTPUTS)} bad kinds) through the rollout flow in {seconds:.1f}s")


@pytest.mark.integration
def test_a_hang_is_cut_at_the_time_limit(policy_server, policy_tokenizer):
    """The limit holds for a group that never returns: cut within 1.5 s of group_timeout_s, its
    failure naming the knob."""
    from inference.client import PolicyClient

    async def main() -> tuple[RolloutFailure, float]:
        async with PolicyClient(policy_server.base_url, api_key=policy_server.api_key) as client:
            env = Hang(
                {"group_size": 1, "max_tokens": 2, "group_timeout_s": HANG_TIMEOUT_S},
                client=client,
                tokenizer=policy_tokenizer,
            )
            await env.setup()
            item = await env.get_item()
            started = time.monotonic()
            result = await asyncio.wait_for(env.sample_group(item), 60)
            return result, time.monotonic() - started

    failure, seconds = asyncio.run(main())
    assert isinstance(failure, RolloutFailure) and failure.reason == "timeout"
    assert "group_timeout_s=2s" in failure.error and "--set group_timeout_s=" in failure.error
    assert HANG_TIMEOUT_S <= seconds < HANG_TIMEOUT_S + 1.5, seconds


@pytest.mark.integration
def test_an_environment_whose_get_item_or_observe_raises_loses_no_stored_group(
    prefect_server, policy_server, policy_tokenizer, tmp_path
):
    """get_item raising: that environment leaves the item stream (one failure recorded) and the
    others go on; observe raising: logged, its groups already stored and counted once."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from clotho.flow_runtime import drain_prefect_reporting
    from flows.rollout import rollout
    from tasks.rollout import EnvSpec

    sampling = {"group_size": 2, "max_tokens": 4, "items": 3}
    specs = [
        EnvSpec(import_path=f"{MODULE}:{name}", config=sampling)
        for name in ("Good", "RaisingGetItem", "RaisingObserve")
    ]
    with temporary_settings({PREFECT_API_URL: prefect_server.api_url}):
        flow_run = rollout(
            environments=specs,
            servers=[policy_server.base_url],
            run_url=f"file://{tmp_path}/store/raising",
            tokenizer=policy_tokenizer,
            groups=100,
            max_concurrent_groups=2,
        )
        summary = asyncio.run(asyncio.wait_for(flow_run, FLOW_LIMIT_S))
        drain_prefect_reporting()  # while the server is still the one they report to
    rows = {row["env"]: row for row in summary["environments"]}
    stored = list(ShardReader(f"file://{tmp_path}/store", "raising").groups())
    by_env = {env: sorted(g.item_id for g in stored if g.env == env) for env in rows}
    assert by_env == {
        "good": ["good-1", "good-2", "good-3"],
        "bad_get_item": ["bad_get_item-1"],
        "bad_observe": ["bad_observe-1", "bad_observe-2", "bad_observe-3"],
    }, by_env
    assert summary["totals"]["groups"] == len(stored) == 7
    assert (rows["bad_get_item"]["failures"], rows["bad_observe"]["failures"]) == (1, 0)
    assert "the item source broke" in rows["bad_get_item"]["last error"]
