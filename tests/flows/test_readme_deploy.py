"""The README's deploy block, run as printed (bash, from the repository root, on port 4200 as the
README says) with a Prefect home that does not exist yet; then a run of one of the deployments it
made, taken by the worker it started, writing shards from the session's vLLM server."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from storage.reader import ShardReader

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
MARKER = "<!-- deploy-block -->"


def deploy_block() -> str:
    """The bash block after the README's deploy marker, exactly as printed."""
    text = (REPO / "README.md").read_text()
    assert text.count(MARKER) == 1, f"README.md needs exactly one {MARKER}"
    return text[text.index(MARKER) :].split("```bash\n", 1)[1].split("```", 1)[0]


def test_the_readme_deploy_block_works_as_printed(tmp_path, policy_server, tiny_model_dir) -> None:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", 4200))
        except OSError:
            pytest.fail("port 4200 is taken: the README's block starts Prefect's server there; stop what holds it")
    # A new user's shell: a home without ~/.prefect, the project's venv on PATH, no Prefect settings.
    home = tmp_path / "home"
    home.mkdir()
    environment = {name: value for name, value in os.environ.items() if not name.startswith("PREFECT_")}
    environment |= {"HOME": str(home), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    script, log = tmp_path / "deploy.sh", tmp_path / "deploy.log"
    script.write_text("set -euo pipefail\n" + deploy_block())
    with log.open("w") as sink:  # its own session: the background server and worker stop with it below
        block = subprocess.Popen(
            ["bash", str(script)],
            cwd=REPO,
            env=environment,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        block.wait(timeout=600)
        output = log.read_text()
        assert block.returncode == 0, output[-5000:]
        assert "anonymous usage data" not in output, output[-3000:]  # DO_NOT_TRACK=1: no telemetry notice
        client = {**environment, "PREFECT_API_URL": "http://127.0.0.1:4200/api", "DO_NOT_TRACK": "1"}

        def prefect(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
            done = subprocess.run(
                [str(Path(sys.executable).with_name("prefect")), *args],
                cwd=REPO,
                env=client,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
            assert done.returncode == 0, f"prefect {' '.join(args)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            return done

        api = "http://127.0.0.1:4200/api"
        pools = {pool["name"] for pool in httpx.post(f"{api}/work_pools/filter", json={}, timeout=30).json()}
        assert {"rollout-pool", "train-pool", "inference-pool", "reprocess-pool"} <= pools, pools
        names = sorted(
            deployment["name"] for deployment in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]
        )
        deployed = sorted(
            deployment["name"] for deployment in httpx.post(f"{api}/deployments/filter", json={}, timeout=30).json()
        )
        assert deployed == names, (deployed, names)  # `deploy --all`: every deployment of prefect.yaml

        # The worker the block left running takes a run of a deployment it made.
        run_url = f"file://{tmp_path}/store/readme"
        watched = prefect(
            "deployment",
            "run",
            "rollout/rollout-arithmetic",
            "--param",
            "groups=2",
            "--param",
            f"servers={json.dumps([policy_server.base_url])}",
            "--param",
            f"tokenizer={tiny_model_dir}",
            "--param",
            f"run_url={run_url}",
            "--watch",
            "--watch-timeout",
            "300",
            timeout=400,
        )
        assert "Flow run finished successfully" in watched.stdout, watched.stdout[-3000:]
        root, run = run_url.rsplit("/", 1)
        assert len(list(ShardReader(root, run).groups())) >= 2
    finally:
        stop_session(block)


def stop_session(leader: subprocess.Popen) -> None:
    """SIGTERM to the block's session (the background Prefect server, the worker), SIGKILL to what is
    left after 30 s."""
    for sent, wait in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(leader.pid, sent)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                os.killpg(leader.pid, 0)  # ProcessLookupError once every one is gone
                time.sleep(0.5)
                leader.poll()  # reap the leader itself
            continue
        return
    raise AssertionError(f"the README block's processes outlived SIGKILL (session {leader.pid})")
