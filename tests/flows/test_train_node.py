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
PORT = 29437  # the rendezvous each phase serves while its nodes run


def config(tmp_path, **nodes) -> PipelineConfig:
    return PipelineConfig.model_validate(
        {
            "run": f"file://{tmp_path}/storage/run",
            "model": "/models/tiny",
            "trainer_nodes": {"work_queues": ["node-a", "node-b"], "rendezvous": f"127.0.0.1:{PORT}", **nodes},
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
            flow_runs = [await client.read_flow_run(run.flow_run_id) for run in runs.runs]
        assert [r.state.type.value for r in flow_runs] == ["CANCELLED", "CANCELLED"]  # never started, never will
        assert [
            (r.name, r.parameters["node_rank"], r.parameters["nodes"], r.parameters["steps"]) for r in flow_runs
        ] == [
            ("rl-train-node0", 0, 2, 3),
            ("rl-train-node1", 1, 2, 3),
        ]
        assert (
            flow_runs[1].parameters["rendezvous"] == f"127.0.0.1:{PORT}"
            and "max_lag=1" in flow_runs[1].parameters["overrides"]
        )
        return said

    with temporary_settings({PREFECT_API_URL: prefect_server.api_url}):
        said = asyncio.run(scenario())
    assert said[0].startswith("trainer_nodes.deployment: no deployment 'train-node/train-node'; deploy it"), said[0]
    assert said[1].startswith("trainer_nodes.work_queues[1]: no work queue 'node-b' in pool 'train-pool'"), said[1]
    assert "prefect work-queue create node-b --pool train-pool" in said[1], said[1]
    assert said[2].startswith("no worker took flow run rl-train-node0 from work queue 'node-a' in 1 s"), said[2]
    assert said[2].endswith("start one: prefect worker start --pool POOL --work-queue node-a"), said[2]


def test_a_node_whose_trainer_fails_fails_with_the_trainers_words(prefect_server, tmp_path):
    """torchrun's elastic agent meets the rendezvous the pipeline serves and launches `clotho train`
    for the node; the trainer refuses a model that is not there, torchrun starts it again
    (`restarts`) and gives up, and the node's flow run fails with the trainer's words, its log
    beside the work dir."""
    from flows.train_node import serve_rendezvous

    store = serve_rendezvous("127.0.0.1:29431")
    with temporary_settings({PREFECT_API_URL: prefect_server.api_url}):
        with pytest.raises(RuntimeError) as failed:
            train_node(
                run_url=f"file://{tmp_path}/storage/run",
                model="/no-such-model",
                steps=1,
                nodes=1,
                node_rank=0,
                rendezvous="127.0.0.1:29431",
                restarts=1,
                work_dir=str(tmp_path / "work"),
            )
    del store
    said = str(failed.value)
    assert said.startswith("trainer node 0 on ") and "exited with" in said, said
    assert "Invalid value for --model" in said and "'/no-such-model' does not exist" in said, (
        said
    )  # the trainer's own words, from its log
    log = (tmp_path / "work" / "trainer-node0.log").read_text()
    assert log.count("Invalid value for --model") == 2, log[-3000:]  # the first try and one restart


def test_a_node_lost_with_its_host_starts_again_on_its_queue_and_a_failed_one_fails_the_phase(
    prefect_server, tmp_path, monkeypatch
):
    """Node 0 still shows Running, but its host is gone (no heartbeat): it is marked crashed and
    started again as a new flow run on its own queue, where its worker (back on the host) takes it
    and its agent joins the others at the rendezvous. A node whose torchrun gave up fails the phase."""
    from prefect.client.orchestration import get_client
    from prefect.states import Failed, Running

    import flows.followed_runs

    monkeypatch.setattr(flows.followed_runs, "LOST_AFTER_BEATS", 0.02)  # 0.6 s of a 30 s interval

    async def scenario() -> tuple[str, list[str], list[str | None], str, str | None]:
        await deploy(["node-a", "node-b"])
        runs = await NodeRuns.start(config(tmp_path, restarts=1), config(tmp_path).phases[0], 3)
        first = [run.flow_run_id for run in runs.runs]
        async with get_client() as client:
            for flow_run_id in first:
                await client.set_flow_run_state(flow_run_id, Running(), force=True)
            await asyncio.sleep(1.0)
            said = await runs.outcome()  # both silent: both started again
            lost = (await client.read_flow_run(first[0])).state
            again = [await client.read_flow_run(run.flow_run_id) for run in runs.runs]
            await client.set_flow_run_state(runs.runs[1].flow_run_id, Failed(message="torchrun gave up"), force=True)
        failed = await runs.outcome()
        await runs.stop()
        return lost.type.value, [r.name for r in again], [r.work_queue_name for r in again], failed, said

    with temporary_settings({PREFECT_API_URL: prefect_server.api_url, "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": 30}):
        lost, names, queues, failed, said = asyncio.run(scenario())
    assert said is None and lost == "CRASHED"
    assert names == ["rl-train-node0-r1", "rl-train-node1-r1"] and queues == ["node-a", "node-b"], (names, queues)
    assert failed == "flow run rl-train-node1-r1 ended FAILED: torchrun gave up", failed
