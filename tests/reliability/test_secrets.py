"""No secret in any output: one real `clotho run` (its own keyed vLLM server, rollout subflows, the
DeepSpeed trainer, the reload watcher, evaluation) on the real S3 API server, with a dummy API key
and dummy S3 credentials in its environment; then every output is searched for them: stdout and
stderr, every log and file the run left under .clotho, every object in the bucket (raw bytes, and
each Parquet shard decoded: rows, footer metadata), the Prefect server's records through its API
(flow runs with their parameters, task runs, artifacts, logs) and its database file, and the
command line of every process while the run lasts.

CLOTHO_SECRETS_STEPS (default 2) sets the run's length: the soak runs it longer.
"""

from __future__ import annotations

import base64
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import psutil
import pyarrow.parquet as pq
import pytest
import s3fs
import yaml

from clotho.testing.s3_server import start_s3_server, stop_s3_server

REPO = Path(__file__).resolve().parents[2]
CLOTHO = str(Path(sys.executable).with_name("clotho"))
STEPS = int(os.environ.get("CLOTHO_SECRETS_STEPS", "2"))
# Their own nonce, not the run's: a run name in an output must not look like a leaked secret.
API_KEY = f"sk-dummy-SECRET-123-{secrets.token_hex(4)}"
AWS_SECRET = f"dummy-aws-SECRET-456-{secrets.token_hex(4)}"
BUCKET = "clotho-secrets"
LARGEST_FILE = 256 << 20


def needles() -> dict[bytes, str]:
    """Each secret as it could appear: verbatim, without its first characters (a masked prefix),
    in base64 (a Basic header, an encoded blob) at each of the three alignments."""
    found = {}
    for name, value in (("the API key", API_KEY), ("the S3 secret key", AWS_SECRET)):
        found[value.encode()] = name
        found[value[4:].encode()] = f"{name} (masked prefix)"
        for shift in range(3):
            encoded = base64.b64encode(b"x" * shift + value.encode())[4 if shift else 0 : -4]
            found[encoded] = f"{name} (base64)"
    return found


NEEDLES = needles()


def leaks(where: str, data: bytes) -> list[str]:
    return [f"{name} in {where}" for needle, name in NEEDLES.items() if needle in data]


class ArgvWatch:
    """The command line of every process on the machine, looked at twice a second while the run
    lasts: argv is readable by every local user (ps)."""

    def __init__(self, marker: str):
        self.marker, self.leaks, self.ours = marker, [], set()
        self.delivered = set()  # what the same search finds where the secrets belong: the run's environments
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.stop.is_set():
            for process in psutil.process_iter(["pid", "cmdline"]):
                line = " ".join(process.info["cmdline"] or [])
                if self.marker in line:
                    self.ours.add(line[:200])
                    try:
                        self.delivered.update(leaks("", "\0".join(process.environ().values()).encode()))
                    except psutil.Error:
                        pass
                self.leaks += [
                    f"{leak}: pid {process.info['pid']} {line[:300]}" for leak in leaks("a command line", line.encode())
                ]
            time.sleep(0.5)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def prefect_records(api_url: str, since: datetime) -> dict[str, list[dict]]:
    """What the Prefect server stored since `since`: flow runs (parameters, states), their task
    runs and logs, and artifacts."""
    with httpx.Client(base_url=api_url, timeout=60) as client:

        def every(path: str, body: dict) -> list[dict]:
            rows, offset = [], 0
            while True:
                page = client.post(path, json={**body, "limit": 200, "offset": offset})
                page.raise_for_status()
                rows += page.json()
                if len(page.json()) < 200:
                    return rows
                offset += 200

        after = {"after_": since.isoformat()}
        flow_runs = every("/flow_runs/filter", {"flow_runs": {"start_time": after}})
        ids = [run["id"] for run in flow_runs]
        return {
            "flow_runs": flow_runs,
            "task_runs": every("/task_runs/filter", {"flow_runs": {"id": {"any_": ids}}}),
            "logs": every("/logs/filter", {"logs": {"flow_run_id": {"any_": ids}}}),
            "artifacts": every("/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": ids}}}),
        }


def shard_leaks(fs: s3fs.S3FileSystem, path: str) -> list[str]:
    """A Parquet shard decoded: its footer's key-value metadata and every row (compressed pages
    would hide a secret from a search of the raw bytes)."""
    with fs.open(path, "rb") as file:
        parquet = pq.ParquetFile(file)
        metadata = {
            k.decode(errors="replace"): v.decode(errors="replace") for k, v in (parquet.metadata.metadata or {}).items()
        }
        rows = parquet.read().to_pylist()
    return leaks(f"{path} (footer metadata)", json.dumps(metadata).encode()) + leaks(
        f"{path} (rows)", json.dumps(rows, default=str).encode()
    )


def write_config(tmp_path: Path, model: Path, run_url: str) -> Path:
    config = {
        "run": run_url,
        "model": str(model),
        "max_lag": 1,
        "trainer": {"lr": 3e-3, "groups_per_step": 2, "save_every": 1},
        "phases": [
            {
                "name": "rl",
                "steps": STEPS,
                "environments": [{"env": "arithmetic", "config": {"group_size": 2, "max_tokens": 4}}],
            }
        ],
        "rollout": {"max_concurrent_groups": 2, "task_run_s": 2.0},
        "servers": {"reload_poll_s": 0.25},
        "evaluation": {"env": "arithmetic", "config": {"max_tokens": 4}, "items": 2, "every": 1},
    }
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture
def s3_with_secrets():
    server = start_s3_server()
    credentials = {
        "AWS_ACCESS_KEY_ID": "dummy-access-key-id",
        "AWS_SECRET_ACCESS_KEY": AWS_SECRET,
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    fs = s3fs.S3FileSystem(
        key=credentials["AWS_ACCESS_KEY_ID"],
        secret=AWS_SECRET,
        endpoint_url=server.endpoint_url,
        skip_instance_cache=True,
    )
    fs.mkdir(BUCKET)
    try:
        yield fs, {**credentials, "AWS_ENDPOINT_URL": server.endpoint_url}
    finally:
        stop_s3_server(server)


def test_no_object_holding_a_key_shows_it_in_its_repr() -> None:
    """A repr lands in logs, tracebacks and Prefect's failure messages."""
    import asyncio

    from inference.client import PolicyClient
    from inference.reload import ServedPolicy
    from inference.server import PolicyServer

    server = PolicyServer(REPO, api_key=API_KEY, python=sys.executable)  # never started
    client = PolicyClient("http://127.0.0.1:9", api_key=API_KEY)
    try:
        for thing in (
            server,
            ServedPolicy("http://127.0.0.1:9", REPO, api_key=API_KEY, server=server),
            client,
            client._http.headers,
        ):
            assert leaks("a repr", repr(thing).encode()) == [], repr(thing)
    finally:
        asyncio.run(client.aclose())


@pytest.mark.integration
@pytest.mark.slow
def test_a_run_with_dummy_secrets_leaves_them_in_no_output(
    tmp_path, prefect_server, tiny_model_dir, s3_with_secrets
) -> None:
    fs, s3_environment = s3_with_secrets
    run = f"secrets-{secrets.token_hex(4)}"
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config = write_config(tmp_path, model, f"s3://{BUCKET}/{run}")
    environment = {**prefect_server.env(), **s3_environment, "CLOTHO_API_KEY": API_KEY}
    since = datetime.now(UTC)
    started = time.time()
    watch = ArgvWatch(str(tmp_path))
    output = tmp_path / "output.txt"
    try:
        with output.open("wb") as sink:
            pipeline = subprocess.Popen(
                [CLOTHO, "run", str(config)], cwd=REPO, env=environment, stdout=sink, stderr=subprocess.STDOUT
            )
            refused, deadline = None, time.monotonic() + 900
            while pipeline.poll() is None and time.monotonic() < deadline:
                served = re.search(rb"policy server (http://[0-9.:]+) up", output.read_bytes())
                if (
                    served and refused is None
                ):  # the key is in force: the pipeline's own server refuses a request without it
                    refused = httpx.post(f"{served.group(1).decode()}/collective_rpc", json={}, timeout=30).status_code
                time.sleep(1)
            if pipeline.poll() is None:
                pipeline.kill()
            pipeline.wait()
    finally:
        watch.close()
    text = output.read_bytes()
    try:
        if pipeline.returncode != 0:  # the trainer's log goes with its directory below: show its end too
            trainer_log = REPO / ".clotho" / "trainer" / run / "trainer.log"
            tail = trainer_log.read_bytes()[-4000:] if trainer_log.exists() else b"(no trainer.log)"
            pytest.fail(
                f"clotho run exited {pipeline.returncode}:\n{text[-5000:].decode(errors='replace')}\n"
                f"--- {trainer_log} ---\n{tail.decode(errors='replace')}"
            )
        assert refused == 401, f"the pipeline's server answered {refused} to a request without the key"
        found = leaks("clotho run's output", text) + watch.leaks
        assert any(CLOTHO in line or "trainer.cli" in line for line in watch.ours), watch.ours  # the watch saw the run
        # The search finds the secrets where they are meant to be: in the run's processes' environments.
        assert {"the API key in ", "the S3 secret key in "} <= watch.delivered, watch.delivered

        # Files the run wrote here: the server's log, the trainer's work directory, the reload cache.
        searched, skipped = [], []
        for path in (REPO / ".clotho").rglob("*"):
            if path.is_file() and path.stat().st_mtime >= started:
                if path.stat().st_size > LARGEST_FILE:
                    skipped.append(str(path))
                    continue
                found += leaks(str(path), path.read_bytes())
                searched.append(path)
        names = " ".join(str(p) for p in searched)
        assert "vllm-" in names and f"trainer/{run}" in names and "trainer.log" in names, names[:2000]
        for log in (p for p in searched if p.name.startswith("vllm-") and p.suffix == ".log"):
            text_of_log = log.read_text(errors="replace")
            if "clotho_auth" in text_of_log:  # the pipeline's server: started behind clotho's middleware
                break
        else:
            pytest.fail("no vLLM log of this run names clotho_auth: was the server started with the key?")

        # Every object in the bucket: shards (raw and decoded), index entries, checkpoints, progress, ledgers.
        objects = [path for path in fs.find(f"{BUCKET}/{run}") if not path.endswith("/")]
        shards = [path for path in objects if path.endswith(".parquet")]
        assert shards and any(path.endswith("/STABLE") for path in objects), objects
        assert any("/progress/" in path for path in objects), objects
        for path in objects:
            found += leaks(f"s3://{path}", fs.cat_file(path))
        for path in shards:
            found += shard_leaks(fs, path)

        # The Prefect server: through its API, and the database under it.
        records = prefect_records(prefect_server.api_url, since)
        pipeline_runs = [
            r for r in records["flow_runs"] if str(r["parameters"].get("config_path", "")).endswith(config.name)
        ]
        assert pipeline_runs and len(records["flow_runs"]) > 1, [
            r["name"] for r in records["flow_runs"]
        ]  # pipeline + rollouts
        assert records["artifacts"] and records["logs"] and records["task_runs"], {
            k: len(v) for k, v in records.items()
        }
        for kind, rows in records.items():
            for row in rows:
                found += leaks(
                    f"Prefect {kind[:-1].replace('_', ' ')} {row.get('name') or row.get('key') or row['id']}",
                    json.dumps(row).encode(),
                )
        databases = [p for p in prefect_server.home.rglob("*") if p.is_file() and p.stat().st_size <= LARGEST_FILE]
        assert any(p.suffix == ".db" for p in databases), databases
        for path in databases:
            found += leaks(f"the Prefect server's {path.name}", path.read_bytes())

        assert found == [], "secrets leaked:\n" + "\n".join(sorted(set(found)))
        print(
            f"searched {len(searched)} local files, {len(objects)} objects ({len(shards)} shards), "
            f"{ {k: len(v) for k, v in records.items()} } Prefect records, {len(databases)} Prefect files; skipped {skipped}"
        )
    finally:
        shutil.rmtree(REPO / ".clotho" / "trainer" / run, ignore_errors=True)
        for cache in (REPO / ".clotho" / "reload-cache").glob(f"{run}-*"):
            shutil.rmtree(cache, ignore_errors=True)
