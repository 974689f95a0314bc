"""Runs of a deployment that the pipeline starts and follows: the rollout flows of rollout.deployment
and the trainer's nodes of trainer_nodes. Each is taken by a worker of the deployment's pool (or of
one work queue), possibly on another host, and runs as a child of the pipeline's flow run.

One rule for a run lost with its host: Prefect shows it Running while the flow-run heartbeats its
own process sends (`prefect.flow-run.heartbeat`, every PREFECT_FLOWS_HEARTBEAT_FREQUENCY seconds;
prefect.yaml sets 30 for the deployments clotho follows) have stopped for LOST_AFTER_BEATS of their
intervals. Nothing else is left to report such a run: it is marked crashed. A crashed run is started
again as a new run (NAME-rN) while restarts are left; a failed one fails its follower.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

from prefect import get_run_logger

HEARTBEAT = "prefect.flow-run.heartbeat"
LOST_AFTER_BEATS = 3  # a run whose heartbeats stopped for this many intervals is lost with its host
LOST_CHECK_S = 10.0  # how often a running run's heartbeats are read (a query of Prefect's events)
STOP_TIMEOUT_S = 150.0  # a cancelled run's worker ends it within this (a trainer finishes its step first)


def run_log():
    """The flow run's logger (its lines in the Prefect UI), or the module's outside a flow run."""
    from prefect.exceptions import MissingContextError

    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger(__name__)


@dataclass
class FollowedRun:
    """A run of `deployment` with `parameters`, named `name` (NAME-rN once started again), on
    `work_queue` (None: any of the pool's), started and followed through the Prefect API."""

    deployment: str
    parameters: dict[str, Any]
    name: str
    restarts_left: int = 0
    work_queue: str | None = None
    start_timeout_s: float | None = None  # None: it may wait for a worker as long as it takes
    attempt: int = 0
    flow_run_id: UUID | None = None
    started: float = field(default_factory=time.monotonic)
    checked: float = float("-inf")  # when its heartbeats were last read
    interval: float | None = None  # the heartbeat interval its job variables give it (given_interval)

    @property
    def run_name(self) -> str:
        return self.name_of(self.attempt)

    def name_of(self, attempt: int) -> str:
        return self.name + (f"-r{attempt}" if attempt else "")

    async def start(self, attempt: int = 0) -> None:
        """A new run as attempt `attempt` (NAME-rN); its id and attempt are set together, once it exists."""
        from prefect.deployments import arun_deployment

        flow_run = await arun_deployment(
            self.deployment,
            parameters=self.parameters,
            flow_run_name=self.name_of(attempt),
            work_queue_name=self.work_queue,
            timeout=0,
        )
        self.attempt, self.flow_run_id = attempt, flow_run.id
        self.started, self.checked = time.monotonic(), float("-inf")

    async def outcome(self) -> str | None:
        """None while it runs or waits for a worker (a run that crashed or was lost is started again
        here, while restarts are left); "" once it completed; else what failed."""
        from prefect.client.orchestration import get_client
        from prefect.states import Crashed

        async with get_client() as client:
            flow_run = await client.read_flow_run(self.flow_run_id)
            state = flow_run.state
            if state is not None and state.is_running() and time.monotonic() - self.checked >= LOST_CHECK_S:
                self.checked = time.monotonic()
                if self.interval is None:
                    self.interval = await given_interval(client, flow_run)
                if silent := await heartbeats_stopped(client, flow_run, self.interval):
                    state = Crashed(message=f"no heartbeat for {silent:.0f} s: taken for lost with its host")
                    await client.set_flow_run_state(self.flow_run_id, state, force=True)
        if state is not None and state.is_completed():
            return ""
        if state is not None and state.is_crashed() and self.restarts_left > 0:
            run_log().warning(
                "flow run %s crashed (%s); starting it again as %s-r%d (%d restart(s) left after)",
                self.run_name,
                state.message,
                self.name,
                self.attempt + 1,
                self.restarts_left - 1,
            )
            await self.start(self.attempt + 1)
            self.restarts_left -= 1
            return None
        if state is not None and state.is_final():
            return f"flow run {self.run_name} ended {state.type.value}: {state.message}"
        waiting = state is None or state.is_scheduled() or state.is_pending()
        if waiting and self.start_timeout_s is not None and time.monotonic() - self.started > self.start_timeout_s:
            where, fix = (
                (f"work queue {self.work_queue!r}", f"prefect worker start --pool POOL --work-queue {self.work_queue}")
                if self.work_queue
                else ("its pool", "prefect worker start --pool POOL")
            )
            return f"no worker took flow run {self.run_name} from {where} in {self.start_timeout_s:.0f} s; start one: {fix}"
        return None

    async def cancel(self) -> None:
        """Ask for its end: one no worker took never starts; a running one is stopped by its worker
        (a rollout stores its finished groups, a trainer ends after its step in progress)."""
        from prefect.client.orchestration import get_client
        from prefect.states import Cancelled, Cancelling

        async with get_client() as client:
            state = (await client.read_flow_run(self.flow_run_id)).state
            if state is not None and not state.is_final():
                waiting = state.is_scheduled() or state.is_pending()
                await client.set_flow_run_state(self.flow_run_id, Cancelled() if waiting else Cancelling(), force=True)

    async def stopped(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Once cancelled: waits for its end; one whose worker has not ended it in `timeout_s` (its
        host is gone with the worker) is marked crashed."""
        from prefect.client.orchestration import get_client
        from prefect.states import Crashed

        deadline = time.monotonic() + timeout_s
        async with get_client() as client:
            while not (await client.read_flow_run(self.flow_run_id)).state.is_final():
                if time.monotonic() > deadline:
                    message = f"its worker did not end it within {timeout_s:.0f} s of its cancel: taken for lost"
                    await client.set_flow_run_state(self.flow_run_id, Crashed(message=message), force=True)
                    return
                await asyncio.sleep(1.0)


async def heartbeats_stopped(client, flow_run, given: float) -> float | None:
    """Seconds since the run's last heartbeat (or its start, before the first) when that is over
    LOST_AFTER_BEATS of its intervals: the gap between its last two heartbeats, or, before it sent
    two, `given` (given_interval); None while it is alive."""
    from prefect.events.filters import EventFilter, EventNameFilter, EventOccurredFilter, EventResourceFilter

    since = flow_run.start_time or flow_run.expected_start_time or datetime.now(UTC)
    page = await client.read_events(
        filter=EventFilter(
            occurred=EventOccurredFilter(since=since - timedelta(seconds=1)),
            event=EventNameFilter(name=[HEARTBEAT]),
            resource=EventResourceFilter(id=[f"prefect.flow-run.{flow_run.id}"]),
        ),
        limit=2,
    )
    beats = sorted((event.occurred for event in page.events), reverse=True)
    interval = (beats[0] - beats[1]).total_seconds() if len(beats) == 2 else None
    interval = interval or given
    silent = (datetime.now(UTC) - (beats[0] if beats else since)).total_seconds()
    return silent if silent > LOST_AFTER_BEATS * interval else None


async def given_interval(client, flow_run) -> float:
    """The heartbeat interval a run's process was given: PREFECT_FLOWS_HEARTBEAT_FREQUENCY in the
    env of its job variables (the run's own, else its deployment's: prefect.yaml sets 30), else this
    process's setting (Prefect's default: 180); at least Prefect's minimum, 30."""
    from prefect.settings import get_current_settings

    sources = [flow_run.job_variables or {}]
    if flow_run.deployment_id is not None:
        sources.append((await client.read_deployment(flow_run.deployment_id)).job_variables or {})
    for job_variables in sources:
        if (value := (job_variables.get("env") or {}).get("PREFECT_FLOWS_HEARTBEAT_FREQUENCY")) is not None:
            return max(float(value), 30.0)
    return max(float(get_current_settings().flows.heartbeat_frequency or 180), 30.0)


async def follow(run: FollowedRun, poll_s: float = 2.0) -> UUID:
    """Start `run` and wait for it to complete (started again after a crash or a lost host while
    restarts are left); raises what failed. Cancelled, it cancels the run and waits for its end."""
    await run.start()
    try:
        while (outcome := await run.outcome()) is None:
            await asyncio.sleep(poll_s)
    except asyncio.CancelledError:
        await run.cancel()
        raise
    if outcome:
        raise RuntimeError(outcome)
    assert run.flow_run_id is not None
    return run.flow_run_id
