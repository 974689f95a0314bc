"""Runs of the rollout deployment that the pipeline starts and follows (rollout.deployment in a
pipeline config): each is taken by a worker of the deployment's pool, possibly on another host, and
runs as a child of the pipeline's flow run. A run that crashed, or was lost with its host, is
started again; the trainer's nodes are followed the same way by flows.train_node.NodeRuns.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from prefect import get_run_logger

from storage.layout import split_run_url
from storage.progress import DEAD_AFTER_S, read_sampler_positions

LOST_CHECK_S = 10.0  # how often a running rollout flow run's sampler slot is looked at


async def run_rollout_deployment(deployment: str, parameters: dict[str, Any], name: str, restarts: int = 0) -> Any:
    """A run of the rollout deployment, taken by whichever worker of its pool is free, as a child
    of this flow run; waits for it, and cancels it when cancelled (its worker stops it, the rollout
    stores its finished groups). A run that crashed, or was lost with its host (still Running while
    its sampler slot has been silent for DEAD_AFTER_S: it is marked crashed), is started again as
    a new run (NAME-rN), `restarts` times at most; the new one samples in a free slot."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import arun_deployment
    from prefect.states import Cancelling, Crashed

    storage, run = split_run_url(parameters["run_url"])
    attempt = 0
    while True:
        run_name = name + (f"-r{attempt}" if attempt else "")
        flow_run = await arun_deployment(deployment, parameters=parameters, flow_run_name=run_name, timeout=0)
        try:
            state = await wait_for_rollout_run(flow_run.id, storage, run)
        except asyncio.CancelledError:
            async with get_client() as client:
                await client.set_flow_run_state(flow_run.id, Cancelling(), force=True)
            raise
        if state is None:  # lost with its host
            async with get_client() as client:
                await client.set_flow_run_state(
                    flow_run.id,
                    Crashed(
                        message=f"its sampler slot was silent for {DEAD_AFTER_S:.0f} s: taken for lost with its host"
                    ),
                    force=True,
                )
        elif state.is_completed():
            return flow_run.id
        elif not state.is_crashed() or attempt >= restarts:
            raise RuntimeError(f"rollout flow run {run_name} ended {state.type.value}: {state.message}")
        if attempt >= restarts:
            raise RuntimeError(
                f"rollout flow run {run_name} was lost with its host, and no restart is left (rollout.restarts)"
            )
        attempt += 1
        run_log().warning(
            "rollout flow run %s %s; starting it again as %s-r%d",
            run_name,
            "was lost with its host" if state is None else "crashed",
            name,
            attempt,
        )


def run_log():
    """The flow run's logger (its lines in the Prefect UI), or the module's outside a flow run."""
    from prefect.exceptions import MissingContextError

    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger(__name__)


async def wait_for_rollout_run(flow_run_id, storage: str, run: str):
    """The rollout flow run's final state, or None once it is lost: Running while its sampler slot
    (its holder: the flow run's id) has not been written for DEAD_AFTER_S."""
    from prefect.client.orchestration import get_client

    checked = time.monotonic()
    while True:
        async with get_client() as client:
            state = (await client.read_flow_run(flow_run_id)).state
        if state is not None and state.is_final():
            return state
        if state is not None and state.is_running() and time.monotonic() - checked > LOST_CHECK_S:
            checked = time.monotonic()
            slots = await asyncio.to_thread(read_sampler_positions, storage, run)
            mine = [slot for slot in slots if slot.holder == str(flow_run_id) and not slot.closed]
            if mine and time.time() - mine[0].updated_at > DEAD_AFTER_S:
                return None
        await asyncio.sleep(2.0)
