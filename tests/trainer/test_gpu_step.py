"""bench/gpu_step.py, the trainer's step on one device, runs here on CPU as it will on a GPU: the same
script, a small shape, so it works the day a device is lent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SMALL = [
    "--size",
    "tiny",
    "--steps",
    "2",
    "--sequences",
    "12",
    "--min-tokens",
    "20",
    "--max-tokens",
    "90",
    "--prompt",
    "8",
    "--micro-batch-tokens",
    "512",
    "--peak-tflops",
    "1",
]


@pytest.mark.parametrize(("dtype", "bound"), [("float32", 1e-5), ("bfloat16", 0.05)])
def test_the_device_step_script_trains_packed_rows_and_checks_them_against_each_sequence_alone(tmp_path, dtype, bound):
    out = tmp_path / "step.json"
    extra = ["--gradient-checkpointing"] if dtype == "bfloat16" else []
    done = subprocess.run(
        [sys.executable, "-m", "bench.gpu_step", *SMALL, "--dtype", dtype, "--out", str(out), *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result == json.loads(done.stdout.strip().splitlines()[-1])
    # Several sequences a row, kept apart without a mask (on CPU: sdpa over buckets of alike lengths), and the
    # packed logprobs those of each sequence alone (bf16: both sides round differently).
    assert result["attention"] == "sdpa buckets" and result["device"] == "cpu"
    assert 0 <= result["logprob_check"] < bound
    assert len(result["step_seconds"]) == 2 and all(tokens > 12 * 20 for tokens in result["tokens_per_step"])
    factor = 8 if extra else 6
    assert result["mfu"] == pytest.approx(factor * result["parameters"] * result["tokens_per_s"] / 1e12, rel=1e-2)
    assert 0 < result["peak_memory_gib"] < 4
