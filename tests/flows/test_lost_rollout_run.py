"""A rollout flow run lost with its host (Prefect still shows it Running, nothing is left to report
it) is known by its sampler slot gone silent: the pipeline marks it crashed and starts the rollout
again as a new run, against a real Prefect server."""

from __future__ import annotations

import asyncio
import time
import uuid

from prefect.settings import PREFECT_API_URL, temporary_settings

import flows.rollout_runs
from storage.progress import SamplerPosition, write_sampler_position


def test_a_rollout_run_whose_sampler_went_silent_is_marked_crashed_and_started_again(
    prefect_server, tmp_path, monkeypatch
):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.states import Running

    monkeypatch.setattr(flows.rollout_runs, "LOST_CHECK_S", 0.0)
    storage = f"file://{tmp_path}/storage"
    name = f"lost-{uuid.uuid4().hex[:8]}"

    async def scenario() -> tuple[list, str]:
        async with get_client() as client:
            await client.create_work_pool(WorkPoolCreate(name="rollout-lost-pool", type="process"), overwrite=True)
            flow_id = await client.create_flow_from_name("rollout")
            await client.create_deployment(
                flow_id, "lost", work_pool_name="rollout-lost-pool", entrypoint="flows/rollout.py:rollout"
            )
        # A name of its own: the Prefect server is the session's, where pipelines' rollout runs are rl-0 too.
        running = asyncio.ensure_future(
            flows.rollout_runs.run_rollout_deployment("rollout/lost", {"run_url": f"{storage}/run"}, name, restarts=1)
        )
        async with get_client() as client:
            while not (
                runs := await client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])))
            ):
                await asyncio.sleep(0.2)
            first = runs[0]
            await client.set_flow_run_state(first.id, Running(), force=True)  # a worker took it; then its host went
            write_sampler_position(
                storage,
                "run",
                SamplerPosition("slot-0", committed=3, in_flight=2, holder=str(first.id), updated_at=time.time() - 120),
            )
            while not (
                again := await client.read_flow_runs(
                    flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[f"{name}-r1"]))
                )
            ):
                await asyncio.sleep(0.2)
            lost = (await client.read_flow_run(first.id)).state
        running.cancel()
        try:
            await running
        except asyncio.CancelledError:
            pass
        async with get_client() as client:
            restarted = (await client.read_flow_run(again[0].id)).state
        return [lost.type.value, restarted.type.value], lost.message

    with temporary_settings({PREFECT_API_URL: prefect_server.api_url}):
        states, message = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert states == ["CRASHED", "CANCELLED"], (
        states
    )  # the new run, cancelled with the pipeline before a worker took it
    assert "silent for 60 s: taken for lost with its host" in message, message
