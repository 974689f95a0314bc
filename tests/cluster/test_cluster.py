"""The loop's parts on four hosts of a cluster built on this machine (issue 33, cluster/cluster.sh):
a: the Prefect server and the S3 API (moto); b: the vLLM policy server with its reload watcher;
c: a rollout flow; c and d: one trainer rank each, a two-node torchrun rendezvous with gloo over the
bridge. Hosts share nothing but what they reach over the bridge: the model goes through S3 (each
host fetches its own copy), rollouts and checkpoints too, and nothing runs on loopback but a host's
own calls to itself."""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.request

import pytest

from cluster.hosts import (
    AUTH,
    KEY,
    MODEL,
    Cluster,
    deploy_loop,
    loop_config,
    serve,
    start_shared_services,
    start_workers,
    tally,
    unavailable,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RUN = "s3://runs/demo"


@pytest.fixture(scope="module")
def cluster():
    """The cluster with its shared services up (Prefect and S3 on a, the model on every host)."""
    if reason := unavailable():
        pytest.skip(f"no cluster on this machine: {reason}")
    c = Cluster(f"ct{os.getpid() % 100000}")
    c.down()  # a cluster left by a killed run of this name
    c.up()
    try:
        start_shared_services(c)
        yield c
    finally:
        c.down()


def answers(url: str, body: bytes) -> bool:
    """Whether `url`, asked from this machine's own network, answers `body` (this machine's network
    may have a proxy that answers any address, so a connection alone proves nothing)."""
    try:
        with urllib.request.urlopen(url, timeout=3) as response:
            return response.read() == body
    except (OSError, urllib.error.URLError):
        return False


def two_node_trainer(c: Cluster, name: str, port: int, steps: int, settings: str = "") -> None:
    """`clotho train` up to `steps` as two nodes of one rank each, c (rank 0, the rendezvous) and
    d, each with its work dir in its own /tmp; returns once both ended."""
    for rank, host in enumerate(("c", "d")):
        c.spawn(
            host,
            name,
            f"{c.s3_env()} exec torchrun --nnodes 2 --node-rank {rank} --nproc-per-node 1 --master-addr {c.host('c')} "
            f"--master-port {port} -m trainer.cli -- --run {RUN} --model {MODEL} --steps {steps} --work-dir /tmp/work "
            f"--set groups_per_step=4 --set lr=1e-4 --set max_lag=4 --data-timeout-s 120 {settings}",
        )
    for host in ("c", "d"):
        c.wait_exit(host, name, 300)


def test_the_loops_parts_across_four_hosts(cluster):
    c, s3 = cluster, cluster.s3_env()
    a = c.host("a")
    server = serve(c, "vllm", 8000, RUN)

    # Each host is its own: its hostname and address, its /tmp; the checkout read-only; the
    # cluster's files hidden; the machine's own network cannot reach the hosts.
    seen = c.run(
        "c",
        "hostname; ls /tmp/vllm-server.log /tmp/vllm.log 2>&1; touch $REPO/x 2>&1 || true; "
        "echo hidden: $(ls -A $CLUSTER_ROOT | wc -l)",
    ).stdout
    assert seen.startswith(c.host("c")) and seen.count("No such file") == 2, seen  # b's files are b's
    assert "Read-only file system" in seen and "hidden: 0" in seen, seen
    assert not answers(f"http://{c.run('c', f'getent hosts {a}').stdout.split()[0]}:4200/api/health", b"true")

    # Rollouts on c: the Prefect API on a, the server on b, shards to S3 on a.
    rollout = c.run(
        "c",
        f"{s3} PREFECT_API_URL=http://{a}:4200/api clotho rollout --run {RUN} --server {server} "
        f"--api-key {KEY} --env compare --set group_size=8 --set max_tokens=4 --groups 12 --tokenizer {MODEL}",
        timeout=300,
    )
    assert "'groups': 12, 'failures': 0" in rollout.stdout + rollout.stderr, rollout.stdout[-2000:]

    # The trainer on c and d: two nodes, one rank each, rendezvous at c over the bridge.
    two_node_trainer(c, "train", 29500, steps=2)
    trained = c.log("c", "train")
    assert "on 2 rank(s)" in trained and f"published {RUN}/checkpoints/step-00000002" in trained, trained[-3000:]
    for host in ("c", "d"):  # torchrun's agents may log a traceback of their exit barrier when the other ends first
        ours = [line for line in c.log(host, "train").splitlines() if "elastic/agent/server/api.py" not in line]
        assert not any("Traceback" in line for line in ours), "\n".join(ours[-60:])

    # Resumed on the same two hosts, which share no disk. With the resume state only on the nodes'
    # disks, rank 0 holds it and rank 1 does not: both stop with an error that says so (not rank 1
    # training afresh from the base weights). With the copy in S3 (the default for a run in S3),
    # d fetches it and both resume from step 2.
    two_node_trainer(c, "resume-local", 29501, steps=3, settings="--set state_in_storage=false")
    for host in ("c", "d"):
        said = " ".join(
            re.sub(r"\[rank\d\]: ", "", c.log(host, "resume-local")).split()
        )  # rich wraps the message, torchrun prefixes lines
        assert (
            f"rank 0 on {c.host('c')} resumes from step-00000002, which rank 1 on {c.host('d')} cannot read there"
            in said
        ), said[-3000:]
    two_node_trainer(c, "resume", 29502, steps=3)
    resumed = {host: c.log(host, "resume") for host in ("c", "d")}
    assert (
        "resuming from step 2 to 3 on 2 rank(s)" in resumed["c"]
        and f"published {RUN}/checkpoints/step-00000003" in resumed["c"]
    ), resumed["c"][-3000:]
    assert "resume state step-00000002 fetched" in resumed["d"] and "fetched" not in resumed["c"], resumed["d"][-3000:]

    # b's watcher fetched each checkpoint from S3 and reloaded it: the server serves version 3.
    info = c.wait(
        "d",
        f"curl -sf -m 2 {AUTH} {server}/weight_info | grep -q '\"3\"' && curl -s {AUTH} {server}/weight_info",
        "the server on b at version 3",
        180,
        (("b", "vllm"),),
    )
    assert json.loads(info)["weight_version"] == "3"
    # The three steps took the rollout's 12 groups, 4 each, none skipped as stale.
    position = c.run(
        "d",
        f'{s3} python -c "from dataclasses import asdict; from storage.progress import read_trainer_position; '
        f"import json; print(json.dumps(asdict(read_trainer_position('s3://runs', 'demo'))))\"",
    ).stdout
    assert json.loads(position.strip().splitlines()[-1])["groups_consumed"] == 12, position
    assert trained.count("stale_groups_skipped=0") == 2 and resumed["c"].count("stale_groups_skipped=0") == 1, trained[
        -3000:
    ]


def test_clotho_run_drives_the_cluster(cluster):
    """`clotho run` on a with a single-machine config's format and `trainer_nodes`: its rollout flows
    are runs of the rollout deployment taken by the workers on c and d, the trainer is two nodes,
    c (rank 0) and d, each a run of the train-node deployment on its own work queue, and the server
    on b reloads itself from S3. The pipeline follows the trainer through S3 and the Prefect API."""
    c, s3 = cluster, cluster.s3_env()
    server = serve(c, "vllm-loop", 8001, "s3://runs/loop")
    deploy_loop(c)
    for host in ("c", "d"):
        start_workers(c, host)
    c.run("a", f"cat > /tmp/loop.yaml << 'EOF'\n{loop_config(c, 's3://runs/loop', server, 6)}\nEOF")
    ran = c.run(
        "a",
        f"{s3} {c.api_env()} CLOTHO_API_KEY={KEY} clotho run /tmp/loop.yaml > /tmp/run.log 2>&1; echo exit $?; tail -c 4000 /tmp/run.log",
        timeout=600,
        check=False,
    )
    workers = "".join(c.log(host, name)[-2000:] for host in ("c", "d") for name in ("worker", "train-worker"))
    assert "exit 0" in ran.stdout, ran.stdout + workers

    # Every step published, each took the 4 groups it trained and any it skipped as stale (no group
    # consumed untrained), none taken twice, no torn shard: read from the run's files on d, as
    # `make soak` reads them.
    tallied = tally(c, "s3://runs/loop")
    assert tallied["steps"] == [1, 2, 3, 4, 5, 6] and all(
        tallied["took"][step] == tallied["read"][step] >= 4 for step in tallied["took"]
    ), tallied
    assert tallied["lost"] == tallied["twice"] == 0 and not tallied["torn"] and not tallied["regressions"], tallied
    ran_log = c.run("a", "cat /tmp/run.log").stdout
    assert "no reload watcher here" in ran_log, ran_log[-3000:]
    assert "[rl] step 6/6" in ran_log, ran_log[-3000:]  # the pipeline followed the remote trainer's steps through S3
    # The trainer ran as two nodes, rank 0 on c: each node's flow run on its own host.
    for host in ("c", "d"):
        assert "Completed" in c.log(host, "train-worker"), c.log(host, "train-worker")[-3000:]
    trained = c.run("c", "cat /tmp/train-loop/trainer-node0.log").stdout
    assert "on 2 rank(s)" in trained and "step 6:" in trained, trained[-3000:]
    assert "step 6:" not in c.run("d", "cat /tmp/train-loop/trainer-node1.log").stdout  # rank 0 alone logs the steps
    # The server on b reloaded itself to the newest version; both workers took rollout flows.
    info = c.wait(
        "d",
        f"curl -sf -m 2 {AUTH} {server}/weight_info | grep -q '\"6\"' && curl -s {AUTH} {server}/weight_info",
        "the server on b at version 6",
        180,
        (("b", "vllm-loop"),),
    )
    assert json.loads(info)["weight_version"] == "6"
    for host in ("c", "d"):
        assert "rollout" in c.log(host, "worker") and "Completed" in c.log(host, "worker"), c.log(host, "worker")[
            -3000:
        ]
