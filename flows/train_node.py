"""The trainer on several hosts: one `train-node` flow run per node, each taken by the worker on that
node's own work queue, each running torchrun for its node; the nodes meet at node 0's rendezvous.

    pipeline (any host) --run_deployment(work_queue_name=Q_i)--> worker on node i --> train_node(node_rank=i)
                                                                                     torchrun --node-rank i
                                                                                       -> clotho train ranks

A node keeps its work dir (metrics.jsonl, TensorBoard, resume state) on its own disk; what the
pipeline reads of the trainer goes through the run's storage (the steps' metrics, its position).
Cancelling a node's flow run stops its trainer at a step boundary (trainer.stopping).
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from uuid import UUID

from prefect import flow, get_run_logger

from core.processes import stop_process, tethered
from storage.layout import split_run_url
from trainer.train import default_work_dir

REPO = Path(__file__).resolve().parents[1]
# A stopped trainer finishes its step in progress (publish included) first; then SIGKILL, which its
# resume state survives.
TRAINER_STOP_S = 120.0
# After a node failed, the others' trainers fail within seconds (their peer is gone); a node whose
# worker has not ended its flow run by then lost its host with it.
LOST_AFTER_S = 60.0
LOG_TAIL_CHARS = 3000


def trainer_arguments(
    run_url: str, model: str, steps: int, overrides: list[str], data_timeout_s: float, work_dir: Path
) -> list[str]:
    """`clotho train`'s arguments (trainer.cli) for a pipeline phase, whoever launches it."""
    arguments = [
        "--run",
        run_url,
        "--model",
        model,
        "--steps",
        str(steps),
        "--data-timeout-s",
        str(data_timeout_s),
        "--work-dir",
        str(work_dir),
    ]
    for override in overrides:
        arguments += ["--set", override]
    return arguments


@flow(name="train-node")
def train_node(
    run_url: str,
    model: str,
    steps: int,
    nodes: int,
    node_rank: int,
    rendezvous: str,
    procs_per_node: int = 1,
    overrides: list[str] | None = None,
    data_timeout_s: float = 600.0,
    work_dir: str | None = None,
) -> dict[str, Any]:
    """Node `node_rank` of `nodes` of the trainer (`procs_per_node` ranks here) up to `steps`: torchrun
    with node 0's `rendezvous` (HOST:PORT) as its master. Its output goes to
    {work_dir}/trainer-node{node_rank}.log and to this flow run's logs; fails when the trainer fails.
    `work_dir`: on this node's disk (None: .clotho/trainer/RUN in the working directory)."""
    logger = get_run_logger()
    storage, run = split_run_url(run_url)
    work_dir = Path(work_dir).resolve() if work_dir else default_work_dir(storage, run)
    host, _, port = rendezvous.rpartition(":")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nodes),
        "--node-rank",
        str(node_rank),
        "--nproc-per-node",
        str(procs_per_node),
        "--master-addr",
        host,
        "--master-port",
        port,
        "-m",
        "trainer.cli",
        "--",
        *trainer_arguments(run_url, model, steps, overrides or [], data_timeout_s, work_dir),
    ]
    work_dir.mkdir(parents=True, exist_ok=True)
    log_path = work_dir / f"trainer-node{node_rank}.log"
    offset = log_path.stat().st_size if log_path.exists() else 0
    logger.info(
        "node %d of %d on %s: %d rank(s), rendezvous %s, work dir %s",
        node_rank,
        nodes,
        socket.gethostname(),
        procs_per_node,
        rendezvous,
        work_dir,
    )
    with log_path.open("a") as log_file:
        # Its own session: a cancel's signal reaches it once, from here (torchrun passes it to its ranks).
        process = subprocess.Popen(
            tethered(command),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            cwd=REPO,
            start_new_session=True,
        )
    try:
        while process.poll() is None:
            time.sleep(1.0)
            offset = forward_lines(log_path, offset, logger)
    finally:
        stop_process(process, TRAINER_STOP_S)
        forward_lines(log_path, offset, logger)
    if process.returncode != 0:
        tail = log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
        raise RuntimeError(
            f"trainer node {node_rank} on {socket.gethostname()} exited with {process.returncode} ({log_path}):\n{tail}"
        )
    return {"node_rank": node_rank, "host": socket.gethostname(), "work_dir": str(work_dir)}


def forward_lines(path: Path, offset: int, logger) -> int:
    """The trainer's whole new lines at `path` from `offset` to the flow run's log; the new offset."""
    with path.open("rb") as file:
        file.seek(offset)
        data = file.read()
    complete = data[: data.rfind(b"\n") + 1]
    for line in complete.decode(errors="replace").splitlines():
        if line.strip():
            logger.info("%s", line)
    return offset + len(complete)


@dataclass
class NodeRuns:
    """A phase's trainer as `train-node` flow runs, one per work queue (config.trainer_nodes), from
    the pipeline: started, followed, started again after a node failed or was lost (each node
    resumes from the newest resume state in storage) and stopped, through the Prefect API,
    wherever the nodes are."""

    deployment: str
    work_queues: list[str]
    parameters: dict[str, Any]
    phase: str
    start_timeout_s: float
    restarts_left: int
    attempt: int = 0
    names: list[str] = field(default_factory=list)
    ids: list[UUID] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    @classmethod
    async def start(cls, config, phase, end_step: int) -> NodeRuns:
        """One flow run per node of `config.trainer_nodes` for `phase` up to `end_step`; fails at once,
        naming the fix, when the deployment or a node's work queue is not there."""
        from prefect.client.orchestration import get_client
        from prefect.exceptions import ObjectNotFound

        nodes = config.trainer_nodes
        async with get_client() as client:
            try:
                deployment = await client.read_deployment_by_name(nodes.deployment)
            except ObjectNotFound:
                raise RuntimeError(
                    f"trainer_nodes.deployment: no deployment {nodes.deployment!r}; deploy it from the checkout: "
                    "prefect --no-prompt deploy --name train-node"
                ) from None
            pool = deployment.work_pool_name
            for index, queue in enumerate(nodes.work_queues):
                try:
                    await client.read_work_queue_by_name(queue, work_pool_name=pool)
                except ObjectNotFound:
                    raise RuntimeError(
                        f"trainer_nodes.work_queues[{index}]: no work queue {queue!r} in pool {pool!r}; create it and start "
                        f"node {index}'s worker on it: prefect work-queue create {queue} --pool {pool}; "
                        f"prefect worker start --pool {pool} --work-queue {queue}"
                    ) from None
        parameters = dict(
            run_url=config.run,
            model=config.model,
            steps=end_step,
            nodes=len(nodes.work_queues),
            rendezvous=nodes.rendezvous,
            procs_per_node=nodes.procs_per_node,
            overrides=config.trainer_overrides(phase),
            data_timeout_s=config.data_timeout_s,
            work_dir=nodes.work_dir,
        )
        runs = cls(
            nodes.deployment, list(nodes.work_queues), parameters, phase.name, nodes.start_timeout_s, nodes.restarts
        )
        await runs.launch()
        return runs

    async def launch(self) -> None:
        """A flow run for each node, on its queue (named PHASE-train-nodeI, then -rN on restarts)."""
        from prefect.deployments import arun_deployment

        self.names, self.ids, self.started = [], [], time.monotonic()
        try:
            for index, queue in enumerate(self.work_queues):
                name = f"{self.phase}-train-node{index}" + (f"-r{self.attempt}" if self.attempt else "")
                flow_run = await arun_deployment(
                    self.deployment,
                    parameters={**self.parameters, "node_rank": index},
                    flow_run_name=name,
                    work_queue_name=queue,
                    timeout=0,
                )
                self.names.append(name)
                self.ids.append(flow_run.id)
        except BaseException:
            await self.stop()
            raise

    async def outcome(self) -> str | None:
        """None while every node trains; "" once all completed; else what failed."""
        from prefect.client.orchestration import get_client

        async with get_client() as client:
            states = [(await client.read_flow_run(flow_run_id)).state for flow_run_id in self.ids]
        for name, queue, state in zip(self.names, self.work_queues, states):
            if state is not None and state.is_final() and not state.is_completed():
                return f"trainer node flow run {name} ended {state.type.value}: {state.message}"
            if (state is None or state.is_scheduled()) and time.monotonic() - self.started > self.start_timeout_s:
                return (
                    f"no worker took trainer node flow run {name} from work queue {queue!r} in {self.start_timeout_s:.0f} s "
                    f"(trainer_nodes.start_timeout_s); start one on that node: prefect worker start --work-queue {queue} --pool POOL"
                )
        return "" if all(state is not None and state.is_completed() for state in states) else None

    async def restart(self) -> None:
        """After a node failed or was lost (with restarts left): the others stopped (a node whose
        worker has not ended it in LOST_AFTER_S is taken for lost with its host and marked crashed),
        then every node started again, each resuming from the newest resume state in storage."""
        assert self.restarts_left > 0, "no restart left"
        self.restarts_left -= 1
        await self.stop(lost_after_s=LOST_AFTER_S)
        self.attempt += 1
        await self.launch()

    async def stop(self, lost_after_s: float = TRAINER_STOP_S + 30) -> None:
        """Cancel the nodes' flow runs still going (each stops its trainer after the step in
        progress) and wait for them to end; one whose worker has not ended it after `lost_after_s`
        (its host is gone) is marked crashed."""
        from prefect.client.orchestration import get_client
        from prefect.states import Cancelled, Cancelling, Crashed

        async with get_client() as client:
            going = []
            for flow_run_id in self.ids:
                state = (await client.read_flow_run(flow_run_id)).state
                if state.is_final():
                    continue
                # Not taken by a worker yet: it never starts. Taken: its worker stops it.
                await client.set_flow_run_state(
                    flow_run_id, Cancelled() if state.is_scheduled() else Cancelling(), force=True
                )
                going.append(flow_run_id)
            deadline = time.monotonic() + lost_after_s
            while going and time.monotonic() < deadline:
                await asyncio.sleep(1.0)
                going = [i for i in going if not (await client.read_flow_run(i)).state.is_final()]
            for flow_run_id in going:
                message = (
                    f"its worker did not end it within {lost_after_s:.0f} s of its cancel: taken for lost with its host"
                )
                await client.set_flow_run_state(flow_run_id, Crashed(message=message), force=True)
