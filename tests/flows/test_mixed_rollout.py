"""A rollout flow mixing a chat environment and a base-model one writes both into one run, each
with its own prompt format."""

from __future__ import annotations

import asyncio

import pytest


@pytest.mark.integration
def test_a_rollout_mixing_chat_and_base_model_environments_writes_both_to_one_run(
    prefect_server, policy_server, tiny_model_dir, tmp_path
) -> None:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from clotho.flow_runtime import drain_prefect_reporting
    from flows.rollout import rollout
    from storage.reader import ShardReader
    from tasks.rollout import EnvSpec

    environments = [
        EnvSpec(import_path="compare", config={"group_size": 2, "max_tokens": 4}),
        EnvSpec(import_path="continuation", config={"group_size": 2, "max_tokens": 4}),
    ]
    with temporary_settings({PREFECT_API_URL: prefect_server.api_url}):
        summary = asyncio.run(
            rollout(
                environments=environments,
                servers=[policy_server.base_url],
                run_url=f"file://{tmp_path}/store/mixed",
                tokenizer=str(tiny_model_dir),
                groups=8,
                max_concurrent_groups=2,
            )
        )
        drain_prefect_reporting()  # while the server is still the one they report to
    assert summary["totals"]["groups"] == 8
    groups = list(ShardReader(f"file://{tmp_path}/store", "mixed").groups())
    by_env = {env: [g for g in groups if g.env == env] for env in ("compare", "continuation")}
    assert all(by_env.values()), {env: len(gs) for env, gs in by_env.items()}
    assert {g.chat_template for g in by_env["continuation"]} == {"none"}
    raw = by_env["continuation"][0].sequences[0]
    first_trained = raw.mask.index(True)
    prompt_text = env_decode(tiny_model_dir, raw.tokens[:first_trained])
    assert "<|im_start|>" not in prompt_text and prompt_text.endswith(",")  # the raw prefix, no template
    chat = by_env["compare"][0].sequences[0]
    assert "<|im_start|>" in env_decode(tiny_model_dir, chat.tokens[: chat.mask.index(True)])


def env_decode(model_dir, ids: list[int]) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir).decode(ids)


@pytest.mark.integration
def test_the_curriculum_learns_from_the_groups_the_flow_stores_in_process_and_served(
    prefect_server, policy_server, tiny_model_dir, tmp_path
) -> None:
    """Every stored group goes back to the instance that handed out its item (Environment.observe),
    also through `clotho env serve`; the level shows in the flow's per-environment stats."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from clotho.flow_runtime import drain_prefect_reporting
    from environments.testing import serve_environment
    from flows.rollout import rollout
    from tasks.rollout import EnvSpec

    # Any group's mean reward (>= 0) passes raise_above: the level climbs one step per stored group.
    config = {
        "dataset": "chain_sum",
        "group_size": 2,
        "max_tokens": 4,
        "window": 1,
        "raise_above": 0.0,
        "lower_below": -1.0,
    }
    served = serve_environment("reasoning_gym")
    try:
        environments = [
            EnvSpec(import_path="reasoning_gym", config=config),
            EnvSpec(import_path=served.url, config=config),
        ]
        with temporary_settings({PREFECT_API_URL: prefect_server.api_url}):
            summary = asyncio.run(
                rollout(
                    environments=environments,
                    servers=[policy_server.base_url],
                    run_url=f"file://{tmp_path}/store/curriculum",
                    tokenizer=str(tiny_model_dir),
                    groups=12,
                    max_concurrent_groups=2,
                )
            )
            drain_prefect_reporting()
    finally:
        served.stop()
    rows = summary["environments"]
    assert len(rows) == 2 and all(row["groups"] >= 1 for row in rows), rows
    assert all(row["curriculum level"] >= 1 for row in rows), rows  # both learned from their stored groups
