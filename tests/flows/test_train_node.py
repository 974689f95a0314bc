"""The trainer across hosts (flows.train_node) from the pipeline's side, against a real Prefect server:
a missing deployment or node work queue stops the phase at once with the fix; a node no worker
takes ends the phase after trainer_nodes.start_timeout_s and is cancelled; a node whose trainer
fails fails its flow run with the trainer's own words. The run across hosts: tests/cluster."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from prefect.settings import PREFECT_API_URL, temporary_settings

from flows.pipeline_config import PipelineConfig
from flows.train_node import NodeRuns, train_node

pytestmark = pytest.mark.integration


def config(tmp_path, **nodes) -> PipelineConfig:
    return PipelineConfig.model_validate(
        {
            "run": f"file://{tmp_path}/storage/run",
            "model": "/models/tiny",
            "trainer_nodes": {"work_queues": ["node-a", "node-b"], "rendezvous": "host-a:29400", **nodes},
            "phases": [{"name": "rl", "steps": 3, "environments": [{"env": "compare"}]}],
        }
    )


async def deploy(queues: list[str]) -> None:
    """The train-node deployment on a process pool with these work queues, as prefect.yaml deploys it."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists

    async with get_client() as client:
        await client.create_work_pool(WorkPoolCreate(name="train-pool", type="process"), overwrite=True)
        for queue in queues:
            with contextlib.suppress(ObjectAlreadyExists):  # the server is the session's
                await client.create_work_queue(queue, work_pool_name="train-pool")
        flow_id = await client.create_flow_from_name("train-node")
        await client.create_deployment(
            flow_id, "train-node", work_pool_name="train-pool", entrypoint="flows/train_node.py:train_node"
        )


def test_the_phase_stops_at_once_without_the_deployment_or_a_nodes_queue_and_cancels_nodes_no_worker_takes(
    prefect_server, tmp_path
):
    from prefect.client.orchestration import get_client

    phase = config(tmp_path).phases[0]

    async def scenario() -> list[str]:
        said = []
        with pytest.raises(RuntimeError) as missing:
            await NodeRuns.start(config(tmp_path), phase, 3)
        said.append(str(missing.value))
        await deploy(["node-a"])
        with pytest.raises(RuntimeError) as missing:
            await NodeRuns.start(config(tmp_path), phase, 3)
        said.append(str(missing.value))
        await deploy(["node-b"])
        runs = await NodeRuns.start(config(tmp_path, start_timeout_s=1.0), phase, 3)
        assert await runs.outcome() is None  # scheduled, within its start timeout
        await asyncio.sleep(1.2)
        said.append(await runs.outcome())
        await runs.stop()
        async with get_client() as client:
            flow_runs = [await client.read_flow_run(i) for i in runs.ids]
        assert [r.state.type.value for r in flow_runs] == ["CANCELLED", "CANCELLED"]  # never started, never will
        assert [
            (r.name, r.parameters["node_rank"], r.parameters["nodes"], r.parameters["steps"]) for r in flow_runs
        ] == [
            ("rl-train-node0", 0, 2, 3),
            ("rl-train-node1", 1, 2, 3),
        ]
        assert (
            flow_runs[1].parameters["rendezvous"] == "host-a:29400"
            and "max_staleness=1" in flow_runs[1].parameters["overrides"]
        )
        return said

    with temporary_settings({PREFECT_API_URL: prefect_server.api_url}):
        said = asyncio.run(scenario())
    assert said[0].startswith("trainer_nodes.deployment: no deployment 'train-node/train-node'; deploy it"), said[0]
    assert said[1].startswith("trainer_nodes.work_queues[1]: no work queue 'node-b' in pool 'train-pool'"), said[1]
    assert "prefect work-queue create node-b --pool train-pool" in said[1], said[1]
    assert said[2].startswith("no worker took trainer node flow run rl-train-node0 from work queue 'node-a' in 1 s"), (
        said[2]
    )


def test_a_node_whose_trainer_fails_fails_with_the_trainers_words(prefect_server, tmp_path):
    """torchrun launches `clotho train` for the node; the trainer refuses a model that is not there,
    and the node's flow run fails with that, its log beside the work dir."""
    with temporary_settings({PREFECT_API_URL: prefect_server.api_url}):
        with pytest.raises(RuntimeError) as failed:
            train_node(
                run_url=f"file://{tmp_path}/storage/run",
                model="/no-such-model",
                steps=1,
                nodes=1,
                node_rank=0,
                rendezvous="127.0.0.1:29431",
                work_dir=str(tmp_path / "work"),
            )
    said = str(failed.value)
    assert said.startswith("trainer node 0 on ") and "exited with" in said, said
    assert "Invalid value for --model" in said and "'/no-such-model' does not exist" in said, (
        said
    )  # the trainer's own words, from its log
    assert (tmp_path / "work" / "trainer-node0.log").exists()


def test_after_a_node_failed_the_lost_one_is_marked_crashed_and_every_node_starts_again(
    prefect_server, tmp_path, monkeypatch
):
    """Node 1 failed (its peer's host went away); node 0 still shows Running, since its host and
    its worker are gone: it is cancelled, marked crashed when no worker ends it, and both nodes
    start again as new flow runs on their queues, while restarts are left."""
    from prefect.client.orchestration import get_client
    from prefect.states import Failed, Running

    import flows.train_node

    monkeypatch.setattr(flows.train_node, "LOST_AFTER_S", 1.0)

    async def scenario() -> tuple[list[str], list[str], str, int, str]:
        await deploy(["node-a", "node-b"])
        runs = await NodeRuns.start(config(tmp_path, restarts=1), config(tmp_path).phases[0], 3)
        first = list(runs.ids)
        async with get_client() as client:
            await client.set_flow_run_state(first[0], Running(), force=True)
            await client.set_flow_run_state(first[1], Failed(message="Connection closed by peer"), force=True)
        said = await runs.outcome()
        await runs.restart()
        async with get_client() as client:
            old = [(await client.read_flow_run(i)).state for i in first]
        names = list(runs.names)
        await runs.stop()
        return [s.type.value for s in old], names, said, runs.restarts_left, old[0].message

    with temporary_settings({PREFECT_API_URL: prefect_server.api_url}):
        old, names, said, left, message = asyncio.run(scenario())
    assert said == "trainer node flow run rl-train-node1 ended FAILED: Connection closed by peer", said
    assert old == ["CRASHED", "FAILED"] and "taken for lost with its host" in message, (old, message)
    assert names == ["rl-train-node0-r1", "rl-train-node1-r1"] and left == 0
