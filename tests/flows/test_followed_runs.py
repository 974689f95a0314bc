"""A deployment run the pipeline follows (flows.followed_runs), against a real Prefect server: one lost
with its host (Prefect still shows it Running, its heartbeats stopped) is marked crashed and started
again as a new run; one whose heartbeats go on is left alone; a failed one fails its follower."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime

import pytest
from prefect.settings import PREFECT_API_URL, temporary_settings

import flows.followed_runs
from flows.followed_runs import FollowedRun, follow, heartbeats_stopped

pytestmark = pytest.mark.integration


async def deployment(heartbeat_s: int | None = None) -> str:
    """A rollout deployment on a pool no worker polls: its runs change state only as a test says.
    `heartbeat_s`: the heartbeat interval its job variables give its runs (as prefect.yaml does)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    name = "followed" if heartbeat_s is None else f"followed-{heartbeat_s}"
    job_variables = {} if heartbeat_s is None else {"env": {"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(heartbeat_s)}}
    async with get_client() as client:
        await client.create_work_pool(WorkPoolCreate(name="followed-pool", type="process"), overwrite=True)
        flow_id = await client.create_flow_from_name("rollout")
        await client.create_deployment(
            flow_id,
            name,
            work_pool_name="followed-pool",
            entrypoint="flows/rollout.py:rollout",
            job_variables=job_variables,
        )
    return f"rollout/{name}"


def test_a_run_whose_heartbeats_stopped_is_marked_crashed_and_started_again(prefect_server, monkeypatch):
    from prefect.client.orchestration import get_client
    from prefect.states import Running

    monkeypatch.setattr(flows.followed_runs, "LOST_AFTER_BEATS", 0.02)  # 0.6 s of Prefect's 30 s interval
    monkeypatch.setattr(flows.followed_runs, "LOST_CHECK_S", 0.0)

    async def scenario() -> tuple[list[str], str, str]:
        run = FollowedRun(await deployment(), {"run_url": "file:///nowhere/run"}, f"lost-{uuid.uuid4().hex[:8]}", 1)
        following = asyncio.ensure_future(follow(run, poll_s=0.2))
        while run.flow_run_id is None:
            await asyncio.sleep(0.05)
        first = run.flow_run_id
        async with get_client() as client:
            await client.set_flow_run_state(first, Running(), force=True)  # a worker took it; then its host went
        while run.attempt == 0:
            await asyncio.sleep(0.1)
        async with get_client() as client:
            lost = (await client.read_flow_run(first)).state
        following.cancel()
        with pytest.raises(asyncio.CancelledError):
            await following
        async with get_client() as client:
            again = await client.read_flow_run(run.flow_run_id)
        return [lost.type.value, again.state.type.value], lost.message, again.name

    with temporary_settings({PREFECT_API_URL: prefect_server.api_url, "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": 30}):
        states, message, name = asyncio.run(asyncio.wait_for(scenario(), 60))
    # The new run, cancelled with its follower before a worker took it.
    assert states == ["CRASHED", "CANCELLED"] and name.endswith("-r1"), (states, name)
    assert "no heartbeat for" in message and "taken for lost with its host" in message, message


def test_a_run_is_alive_while_its_heartbeats_come_and_lost_after_intervals_without(prefect_server, monkeypatch):
    """The heartbeats are Prefect's own events (`prefect.flow-run.heartbeat`, sent by the run's
    process); the interval is the gap between the last two (2 s here; 4 of them: the server stores
    events up to 5 s after they come)."""
    from prefect.client.orchestration import get_client
    from prefect.events import emit_event
    from prefect.events.clients import get_events_client
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter
    from prefect.states import Running

    async def scenario() -> tuple[float | None, float | None, float]:
        run = FollowedRun(await deployment(), {"run_url": "file:///nowhere/run"}, f"alive-{uuid.uuid4().hex[:8]}")
        await run.start()
        async with get_client() as client:
            await client.set_flow_run_state(run.flow_run_id, Running(), force=True)
        resource = {"prefect.resource.id": f"prefect.flow-run.{run.flow_run_id}"}
        async with get_events_client():  # the events go out before it closes
            emit_event(event=flows.followed_runs.HEARTBEAT, resource=resource)
            await asyncio.sleep(2.0)
            emit_event(event=flows.followed_runs.HEARTBEAT, resource=resource)
        async with get_client() as client:
            while len((await client.read_events(filter=heartbeats_of(run), limit=2)).events) < 2:
                await asyncio.sleep(0.2)  # the server stores events a few seconds after they come
            flow_run = await client.read_flow_run(run.flow_run_id)
            alive = await heartbeats_stopped(client, flow_run, 180.0)
            last = max(e.occurred for e in (await client.read_events(filter=heartbeats_of(run), limit=2)).events)
            await asyncio.sleep(max(0.0, 8.3 - (datetime.now(UTC) - last).total_seconds()))
            silent = await heartbeats_stopped(client, flow_run, 180.0)
        await run.cancel()
        return alive, silent, (datetime.now(UTC) - last).total_seconds()

    def heartbeats_of(run):
        return EventFilter(
            event=EventNameFilter(name=[flows.followed_runs.HEARTBEAT]),
            resource=EventResourceFilter(id=[f"prefect.flow-run.{run.flow_run_id}"]),
        )

    monkeypatch.setattr(flows.followed_runs, "LOST_AFTER_BEATS", 4)
    with temporary_settings({PREFECT_API_URL: prefect_server.api_url}):
        alive, silent, since = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert alive is None, alive
    assert silent is not None and 8.0 < silent <= since + 0.5, (silent, since)


def test_a_failed_run_fails_its_follower_with_its_message(prefect_server):
    from prefect.client.orchestration import get_client
    from prefect.states import Failed

    async def scenario() -> str:
        run = FollowedRun(await deployment(), {"run_url": "file:///nowhere/run"}, f"failed-{uuid.uuid4().hex[:8]}", 3)
        following = asyncio.ensure_future(follow(run, poll_s=0.2))
        while run.flow_run_id is None:
            await asyncio.sleep(0.05)
        async with get_client() as client:
            await client.set_flow_run_state(run.flow_run_id, Failed(message="the environment raised"), force=True)
        with pytest.raises(RuntimeError) as failed:
            await following
        return str(failed.value)

    with temporary_settings({PREFECT_API_URL: prefect_server.api_url}):
        said = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert said.startswith("flow run failed-") and said.endswith("ended FAILED: the environment raised"), said


def test_before_two_heartbeats_the_interval_is_the_one_the_deployment_gives(prefect_server):
    """A run lost before its second heartbeat is judged by the interval its deployment's job
    variables give its process (prefect.yaml: 30 s), not by Prefect's default of 180 s."""
    from prefect.client.orchestration import get_client

    from flows.followed_runs import given_interval

    async def scenario() -> list[float]:
        intervals = []
        for deployed in (await deployment(45), await deployment()):
            run = FollowedRun(deployed, {"run_url": "file:///nowhere/run"}, f"interval-{uuid.uuid4().hex[:8]}")
            await run.start()
            async with get_client() as client:
                intervals.append(await given_interval(client, await client.read_flow_run(run.flow_run_id)))
            await run.cancel()
        return intervals

    with temporary_settings({PREFECT_API_URL: prefect_server.api_url}):
        assert asyncio.run(scenario()) == [45.0, 180.0]
