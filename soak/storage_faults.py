"""Storage-fault trials against the real S3 API server: a RunWatcher reads a run as the trainer
and the reload watcher do while S3FaultProxy (soak.s3_faults) hits its writers, and
one randomized trial for the soak runner.

    python -m soak.storage_faults [TRIALS] [SEED]
"""

from __future__ import annotations

import json
import random
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from soak.s3_faults import S3FaultProxy

# -- what a reader sees while faults hit ----------------------------------------------------------


class RunWatcher(threading.Thread):
    """Polls a run as the trainer and the reload watcher do, while faults hit: takes new groups
    through a ShardReader (its ledger), lists the rollouts and reads every shard listed, and
    verifies every checkpoint step that shows a STABLE. Counts what it must never see: a listed
    shard that does not read back whole, a temporary file among the rollouts, a STABLE step whose
    files do not match it. Storage errors are counted, not raised: a poll that failed clearly left
    the ledger where it was, and the next poll goes on."""

    def __init__(self, root: str, run: str, *, poll_s: float = 0.1, checkpoints: bool = True) -> None:
        super().__init__(name="run-watcher", daemon=True)
        from storage.reader import ShardReader

        self.root, self.run_name, self.poll_s, self.checkpoints = root, run, poll_s, checkpoints
        self.reader = ShardReader(root, run)
        self.seen: dict[str, int] = {}  # group id -> times handed out
        self.torn: list[str] = []
        self.errors: list[str] = []
        self.trusted_steps: set[int] = set()
        self.polls = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.poll()
            self._stop_event.wait(self.poll_s)

    def poll(self) -> None:
        from storage.checkpoints import CheckpointError, checkpoint_url, published_steps, read_checkpoint
        from storage.filesystem import list_files, resolve
        from storage.layout import rollouts_url
        from storage.schema import ShardFormatError
        from storage.shard_file import find_shards, read_shard

        try:
            for group in self.reader.groups():
                self.seen[group.group_id] = self.seen.get(group.group_id, 0) + 1
            url = rollouts_url(self.root, self.run_name)
            fs, path = resolve(url)
            for name in list_files(fs, path):
                if not name.endswith(".parquet") or "/." in name:
                    self.torn.append(f"a file other than a shard is visible among the rollouts: {name}")
            for shard in find_shards(url)[1]:
                try:
                    read_shard(fs, shard)
                except ShardFormatError as error:
                    self.torn.append(str(error))
                except FileNotFoundError:
                    pass  # listed, then moved away (quarantine): not a torn read
            if self.checkpoints:
                for step in published_steps(self.root, self.run_name):
                    try:
                        read_checkpoint(checkpoint_url(self.root, self.run_name, step))
                        self.trusted_steps.add(step)
                    except CheckpointError as error:
                        if "no STABLE" not in str(error):  # else deleted between listing and read
                            self.torn.append(str(error))
        except OSError as error:
            self.errors.append(str(error).splitlines()[0])
        self.polls += 1

    def stop(self, timeout_s: float = 90.0) -> None:
        self._stop_event.set()
        self.join(timeout=timeout_s)

    def finish(self) -> None:
        """Stop polling, then poll once more with the faults gone."""
        self.stop()
        self.poll()

    def counts(self, committed: list[str]) -> tuple[int, int]:
        """(lost, twice): committed groups never handed out, groups handed out more than once."""
        lost = sum(1 for group_id in committed if group_id not in self.seen)
        twice = sum(1 for count in self.seen.values() if count > 1)
        return lost, twice


# -- randomized storage-fault trials, for the soak runner -----------------------------------------

# (name, fault) a trial draws from; every fault is bounded (a count, or an outage of seconds), so
# each heals within clotho's retry budget and every write must land exactly once.
TRANSIENT_FAULTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("500 x2", dict(action="status", status=500, count=2)),
    ("503 x3", dict(action="status", status=503, count=3)),
    ("503 on shard PUTs x4", dict(action="status", status=503, count=4, method="PUT", path=r"\.parquet")),
    ("slow 1.5 s x3", dict(action="delay", seconds=1.5, count=3)),
    ("dropped mid-upload", dict(action="drop_request", method="PUT", count=1)),
    ("lost response to a shard PUT", dict(action="drop_response", method="PUT", path=r"\.parquet", count=1)),
    ("lost response to STABLE", dict(action="drop_response", method="PUT", path=r"/STABLE", count=1)),
    ("lost response", dict(action="drop_response", count=1)),
    ("torn GET", dict(action="truncate", method="GET", count=2)),
    ("stopped mid-write 1 s", dict(action="stop", method="PUT", seconds=1.0, count=1)),
    ("stopped mid-write 4 s", dict(action="stop", method="PUT", seconds=4.0, count=1)),
)


@dataclass
class StorageTrial:
    """One trial's outcome; `row()` is its line in the soak table."""

    seed: int
    faults: list[str] = field(default_factory=list)  # armed, one before each write
    fired: int = 0  # requests a fault hit
    committed: int = 0  # groups in shards the writer reported written
    lost: int = 0
    twice: int = 0
    torn: int = 0
    checkpoints: int = 0  # steps published, each verified against its STABLE afterwards
    errors: list[str] = field(default_factory=list)  # clear failures a write raised (then retried)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.committed > 0 and self.lost == 0 and self.twice == 0 and self.torn == 0

    def row(self) -> dict[str, Any]:
        return {
            "fault": "storage (S3 API)",
            "seed": self.seed,
            "armed": len(self.faults),
            "fired": self.fired,
            "committed": self.committed,
            "lost": self.lost,
            "twice": self.twice,
            "torn": self.torn,
            "checkpoints": self.checkpoints,
            "seconds": round(self.seconds, 1),
            "result": "ok" if self.ok else "FAIL",
        }


def run_storage_fault_trial(
    seed: int,
    proxy: S3FaultProxy,
    bucket: str,
    *,
    flushes: int = 6,
    groups_per_flush: int = 3,
    checkpoints: int = 2,
    checkpoint_bytes: int = 256 * 1024,
) -> StorageTrial:
    """Write `flushes` shards and publish `checkpoints` checkpoints to a fresh run in s3://`bucket`
    through `proxy`, one random TRANSIENT_FAULTS entry (drawn by `seed`) armed before each write,
    while a RunWatcher polls; then heal the proxy, let the watcher catch up and count lost, twice
    and torn. A write that still fails clearly is retried after a pause, as its caller would.

    The caller points clotho at the proxy first: AWS_ENDPOINT_URL=proxy.endpoint_url and the
    credentials of clotho.testing.s3_server.CREDENTIALS in the environment.
    """
    import s3fs

    from clotho.testing.groups import make_group
    from storage.checkpoints import checkpoint_url, publish_checkpoint, read_checkpoint
    from storage.writer import ShardWriter

    rng = random.Random(seed)
    trial = StorageTrial(seed)
    started = time.monotonic()
    seen_before = len(proxy.exchanges)
    s3fs.S3FileSystem.clear_instance_cache()
    root, run = f"s3://{bucket}/soak-{seed}-{uuid.uuid4().hex[:8]}", "run"

    def with_fault(write: Any) -> bool:
        name, fault = rng.choice(TRANSIENT_FAULTS)
        trial.faults.append(name)
        proxy.inject(**fault)
        try:
            for pause_s in (2.0, 5.0, 10.0):
                try:
                    write()
                    return True
                except OSError as error:
                    trial.errors.append(str(error).splitlines()[0])
                    time.sleep(pause_s)
            return False
        finally:
            proxy.clear()
            if not proxy.listening:
                proxy.resume()

    watcher = RunWatcher(root, run)
    watcher.start()
    committed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="storage-trial-") as temporary:
        writer = ShardWriter(root, run, tokenizer="tiny", max_groups=10**6)
        for _ in range(flushes):
            groups = [make_group(rng) for _ in range(groups_per_flush)]
            writer.add_many(groups)
            if with_fault(writer.flush):
                committed += [group.group_id for group in groups]
        writer.close()
        for step in range(checkpoints):
            source = Path(temporary) / f"step-{step}"
            source.mkdir()
            (source / "config.json").write_text(json.dumps({"step": step}))
            (source / "model.safetensors").write_bytes(rng.randbytes(checkpoint_bytes))

            def publish(source: Path = source, step: int = step) -> None:
                try:
                    publish_checkpoint(source, root, run, step)
                except FileExistsError:  # a try that failed clearly after its STABLE landed
                    read_checkpoint(checkpoint_url(root, run, step))

            trial.checkpoints += with_fault(publish)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(group_id not in watcher.seen for group_id in committed):
        time.sleep(0.2)
    watcher.finish()
    trial.committed = len(committed)
    trial.lost, trial.twice = watcher.counts(committed)
    trial.torn = len(watcher.torn)
    for step in range(trial.checkpoints):
        try:
            read_checkpoint(checkpoint_url(root, run, step))
        except Exception as error:  # noqa: BLE001 - a published step that does not verify is a torn checkpoint
            trial.torn += 1
            trial.errors.append(str(error).splitlines()[0])
    trial.fired = sum(1 for exchange in proxy.exchanges[seen_before:] if exchange.action != "forwarded")
    trial.seconds = time.monotonic() - started
    return trial


def run_storage_fault_soak(trials: int = 20, seed: int = 0, *, report: Any = print) -> list[dict[str, Any]]:
    """`trials` randomized storage-fault trials against a moto server of their own behind a fault
    proxy (seeds seed..seed+trials-1); returns one soak-table row per trial, `report`ed as it ends.
    Sets AWS_ENDPOINT_URL and test credentials for the duration, and restores them."""
    from clotho.testing.s3_server import CREDENTIALS, create_bucket, s3_environment, start_s3_server, stop_s3_server

    server = start_s3_server()
    proxy = S3FaultProxy(server.endpoint_url).start()
    rows = []
    try:
        with s3_environment({**CREDENTIALS, "AWS_ENDPOINT_URL": proxy.endpoint_url}):
            create_bucket(server, "clotho-soak")
            for index in range(trials):
                row = run_storage_fault_trial(seed + index, proxy, "clotho-soak").row()
                report(row)
                rows.append(row)
    finally:
        proxy.close()
        stop_s3_server(server)
    return rows


if __name__ == "__main__":  # python -m soak.storage_faults [TRIALS] [SEED]
    import sys

    results = run_storage_fault_soak(*(int(value) for value in sys.argv[1:3]))
    sys.exit(0 if all(row["result"] == "ok" for row in results) else 1)
