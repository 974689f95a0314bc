"""The trainer on several hosts: one `train-node` flow run per node, each taken by the worker on that
node's own work queue, each running torchrun's elastic agent for its node; the agents meet at the
rendezvous the pipeline serves (a c10d store on the pipeline's host, so it outlives any node).

    pipeline (any host) --run_deployment(work_queue_name=Q_i)--> worker on node i --> train_node(node_rank=i)
      serves the rendezvous <------------- torchrun --rdzv-backend c10d --max-restarts R ----+
                                              -> clotho train ranks

When a node's trainer fails (its own error, or a peer gone), torchrun stops every node's ranks and
starts them again (R times at most), each resuming from the newest resume state in storage; a node
lost with its host is started again on its queue by the pipeline (flows.followed_runs) and joins
them. A node keeps its work dir (metrics.jsonl, TensorBoard, resume state) on its own disk; what the
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger

from core.processes import stop_process, tethered
from flows.followed_runs import FollowedRun
from storage.layout import split_run_url
from trainer.train import default_work_dir

REPO = Path(__file__).resolve().parents[1]
# A stopped trainer finishes its step in progress (publish included) first; then SIGKILL, which its
# resume state survives.
TRAINER_STOP_S = 120.0
# How long an agent waits for every node at a rendezvous: a node lost with its host is known as
# lost after three 30 s heartbeats, then its worker (back on its host) starts it again.
JOIN_TIMEOUT_S = 900
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
    rendezvous_id: str = "clotho",
    procs_per_node: int = 1,
    restarts: int = 3,
    overrides: list[str] | None = None,
    data_timeout_s: float = 600.0,
    work_dir: str | None = None,
) -> dict[str, Any]:
    """Node `node_rank` of `nodes` of the trainer (`procs_per_node` ranks here) up to `steps`:
    torchrun's elastic agent, meeting the others at `rendezvous` (HOST:PORT, the c10d store the
    pipeline serves) as `rendezvous_id`; it starts every node's ranks again after a failure,
    `restarts` times at most. Its output goes to {work_dir}/trainer-node{node_rank}.log and to this
    flow run's logs; fails when the trainer fails. `work_dir`: on this node's disk (None:
    .clotho/trainer/RUN in the working directory)."""
    logger = get_run_logger()
    storage, run = split_run_url(run_url)
    work_dir = Path(work_dir).resolve() if work_dir else default_work_dir(storage, run)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nodes),
        "--nproc-per-node",
        str(procs_per_node),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        rendezvous,
        "--rdzv-id",
        rendezvous_id,
        "--rdzv-conf",
        f"is_host=false,join_timeout={JOIN_TIMEOUT_S}",
        "--max-restarts",
        str(restarts),
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
            # Each rendezvous round's ranks meet at a store their rank 0 serves. With the agents'
            # shared store (torch's default), an agent that is not rank 0 keeps the first round's
            # address: after node 0's host was replaced its ranks wait at the dead one's (torch 2.13).
            env={**os.environ, "PYTHONUNBUFFERED": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
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
    """A phase's trainer as `train-node` flow runs, one per work queue (config.trainer_nodes), each
    followed (flows.followed_runs: one lost with its host is started again on its queue), and the
    rendezvous their agents meet at, served from here for the phase."""

    runs: list[FollowedRun]
    store: Any  # torch.distributed.TCPStore: the rendezvous, alive while this is

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
        store = serve_rendezvous(nodes.rendezvous)
        parameters = dict(
            run_url=config.run,
            model=config.model,
            steps=end_step,
            nodes=len(nodes.work_queues),
            rendezvous=nodes.rendezvous,
            rendezvous_id=f"{split_run_url(config.run)[1]}-{phase.name}-{os.urandom(4).hex()}",
            procs_per_node=nodes.procs_per_node,
            restarts=nodes.restarts,
            overrides=config.trainer_overrides(phase),
            data_timeout_s=config.data_timeout_s,
            work_dir=nodes.work_dir,
        )
        runs = cls(
            [
                FollowedRun(
                    nodes.deployment,
                    {**parameters, "node_rank": index},
                    f"{phase.name}-train-node{index}",
                    restarts_left=nodes.restarts,
                    work_queue=queue,
                    start_timeout_s=nodes.start_timeout_s,
                )
                for index, queue in enumerate(nodes.work_queues)
            ],
            store,
        )
        try:
            for run in runs.runs:
                await run.start()
        except BaseException:
            await runs.stop()
            raise
        return runs

    async def outcome(self) -> str | None:
        """None while the nodes train (a node lost with its host started again); "" once all
        completed; else what failed."""
        outcomes = [await run.outcome() for run in self.runs]
        failed = [outcome for outcome in outcomes if outcome]
        if failed:
            return failed[0]
        return "" if all(outcome == "" for outcome in outcomes) else None

    async def stop(self) -> None:
        """Cancel the nodes' flow runs still going (each stops its trainer after the step in
        progress) and wait for them to end (one whose worker does not end it is marked crashed)."""
        started = [run for run in self.runs if run.flow_run_id is not None]
        for run in started:
            await run.cancel()
        await asyncio.gather(*(run.stopped(TRAINER_STOP_S + 30) for run in started))


def serve_rendezvous(endpoint: str):
    """The c10d store the nodes' torchrun agents meet at (`--rdzv-conf is_host=false`), served on
    this host at `endpoint`'s port: it lives as long as the pipeline, not as any node."""
    from torch.distributed import TCPStore

    host, _, port = endpoint.rpartition(":")
    try:
        return TCPStore(host, int(port), is_master=True, multi_tenant=True, wait_for_workers=False)
    except (RuntimeError, ValueError) as error:
        raise RuntimeError(
            f"trainer_nodes.rendezvous: cannot serve the trainer nodes' rendezvous at {endpoint} ({error}); give "
            "this host's address as the nodes reach it and a free port"
        ) from None
