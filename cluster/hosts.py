"""A cluster of hosts on this machine for tests (cluster/cluster.sh: network namespaces on a bridge,
each host its own address, loopback, hostname, /tmp and a read-only checkout)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent / "cluster.sh"
# moto accepts any credentials; every host points botocore, s3fs and clotho's storage at host a's.
S3_CREDENTIALS = ("AWS_ACCESS_KEY_ID=testing", "AWS_SECRET_ACCESS_KEY=testing", "AWS_DEFAULT_REGION=us-east-1")


def unavailable() -> str | None:
    """Why no cluster can be built here (not root, no network namespaces), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"clotho-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class Cluster:
    """Hosts a, b, c, d of the cluster `name` (their names on the bridge: NAME-a ...)."""

    def __init__(self, name: str):
        self.name = name
        self.env = {**os.environ, "CLOTHO_CLUSTER": name, "CLOTHO_CLUSTER_ROOT": f"/var/tmp/{name}"}
        self.root = Path(self.env["CLOTHO_CLUSTER_ROOT"])

    def host(self, host: str) -> str:
        return f"{self.name}-{host}"

    def script(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([str(SCRIPT), *args], env=self.env, capture_output=True, text=True, timeout=timeout)

    def up(self) -> None:
        done = self.script("up")
        if done.returncode != 0:
            raise RuntimeError(f"cluster up: {done.stderr}")

    def down(self) -> None:
        self.script("down", timeout=120)

    def run(self, host: str, command: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        """`command` (a shell line) on `host`, to its end."""
        done = self.script("exec", host, "--", "bash", "-c", command, timeout=timeout)
        if check and done.returncode != 0:
            raise RuntimeError(
                f"on {host}: {command!r} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            )
        return done

    def spawn(self, host: str, name: str, command: str) -> None:
        """`command` on `host` in the background; its output in the host's /tmp/NAME.log."""
        done = self.script("spawn", host, name, "--", "bash", "-c", command)
        if done.returncode != 0:
            raise RuntimeError(f"spawn on {host}: {done.stderr}")

    def log(self, host: str, name: str) -> str:
        path = self.root / host / "tmp" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_exit(self, host: str, name: str, timeout: float) -> None:
        """Waits for what spawn(host, name, ...) started to end (its pid, as the machine sees it)."""
        pid = int((self.root / host / "tmp" / f"{name}.pid").read_text())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
                if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                    return  # ended, not yet reaped by whatever adopted it
            except (ProcessLookupError, FileNotFoundError):
                return
            time.sleep(0.5)
        raise TimeoutError(f"{name} on {host} still running after {timeout} s:\n{self.log(host, name)[-3000:]}")

    def wait(self, host: str, test: str, what: str, timeout: float, logs: tuple[tuple[str, str], ...] = ()) -> str:
        """Polls the shell test `test` on `host` until it exits 0; its output."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            done = self.run(host, test, timeout=30, check=False)
            if done.returncode == 0:
                return done.stdout
            time.sleep(1.0)
        tails = "\n".join(f"--- {h}:{n}.log\n{self.log(h, n)[-3000:]}" for h, n in logs)
        raise TimeoutError(f"{what}: not within {timeout} s (on {host}: {test})\n{tails}")

    def s3_env(self) -> str:
        return " ".join((*S3_CREDENTIALS, f"AWS_ENDPOINT_URL=http://{self.host('a')}:5000"))

    def api_env(self) -> str:
        return f"PREFECT_API_URL=http://{self.host('a')}:4200/api"

    def kill(self, host: str) -> None:
        """Every process on `host` killed at once (SIGKILL): the host lost. Its /tmp, its disk, stays."""
        done = self.script("kill", host)
        if done.returncode != 0:
            raise RuntimeError(f"kill {host}: {done.stderr}")

    def stop(self, host: str, name: str, timeout: float = 60) -> None:
        """What spawn(host, name, ...) started, stopped (SIGTERM) and waited for."""
        pid = int((self.root / host / "tmp" / f"{name}.pid").read_text())
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        self.wait_exit(host, name, timeout)


# The policy server's API key: the servers listen on the bridge, not on loopback.
KEY = "cluster-key"
AUTH = f"-H 'Authorization: Bearer {KEY}'"
# The model, built on c, in S3: every part on every host names it by this URL and fetches its own copy.
MODEL = "s3://models/tiny"


def start_shared_services(c: Cluster) -> None:
    """On a, the Prefect server and the S3 API; the model, built on c, in S3 at MODEL."""
    a, s3 = c.host("a"), c.s3_env()
    c.spawn(
        "a",
        "prefect",
        f"PREFECT_SERVER_ANALYTICS_ENABLED=false PREFECT_UI_API_URL=http://{a}:4200/api "
        "exec prefect server start --host 0.0.0.0 --port 4200",
    )
    c.spawn("a", "s3", "exec moto_server -H 0.0.0.0 -p 5000")
    c.wait("c", f"curl -sf -m 2 http://{a}:5000/moto-api/ > /dev/null", "the S3 API on a", 60, (("a", "s3"),))
    c.run(
        "c",
        f'{s3} python -c "import fsspec; from inference.tiny_model import build_tiny_model; '
        "build_tiny_model('/tmp/model', seed=0, size='small'); fs = fsspec.filesystem('s3'); "
        f"fs.mkdir('models'); fs.mkdir('runs'); fs.put('/tmp/model', '{MODEL}', recursive=True)\"",
    )
    c.wait(
        "c",
        f"curl -sf -m 2 http://{a}:4200/api/health > /dev/null",
        "the Prefect server on a",
        180,
        (("a", "prefect"),),
    )


def serve(c: Cluster, name: str, port: int, run: str) -> str:
    """`clotho serve` on b behind the key, its watcher reloading `run` from S3; its URL."""
    b = c.host("b")
    c.spawn(
        "b",
        name,
        f"{c.s3_env()} CLOTHO_VLLM_ARGS=--enforce-eager VLLM_ENABLE_V1_MULTIPROCESSING=0 exec clotho serve "
        f"--model {MODEL} --host 0.0.0.0 --port {port} --api-key {KEY} --run {run} --log-file /tmp/{name}-server.log",
    )
    c.wait(
        "c",
        f"curl -sf -m 2 {AUTH} http://{b}:{port}/v1/models > /dev/null",
        f"the policy server {name} on b",
        300,
        (("b", name),),
    )
    return f"http://{b}:{port}"


def deploy_loop(c: Cluster) -> None:
    """From the checkout, as the README deploys: the rollout and train pools, a work queue per
    trainer node (node-c, node-d), the rollout-pipeline and train-node deployments."""
    api = c.api_env()
    commands = [
        "prefect work-pool create rollout-pool --type process --overwrite",
        "prefect work-pool create train-pool --type process --overwrite",
        "prefect work-queue create node-c --pool train-pool",
        "prefect work-queue create node-d --pool train-pool",
        "prefect --no-prompt deploy --name rollout-pipeline --name train-node",
    ]
    deploy = " && ".join(f"{api} {command}" for command in commands)
    c.run("c", f"cd $REPO && ({deploy}) > /tmp/deploy.log 2>&1 || (cat /tmp/deploy.log; exit 1)", timeout=180)


def start_workers(c: Cluster, host: str, suffix: str = "") -> None:
    """On `host`: a worker of the rollout pool (one flow run at a time) and the worker of its
    trainer node's queue; logs worker{suffix}.log and train-worker{suffix}.log."""
    s3, api = c.s3_env(), c.api_env()
    c.spawn(
        host,
        f"worker{suffix}",
        f"{s3} {api} CLOTHO_API_KEY={KEY} exec prefect worker start --pool rollout-pool --limit 1 --name worker-{host}",
    )
    c.spawn(
        host,
        f"train-worker{suffix}",
        f"{s3} {api} exec prefect worker start --pool train-pool --work-queue node-{host} --name trainer-{host}",
    )


# `clotho run`'s config across the cluster: the server on b, rollout flows on c and d, the trainer
# as two nodes, c (rank 0: the rendezvous orders the nodes by host name) and d, meeting at the
# rendezvous the pipeline serves on a.
LOOP_CONFIG = """
run: {run}
model: {model}
max_lag: 1
servers: {{count: 0, urls: [{server}], reload_urls: false}}
rollout: {{flows: 2, deployment: rollout/rollout-pipeline, max_concurrent_groups: 4, task_run_s: 2.0}}
trainer: {{lr: 0.0001, save_every: 1, state_every: 2, keep_last: null}}  # the tally reads every step
trainer_nodes: {{work_queues: [node-c, node-d], rendezvous: "{a}:29400", work_dir: /tmp/train-{name}}}
phases:
  - name: rl
    steps: {steps}
    environments:
      - env: compare
        config: {{max_value: 9, group_size: 8, max_tokens: 4, temperature: 1.0, seed: 7}}
    trainer: {{groups_per_step: 4}}
"""


def loop_config(c: Cluster, run: str, server: str, steps: int) -> str:
    return LOOP_CONFIG.format(
        run=run, model=MODEL, server=server, a=c.host("a"), name=run.rsplit("/", 1)[-1], steps=steps
    )


def tally(c: Cluster, run_url: str) -> dict:
    """soak.checks.run_tally of the run, read on d from S3 (JSON keys: steps as strings made ints)."""
    out = c.run(
        "d",
        f'{c.s3_env()} PYTHONPATH=$REPO python -c "import json; from soak.checks import run_tally; '
        f"print(json.dumps(run_tally('{run_url}')))\"",
    ).stdout
    tallied = json.loads(out.strip().splitlines()[-1])
    for key in ("took", "read"):
        tallied[key] = {int(step): value for step, value in tallied[key].items()}
    return tallied
