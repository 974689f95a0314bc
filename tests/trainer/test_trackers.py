"""report_to: each step's metrics reach W&B (offline, as a user without an account runs it) and a
tracker class of an outside author's, from the real trainer process, resumed runs included."""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import pytest

from tests.trainer.rollouts import sampled_groups, write_shards
from tests.trainer.test_train import REPO, environment, run_trainer, trainer_args
from trainer import trackers
from trainer.config import TrainerConfig
from trainer.metrics import read_metrics

RECORDER = "tests.trainer.recording_tracker:Recorder"


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (["tensorbord"], "'tensorbord' is neither a built-in tracker (wandb) nor module:Class of your own"),
        (["no_such_module_here:Tracker"], "'no_such_module_here:Tracker': cannot import no_such_module_here"),
        (["tests.trainer.recording_tracker:Missing"], "tests.trainer.recording_tracker has no 'Missing'"),
    ],
)
def test_a_tracker_that_cannot_load_is_named_with_its_fix_before_training(names, message, tiny_model_dir):
    with pytest.raises(ValueError) as error:
        TrainerConfig(model=str(tiny_model_dir), report_to=names)
    assert "report_to" in str(error.value) and message in str(error.value)


def test_a_built_in_tracker_whose_package_is_missing_says_what_to_install(monkeypatch):
    monkeypatch.setitem(trackers.BUILT_IN, "mlflow", ("no_such_package_here", "trainer.trackers:WandbTracker"))
    with pytest.raises(
        ValueError,
        match=r"'mlflow' needs the no_such_package_here package, not installed here; pip install no_such_package_here",
    ):
        trackers.check_report_to(["mlflow"])


def test_the_cli_refuses_a_tracker_that_does_not_load_and_names_the_setting(tmp_path, tiny_model_dir):
    args = trainer_args(str(tmp_path), "run", tiny_model_dir, 1, "report_to=[tensorbord]")
    done = subprocess.run(
        [sys.executable, "-m", "trainer.cli", *args],
        cwd=REPO,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    said = " ".join(done.stderr.replace("│", " ").split())  # typer draws the error in a box
    assert done.returncode == 2 and "--set: report_to: 'tensorbord' is neither a built-in tracker" in said, done.stderr


@pytest.mark.slow
def test_each_step_reaches_wandb_and_an_outside_tracker_across_a_resume(tmp_path, tiny_model_dir, monkeypatch):
    root = str(tmp_path)
    write_shards(root, "run", sampled_groups(tiny_model_dir, 8, seed=5), groups_per_shard=2)
    monkeypatch.setenv("WANDB_MODE", "offline")  # no account, no network: written for `wandb sync`
    monkeypatch.setenv("WANDB_PROJECT", "clotho-test")
    settings = ("save_every=1", "max_lag=100", f"report_to=[wandb, {RECORDER}]")
    run_trainer(trainer_args(root, "run", tiny_model_dir, 2, *settings))
    run_trainer(trainer_args(root, "run", tiny_model_dir, 4, *settings))  # resumes: the same W&B run goes on

    work_dir = tmp_path / "run" / "trainer"
    rows = read_metrics(work_dir)
    recorded = [json.loads(line) for line in (work_dir / "recorded.jsonl").read_text().splitlines()]
    assert [r["call"] for r in recorded] == ["init", "log", "log", "close", "init", "log", "log", "close"]
    assert recorded[0] == {"call": "init", "run": "run", "lr": 1e-3}
    logged = [r for r in recorded if r["call"] == "log"]
    assert [r["step"] for r in logged] == [row["step"] for row in rows] == [1, 2, 3, 4]
    assert all(
        r[f"train/{name}"] == row[name] for r, row in zip(logged, rows) for name in row if name not in ("step", "time")
    )

    run_id = (work_dir / "wandb-run-id").read_text()
    offline = sorted((work_dir / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(offline) == 2, list((work_dir / "wandb").iterdir())  # one W&B run, written by two starts
    history = [
        r.history
        for path in offline
        for r in wandb_records(path / f"run-{run_id}.wandb")
        if r.WhichOneof("record_type") == "history"
    ]
    logged_to_wandb = [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in h.item} for h in history
    ]
    assert [h["_step"] for h in logged_to_wandb] == [1, 2, 3, 4], logged_to_wandb
    assert [h["train/loss"] for h in logged_to_wandb] == pytest.approx([row["loss"] for row in rows])
    assert all(h["train/tokens"] == row["tokens"] for h, row in zip(logged_to_wandb, rows))


def wandb_records(path):
    """The records of a W&B run file (what `wandb sync` uploads): a 7-byte header, then a LevelDB
    log of 32 KiB blocks whose chunks (7-byte header: crc, length, type) hold protobuf Records."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", data[:7]
    position, parts = 7, b""
    while position + 7 <= len(data):
        left = block - position % block
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if left < 7 or (kind == 0 and length == 0):  # a block's zero padding
            position += left
            continue
        chunk, position = data[position + 7 : position + 7 + length], position + 7 + length
        parts = chunk if kind in (1, 2) else parts + chunk  # full, first | middle, last
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            yield record
