"""`clotho run` and `clotho demo` keep task runs' chatter off the terminal unless --verbose: a real
flow mapping task runs against the suite's Prefect server, its stderr read as a user's terminal."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

FLOW = """
import sys
import prefect.main
from prefect import flow, task, get_run_logger
from clotho.flow_runtime import quiet_terminal

@task(task_run_name="lane {i}")
def lane(i: int) -> int:
    return i

@flow(name="chatter")
def chatter() -> None:
    get_run_logger().info("a flow line stays")
    lane.map(range(3)).result()
    task_logger_warning()

@task(task_run_name="warner")
def task_logger_warning() -> None:
    get_run_logger().warning("a task's warning stays")

quiet_terminal(verbose=sys.argv[1] == "verbose")
chatter()
"""


@pytest.mark.parametrize("mode", ["quiet", "verbose"])
def test_task_runs_chatter_reaches_the_terminal_only_when_asked(prefect_server, mode) -> None:
    done = subprocess.run(
        [sys.executable, "-c", FLOW, mode], env=prefect_server.env(), capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-3000:]
    terminal = done.stdout + done.stderr
    assert "a flow line stays" in terminal and "a task's warning stays" in terminal
    chatter = [
        line for line in terminal.splitlines() if "Task run 'lane" in line and "Finished in state Completed()" in line
    ]
    assert len(chatter) == (3 if mode == "verbose" else 0), terminal[-3000:]
