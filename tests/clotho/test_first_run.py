"""A new user's first command: no Prefect home, no user caches, two busy cores. Prefect's first
start creates and migrates its database (longer than its own 20 s start-up limit on 2 loaded
cores), and with the home's parent missing its server used to fail and be restarted forever."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from storage.reader import ShardReader
from storage.writer import ShardWriter
from tests.flows.test_reprocess import groups

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
CLOTHO = str(Path(sys.executable).with_name("clotho"))


def new_machine_environment(root: Path) -> dict[str, str]:
    """The environment of a user who never ran Prefect or anything that caches: every home-level
    directory under `root`, none of them existing yet (their parents neither)."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "HF_", "VLLM_", "TORCH_"))}
    environment.update(
        PREFECT_HOME=str(root / "home" / ".prefect"),
        XDG_CACHE_HOME=str(root / "home" / ".cache"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
    )
    return environment


def test_a_first_command_on_a_new_machine_completes_on_two_busy_cores(tmp_path):
    with ShardWriter(f"file://{tmp_path}/in", "run", tokenizer="tok", max_groups=3) as writer:
        writer.add_many(groups(6))
    environment = new_machine_environment(tmp_path / "new")
    assert not (tmp_path / "new").exists()
    # Two busy loops: the command competes for the cores as on a loaded laptop or CI runner.
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        started = time.monotonic()
        done = subprocess.run(
            [
                CLOTHO,
                "reprocess",
                f"file://{tmp_path}/in/run",
                f"file://{tmp_path}/out/run",
                "filter:drop_equal_scores=true",
            ],
            cwd=REPO,
            env=environment,
            capture_output=True,
            text=True,
            timeout=600,
        )
        seconds = time.monotonic() - started
    finally:
        for process in busy:
            process.kill()
            process.wait()
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    assert "first start of the local Prefect server" in output, output[-3000:]
    assert "Failed to create the Prefect home directory" not in output, output[-3000:]
    assert (tmp_path / "new" / "home" / ".prefect" / "prefect.db").exists()
    assert len(list(ShardReader(f"file://{tmp_path}/out", "run").groups())) == 4  # the two all-equal groups dropped
    print(f"first command on a new machine, two busy cores: {seconds:.1f} s")


def test_a_prefect_home_that_cannot_be_made_is_one_clear_line(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    environment = new_machine_environment(tmp_path / "new") | {"PREFECT_HOME": str(blocker / "prefect")}
    with ShardWriter(f"file://{tmp_path}/in", "run", tokenizer="tok", max_groups=3) as writer:
        writer.add_many(groups(3))
    done = subprocess.run(
        [CLOTHO, "reprocess", f"file://{tmp_path}/in/run", f"file://{tmp_path}/out/run", "dedupe"],
        cwd=REPO,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"PREFECT_HOME={blocker / 'prefect'}: cannot create or write it" in done.stderr
    assert "Traceback" not in done.stderr
