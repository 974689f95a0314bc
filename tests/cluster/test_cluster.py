"""The loop's parts on four hosts of a cluster built on this machine (issue 33, cluster/cluster.sh):
a: the Prefect server and the S3 API (moto); b: the vLLM policy server with its reload watcher;
c: a rollout flow; c and d: one trainer rank each, a two-node torchrun rendezvous with gloo over the
bridge. Hosts share nothing but what they reach over the bridge: the model goes through S3 (each
host fetches its own copy), rollouts and checkpoints too, and nothing runs on loopback but a host's
own calls to itself."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

import pytest

from tests.cluster.hosts import Cluster, unavailable

pytestmark = [pytest.mark.integration, pytest.mark.slow]

KEY = "cluster-key"
RUN = "s3://runs/demo"
FETCH_MODEL = "python -c \"import fsspec; fsspec.filesystem('s3').get('s3://models/tiny', '/tmp/model', recursive=True)\""


@pytest.fixture(scope="module")
def cluster():
    if reason := unavailable():
        pytest.skip(f"no cluster on this machine: {reason}")
    hosts = Cluster(f"ct{os.getpid() % 100000}")
    hosts.down()  # a cluster left by a killed run of this name
    hosts.up()
    try:
        yield hosts
    finally:
        hosts.down()


def answers(url: str, body: bytes) -> bool:
    """Whether `url`, asked from this machine's own network, answers `body` (this machine's network
    may have a proxy that answers any address, so a connection alone proves nothing)."""
    try:
        with urllib.request.urlopen(url, timeout=3) as response:
            return response.read() == body
    except (OSError, urllib.error.URLError):
        return False


def test_a_run_across_four_hosts(cluster):
    c, s3 = cluster, cluster.s3_env()
    a, b = c.host("a"), c.host("b")
    c.spawn("a", "prefect", f"PREFECT_SERVER_ANALYTICS_ENABLED=false PREFECT_UI_API_URL=http://{a}:4200/api "
                            "exec prefect server start --host 0.0.0.0 --port 4200")  # fmt: skip
    c.spawn("a", "s3", "exec moto_server -H 0.0.0.0 -p 5000")
    c.wait("c", f"curl -sf -m 2 http://{a}:5000/moto-api/ > /dev/null", "the S3 API on a", 60, (("a", "s3"),))
    # The model is built on c and reaches every other host through object storage only.
    c.run("c", f"{s3} python -c \"import fsspec; from inference.tiny_model import build_tiny_model; "
               "build_tiny_model('/tmp/model', seed=0, size='small'); fs = fsspec.filesystem('s3'); "
               "fs.mkdir('models'); fs.mkdir('runs'); fs.put('/tmp/model', 's3://models/tiny', recursive=True)\"")  # fmt: skip
    for host in ("b", "d"):
        c.run(host, f"{s3} {FETCH_MODEL}")
    c.spawn("b", "vllm", f"{s3} CLOTHO_VLLM_ARGS=--enforce-eager VLLM_ENABLE_V1_MULTIPROCESSING=0 exec clotho serve "
                         f"--model /tmp/model --host 0.0.0.0 --port 8000 --api-key {KEY} --run {RUN} --log-file /tmp/vllm-server.log")  # fmt: skip
    auth = f"-H 'Authorization: Bearer {KEY}'"
    c.wait("c", f"curl -sf -m 2 {auth} http://{b}:8000/v1/models > /dev/null", "the policy server on b", 300, (("b", "vllm"),))
    c.wait("c", f"curl -sf -m 2 http://{a}:4200/api/health > /dev/null", "the Prefect server on a", 180, (("a", "prefect"),))

    # Each host is its own: its hostname and address, its /tmp; the checkout read-only; the
    # cluster's files hidden; the machine's own network cannot reach the hosts.
    seen = c.run("c", "hostname; ls /tmp/vllm-server.log 2>&1; touch /work/main/x 2>&1 || true; ls $CLOTHO_CLUSTER_ROOT 2>&1 || true").stdout
    assert c.host("c") in seen and "No such file" in seen and "Read-only file system" in seen, seen
    assert not answers(f"http://{c.run('c', f'getent hosts {a}').stdout.split()[0]}:4200/api/health", b"true")

    # Rollouts on c: the Prefect API on a, the server on b, shards to S3 on a.
    rollout = c.run("c", f"{s3} PREFECT_API_URL=http://{a}:4200/api clotho rollout --run {RUN} --server http://{b}:8000 "
                         f"--api-key {KEY} --env compare --set group_size=8 --set max_tokens=4 --groups 8 --tokenizer /tmp/model", timeout=300)  # fmt: skip
    assert "'groups': 8, 'failures': 0" in rollout.stdout + rollout.stderr, rollout.stdout[-2000:]

    # The trainer on c and d: two nodes, one rank each, rendezvous at c over the bridge.
    for rank, host in enumerate(("c", "d")):
        c.spawn(host, "train", f"{s3} exec torchrun --nnodes 2 --node-rank {rank} --nproc-per-node 1 --master-addr {c.host('c')} "
                               f"--master-port 29500 -m trainer.cli -- --run {RUN} --model /tmp/model --steps 2 --work-dir /tmp/work "
                               "--set groups_per_step=4 --set lr=1e-4 --data-timeout-s 120")  # fmt: skip
    for host in ("c", "d"):
        c.wait_exit(host, "train", 300)
    trained = c.log("c", "train")
    assert "on 2 rank(s)" in trained and f"published {RUN}/checkpoints/step-00000002" in trained, trained[-3000:]
    assert "Traceback" not in trained + c.log("d", "train"), c.log("d", "train")[-3000:]

    # b's watcher fetched the checkpoint from S3 and reloaded it: the server serves version 2.
    info = c.wait("d", f"curl -sf -m 2 {auth} http://{b}:8000/weight_info | grep -q '\"2\"' && curl -s {auth} http://{b}:8000/weight_info",
                  "the server on b at version 2", 180, (("b", "vllm"),))  # fmt: skip
    assert json.loads(info)["weight_version"] == "2"
    # The two steps took the rollout's 8 groups, 4 each, none skipped as stale.
    position = c.run("d", f"{s3} python -c \"from dataclasses import asdict; from storage.progress import read_trainer_position; "
                          f"import json; print(json.dumps(asdict(read_trainer_position('s3://runs', 'demo'))))\"").stdout  # fmt: skip
    assert json.loads(position.strip().splitlines()[-1])["groups_consumed"] == 8, position
    assert trained.count("stale_groups_skipped=0") == 2, trained[-3000:]
