"""A stop asked of the trainer ends it between steps: each published checkpoint keeps its metrics
row and its resume state (a stop by `clotho run`'s stop rule once left a checkpoint without a row)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from storage.checkpoints import published_steps
from tests.trainer.rollouts import sampled_groups, write_shards
from tests.trainer.test_train import REPO, environment, trainer_args
from trainer import stopping
from trainer.metrics import read_metrics


@pytest.fixture
def handlers():
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    stopping.stop_at_step_boundaries()
    yield
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def test_a_stop_asked_during_a_step_waits_for_its_end(handlers):
    finished = []
    with pytest.raises(stopping.StopRequested) as stop:
        with stopping.step_in_progress():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # the handler has run: the step goes on
            finished.append("metrics row")
        stopping.stop_if_asked()
    assert finished == ["metrics row"] and stop.value.signum == signal.SIGTERM
    stopping.stop_if_asked()  # the stop was taken: the next step is not stopped by it


def test_a_stop_asked_between_steps_is_at_once_and_twice_is_at_once(handlers):
    with pytest.raises(stopping.StopRequested):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1.0)
    with pytest.raises(stopping.StopRequested):
        with stopping.step_in_progress():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGTERM)  # asked again: no waiting for the step
            time.sleep(1.0)
            pytest.fail("the second stop did not end the step")
    stopping.stop_if_asked()  # both stops were taken: a later train() in this process runs


@pytest.mark.slow
def test_sigterm_mid_run_leaves_a_row_and_a_resume_state_for_every_checkpoint(tmp_path, tiny_model_dir):
    """SIGTERM as the trainer publishes step 2 (the window a kill once cut): it ends after a
    step, with as many metrics rows as checkpoints, its resume state at the last one, and says so."""
    root = str(tmp_path)
    write_shards(root, "run", sampled_groups(tiny_model_dir, 10, seed=3), groups_per_shard=2)
    log_path = tmp_path / "trainer.log"
    command = [
        sys.executable,
        "-m",
        "trainer.cli",
        *trainer_args(root, "run", tiny_model_dir, 20, "save_every=1", "max_lag=100"),
    ]
    with log_path.open("w") as log:
        process = subprocess.Popen(command, cwd=REPO, env=environment(), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while "step 2: published" not in log_path.read_text():
            assert process.poll() is None, log_path.read_text()[-4000:]
            assert time.monotonic() < deadline, log_path.read_text()[-4000:]
            time.sleep(0.005)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 128 + signal.SIGTERM, log_path.read_text()[-4000:]
    finally:
        if process.poll() is None:
            process.kill()
    rows = [row["step"] for row in read_metrics(tmp_path / "run" / "trainer")]
    steps = published_steps(root, "run")
    assert rows == steps == list(range(1, rows[-1] + 1)) and rows[-1] >= 2, (rows, steps)
    assert (tmp_path / "run" / "trainer" / "state" / "latest").read_text() == f"step-{rows[-1]:08d}"
    assert f"stopped by SIGTERM after step {rows[-1]}; run it again to resume" in log_path.read_text()
