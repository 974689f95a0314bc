"""Storage faults against the real S3 API server (moto behind a fault proxy) and a full local disk:
transient faults are retried with backoff and the write lands exactly once; a store that stays
down ends in one clear error naming the URL and the fix; at no point does a reader polling the run
see a partial shard, a temporary file or a checkpoint step without STABLE."""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import re
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import s3fs

from clotho.testing.groups import make_group, make_groups
from clotho.testing.s3_server import CREDENTIALS, create_bucket, start_s3_server, stop_s3_server
from soak.s3_faults import S3FaultProxy
from soak.storage_faults import RunWatcher, run_storage_fault_trial
from storage.checkpoints import (
    CheckpointError,
    checkpoint_url,
    latest_checkpoint,
    publish_checkpoint,
    read_checkpoint,
)
from storage.filesystem import FIRST_BACKOFF_S, MAX_BACKOFF_S, StorageUnavailableError
from storage.layout import QUARANTINE
from storage.reader import ShardReader
from storage.writer import ShardWriter

pytestmark = pytest.mark.integration

BUCKET = "clotho-faults"
SHARD_PUT = r"/rollouts/.*\.parquet"
SHORT_BUDGET_S = 2.0  # CLOTHO_STORAGE_RETRY_S for the tests of a store that stays down
# One clotho try of a 503 is up to 3 botocore requests with jittered waits: up to about 3 s on a loaded
# machine, so a budget that must fit two tries and a wait between them is longer.
TWO_TRIES_BUDGET_S = 10.0


@pytest.fixture(scope="module")
def moto():
    server = start_s3_server()
    create_bucket(server, BUCKET)
    yield server
    stop_s3_server(server)


@pytest.fixture(scope="module")
def fault_proxy(moto):
    proxy = S3FaultProxy(moto.endpoint_url).start()
    yield proxy
    proxy.close()


@pytest.fixture
def proxy(fault_proxy: S3FaultProxy, monkeypatch: pytest.MonkeyPatch):
    """The proxy, healed, with clotho's storage pointed at it (clotho's default retry budget)."""
    for name, value in {**CREDENTIALS, "AWS_ENDPOINT_URL": fault_proxy.endpoint_url}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("CLOTHO_STORAGE_RETRY_S", raising=False)
    s3fs.S3FileSystem.clear_instance_cache()
    fault_proxy.reset()
    yield fault_proxy
    fault_proxy.reset()
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def root(proxy: S3FaultProxy) -> str:
    return f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"


@pytest.fixture
def watch():
    """Start RunWatchers polling a run; any still running are stopped when the test ends."""
    started: list[RunWatcher] = []

    def start(root: str, run: str = "run", **options) -> RunWatcher:
        watcher = RunWatcher(root, run, **options)
        watcher.start()
        started.append(watcher)
        return watcher

    yield start
    for watcher in started:
        watcher.stop()


@pytest.fixture
def truth(moto) -> s3fs.S3FileSystem:
    """moto itself, past the proxy: what the store really holds."""
    return s3fs.S3FileSystem(key="testing", secret="testing", endpoint_url=moto.endpoint_url, skip_instance_cache=True)


def stored(truth: s3fs.S3FileSystem, url: str) -> list[str]:
    truth.invalidate_cache()
    return sorted(truth.find(url.removeprefix("s3://")))


def check_one_clear_error(error: StorageUnavailableError, url_prefix: str, endpoint: str) -> None:
    message = str(error)
    assert message.startswith(url_prefix), message
    assert "storage unavailable after" in message and f"at {endpoint} is up and reachable" in message
    assert "CLOTHO_STORAGE_RETRY_S" in message and "\n" not in message
    assert error.__cause__ is None and error.__suppress_context__  # one error, not a chain


def check_backoff(records: list[logging.LogRecord]) -> int:
    """The waits clotho's retry logged: one line each without a traceback, the wait after try N
    drawn from [d/2, d] with d = FIRST_BACKOFF_S * 2**(N-1); returns how many."""
    retries = [r for r in records if r.name == "storage.filesystem" and "next in" in r.getMessage()]
    for record in retries:
        assert record.exc_info is None and "\n" not in record.getMessage()
        tries, wait = re.search(r"try (\d+) failed, next in ([\d.]+) s", record.getMessage()).groups()
        ceiling = min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** (int(tries) - 1))
        assert ceiling / 2 - 0.05 <= float(wait) <= ceiling + 0.05, record.getMessage()
    return len(retries)


TRANSIENT = {
    "500 twice": dict(action="status", status=500, count=2, method="PUT", path=SHARD_PUT),
    # More 503s than botocore's own 3 requests per call: only clotho's retry gets past them.
    "503 four times": dict(action="status", status=503, count=4, method="PUT", path=SHARD_PUT),
    "dropped mid-upload": dict(action="drop_request", method="PUT", path=SHARD_PUT),
    # The PUT landed, its answer did not: the retry's If-None-Match finds the shard (412).
    "lost response": dict(action="drop_response", method="PUT", path=SHARD_PUT),
    "slow: every answer 0.7 s late": dict(action="delay", seconds=0.7, count=None),
    "stopped mid-write for 3 s": dict(action="stop", method="PUT", path=SHARD_PUT, seconds=3.0),
}


@pytest.mark.parametrize("fault", TRANSIENT.values(), ids=TRANSIENT.keys())
def test_shard_writes_ride_out_transient_faults(proxy, root, truth, watch, fault, caplog) -> None:
    caplog.set_level(logging.INFO, logger="storage")
    writer = ShardWriter(root, "run", tokenizer="tiny")
    watcher = watch(root, checkpoints=False)
    groups = make_groups(4, seed=1)
    proxy.inject(**fault)
    started = time.monotonic()
    writer.add_many(groups)
    [url] = writer.flush()
    took = time.monotonic() - started
    proxy.clear()
    watcher.finish()
    assert proxy.count(action=fault["action"]) >= 1, "the fault never fired"
    assert writer.pending_groups == 0
    assert stored(truth, f"{root}/run/rollouts") == [url.removeprefix("s3://")]  # one shard, whole
    assert watcher.counts([g.group_id for g in groups]) == (0, 0)
    assert watcher.torn == [] and watcher.errors == [] and watcher.polls >= 2
    if fault["action"] == "stop":
        assert took >= 3.0  # it waited the outage out
    if fault["action"] == "drop_response":
        assert "found its own earlier try stored" in caplog.text


def test_a_response_later_than_the_read_timeout_is_a_lost_response(proxy, root, truth) -> None:
    writer = ShardWriter(root, "run", tokenizer="tiny", storage_options={"config_kwargs": {"read_timeout": 1}})
    proxy.inject("delay", seconds=2.5, method="PUT", path=SHARD_PUT)
    groups = make_groups(3, seed=2)
    writer.add_many(groups)
    [url] = writer.flush()
    assert stored(truth, f"{root}/run/rollouts") == [url.removeprefix("s3://")]
    assert proxy.count(method="PUT", path=SHARD_PUT) >= 2  # timed out, sent again, found its own
    assert [g.group_id for g in ShardReader(root, "run").groups()] == [g.group_id for g in groups]


def test_reads_and_listings_ride_out_faults_and_a_torn_read_never_quarantines(proxy, root, truth) -> None:
    writer = ShardWriter(root, "run", tokenizer="tiny", max_groups=2)
    groups = make_groups(6, seed=3)
    writer.add_many(groups)
    assert len(writer.written) == 3
    proxy.inject("truncate", method="GET", path=r"\.parquet", count=3)  # torn bodies
    proxy.inject("status", status=503, method="GET", path=r"list-type=2", count=4)  # listings
    proxy.inject("drop_response", method="HEAD", count=2)
    reader = ShardReader(root, "run")
    assert [g.group_id for g in reader.groups()] == [g.group_id for g in groups]
    assert proxy.count(action="truncate") == 3 and proxy.count(action="status") == 4
    assert not [path for path in stored(truth, root) if QUARANTINE in path]  # no good shard moved
    assert list(reader.groups()) == []  # each exactly once


def test_reads_of_a_store_that_stays_down_fail_clearly_and_keep_the_ledger(proxy, root, monkeypatch) -> None:
    writer = ShardWriter(root, "run", tokenizer="tiny")
    groups = make_groups(3, seed=4)
    writer.add_many(groups)
    writer.flush()
    monkeypatch.setenv("CLOTHO_STORAGE_RETRY_S", str(SHORT_BUDGET_S))
    reader = ShardReader(root, "run")
    proxy.inject("status", status=503, method="GET", path=r"\.parquet", count=None)
    with pytest.raises(StorageUnavailableError) as failure:
        list(reader.groups())
    check_one_clear_error(failure.value, f"{root}/run/rollouts/", proxy.endpoint_url)
    assert reader.ledger.to_dict()["consumed"] == []  # nothing counted as consumed
    proxy.clear()
    assert [g.group_id for g in reader.groups()] == [g.group_id for g in groups]


PERSISTENT = {
    "503 forever": dict(action="status", status=503, count=None),
    "stopped mid-write": dict(action="stop", method="PUT", path=SHARD_PUT, seconds=None),
    "every upload dropped": dict(action="drop_request", method="PUT", path=SHARD_PUT, count=None),
}


@pytest.mark.parametrize("fault", PERSISTENT.values(), ids=PERSISTENT.keys())
def test_a_store_that_stays_down_fails_the_flush_once_clearly(
    proxy, root, truth, watch, fault, monkeypatch, caplog
) -> None:
    writer = ShardWriter(root, "run", tokenizer="tiny")
    watcher = watch(root, checkpoints=False)
    budget = TWO_TRIES_BUDGET_S if fault["action"] == "status" else SHORT_BUDGET_S
    monkeypatch.setenv("CLOTHO_STORAGE_RETRY_S", str(budget))
    caplog.set_level(logging.WARNING, logger="storage")
    groups = make_groups(3, seed=5)
    writer.add_many(groups)
    proxy.inject(**fault)
    started = time.monotonic()
    with pytest.raises(StorageUnavailableError) as failure:
        writer.flush()
    took = time.monotonic() - started
    check_one_clear_error(failure.value, f"{root}/run/", proxy.endpoint_url)
    tries = int(re.search(r"after (\d+) tries", str(failure.value)).group(1))
    assert tries >= 1 and took < budget + 15  # bounded: the budget plus one try
    retries = check_backoff(caplog.records)
    if fault["action"] == "status":  # fast failures: several tries fit the budget, spaced out
        assert tries >= 2 and retries >= tries - 1
    assert writer.pending_groups == 3  # kept for the next flush
    assert not truth.exists(f"{BUCKET}/{root.split('/', 3)[3]}/run/rollouts")  # nothing partial
    proxy.clear()
    if not proxy.listening:
        proxy.resume()
    writer.flush()  # the store is back: the same groups land, once
    watcher.finish()
    assert watcher.counts([g.group_id for g in groups]) == (0, 0) and watcher.torn == []


def test_a_shard_that_landed_unanswered_before_an_outage_is_not_written_twice(proxy, root, truth, monkeypatch) -> None:
    writer = ShardWriter(root, "run", tokenizer="tiny")
    monkeypatch.setenv("CLOTHO_STORAGE_RETRY_S", str(SHORT_BUDGET_S))
    groups = make_groups(3, seed=9)
    writer.add_many(groups)
    proxy.inject("stop_after", method="PUT", path=SHARD_PUT, seconds=None)  # stored, then down
    with pytest.raises(StorageUnavailableError):
        writer.flush()
    [landed] = stored(truth, f"{root}/run/rollouts")
    proxy.resume()
    assert writer.flush() == [f"s3://{landed}"] and writer.pending_groups == 0  # settled, not rewritten
    assert stored(truth, f"{root}/run/rollouts") == [landed]
    assert [g.group_id for g in ShardReader(root, "run").groups()] == [g.group_id for g in groups]


def test_a_writer_leaving_on_a_dead_store_says_what_it_lost_in_one_line(proxy, root, monkeypatch, caplog) -> None:
    monkeypatch.setenv("CLOTHO_STORAGE_RETRY_S", str(SHORT_BUDGET_S))
    caplog.set_level(logging.WARNING, logger="storage")
    started = time.monotonic()
    with pytest.raises(StorageUnavailableError):
        with ShardWriter(root, "run", tokenizer="tiny") as writer:
            writer.add_many(make_groups(2, seed=6))
            proxy.inject("status", status=500, count=None)
            writer.flush()
    assert time.monotonic() - started < SHORT_BUDGET_S + 10  # one retry budget, not two
    [lost] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert lost.getMessage().startswith(f"lost 2 buffered groups for {root}/run: ") and lost.exc_info is None


def _checkpoint_dir(base: Path, step: int, model_bytes: int) -> Path:
    directory = base / f"source-{step}"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen2", "step": step}))
    with open(directory / "model.safetensors", "wb") as file:
        for _ in range(model_bytes // 2**20):
            file.write(random.randbytes(2**20))
        file.write(random.randbytes(model_bytes % 2**20))
    return directory


def test_checkpoint_publish_rides_out_faults_in_every_upload(proxy, root, watch, tmp_path) -> None:
    publish_checkpoint(_checkpoint_dir(tmp_path, 0, 1000), root, "run", 0)
    watcher = watch(root)
    big = _checkpoint_dir(tmp_path, 1, 101 * 2**20)  # s3fs uploads 100 MiB and more in parts
    proxy.inject("drop_request", method="PUT", path=r"partNumber=2")  # cut mid-part
    proxy.inject("drop_response", method="POST", path=r"uploadId=")  # lost CompleteMultipartUpload answer
    proxy.inject("drop_response", method="PUT", path=r"/STABLE")  # STABLE landed, its answer did not
    proxy.inject("status", status=503, method="PUT", path=r"/LATEST", count=4)
    info = publish_checkpoint(big, root, "run", 1)
    proxy.clear()
    watcher.finish()
    assert proxy.count(action="drop_request") == proxy.count(action="drop_response") - 1 == 1
    assert latest_checkpoint(root, "run").step == 1
    assert read_checkpoint(info.url).manifest["files"]["model.safetensors"] == 101 * 2**20
    assert watcher.torn == [] and watcher.errors == [] and watcher.trusted_steps == {0, 1}


def test_checkpoint_publish_to_a_stopped_store_fails_clearly_and_the_step_is_never_trusted(
    proxy, root, truth, watch, tmp_path, monkeypatch
) -> None:
    publish_checkpoint(_checkpoint_dir(tmp_path, 0, 1000), root, "run", 0)
    watcher = watch(root)
    monkeypatch.setenv("CLOTHO_STORAGE_RETRY_S", str(SHORT_BUDGET_S))
    source = _checkpoint_dir(tmp_path, 1, 3 * 2**20)
    proxy.inject("stop", method="PUT", path=r"model\.safetensors", seconds=None)  # dies mid-upload
    with pytest.raises(StorageUnavailableError) as failure:
        publish_checkpoint(source, root, "run", 1)
    step_url = checkpoint_url(root, "run", 1)
    check_one_clear_error(failure.value, step_url, proxy.endpoint_url)
    assert not truth.exists(f"{step_url.removeprefix('s3://')}/STABLE")
    proxy.resume()
    assert latest_checkpoint(root, "run").step == 0
    with pytest.raises(CheckpointError, match="no STABLE"):
        read_checkpoint(step_url)
    publish_checkpoint(source, root, "run", 1)  # run again once the store is back
    watcher.finish()
    assert latest_checkpoint(root, "run").step == 1
    assert watcher.torn == [] and watcher.trusted_steps == {0, 1}


def test_a_randomized_storage_fault_trial_loses_nothing(proxy) -> None:
    trial = run_storage_fault_trial(7, proxy, BUCKET, flushes=4, checkpoints=1)
    assert trial.ok, trial
    assert trial.committed == 12 and trial.checkpoints == 1 and len(trial.faults) == 5 and trial.fired >= 1


# -- a full local disk ------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 2 MiB tmpfs: a local disk that fills up."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs to fill needs root (run the suite as root, or in CI's container)")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"mount -t tmpfs is not permitted here: {mounted.stderr.strip()}")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def free_bytes(path: Path) -> int:
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


def fill(disk: Path, leave: int) -> Path:
    """Write a file that leaves `leave` bytes (whole pages) free."""
    filler = disk / "filler"
    filler.write_bytes(b"\0" * (free_bytes(disk) - leave))
    assert free_bytes(disk) == leave
    return filler


def test_a_full_local_disk_fails_the_flush_clearly_and_leaves_no_partial_shard(small_disk) -> None:
    root = f"file://{small_disk}/store"
    rng = random.Random(8)
    groups = [make_group(rng, size=8, max_tokens=4000) for _ in range(4)]  # a shard of ~200 kB
    writer = ShardWriter(root, "run", tokenizer="tiny")
    filler = fill(small_disk, 16 * 4096)
    writer.add_many(groups)
    with pytest.raises(OSError) as failure:
        writer.flush()
    assert failure.value.errno == errno.ENOSPC
    assert str(failure.value).startswith(f"[Errno {errno.ENOSPC}] {root}/run/rollouts/env=gsm8k/")
    assert "no space left on device; free space on that disk" in str(failure.value)
    store = small_disk / "store" / "run"
    assert not list(store.rglob("*.parquet"))
    assert not [p for p in (store / "_tmp").iterdir() if p.name.startswith(".")]  # no temporary left
    assert not list((store / "_index").rglob("*~*"))  # nor an entry for a shard that is not there
    assert writer.pending_groups == 4
    filler.unlink()
    writer.flush()
    assert [g.group_id for g in ShardReader(root, "run").groups()] == [g.group_id for g in groups]


def test_a_full_local_disk_never_leaves_a_checkpoint_with_an_empty_stable(small_disk, tmp_path) -> None:
    root = f"file://{small_disk}/store"
    publish_checkpoint(_checkpoint_dir(tmp_path, 0, 1000), root, "run", 0)
    source = _checkpoint_dir(tmp_path, 1, 300 * 1024)
    pages = sum(-(-file.stat().st_size // 4096) * 4096 for file in source.iterdir())
    filler = fill(small_disk, pages)  # room for the weights, not for STABLE
    with pytest.raises(OSError, match="no space left on device") as failure:
        publish_checkpoint(source, root, "run", 1)
    assert str(failure.value).startswith(f"[Errno {errno.ENOSPC}] {checkpoint_url(root, 'run', 1)}")
    step = small_disk / "store" / "run" / "checkpoints" / "step-00000001"
    assert (step / "model.safetensors").stat().st_size == 300 * 1024  # the weights made it
    assert not (step / "STABLE").exists() and not list(step.glob(".STABLE*"))
    assert latest_checkpoint(root, "run").step == 0
    filler.unlink()
    publish_checkpoint(source, root, "run", 1)
    assert latest_checkpoint(root, "run").step == 1
