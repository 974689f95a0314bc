"""The single-process trainer's process group on a port it chose itself: a port taken by another
process between the choice and the bind is chosen again (it made a CI run's pipeline fixture fail)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import socket
import trainer.distributed as distributed
from core.processes import free_port

taken = socket.socket()
taken.bind(("127.0.0.1", 0))
taken.listen()
ports = iter([taken.getsockname()[1], free_port()])  # the first choice is already taken
distributed.free_port = lambda: next(ports)
print(distributed.init_distributed(), flush=True)
"""


def test_a_port_taken_before_the_bind_is_chosen_again():
    environment = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=REPO, env=environment, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1] == "(0, 1)", (
        done.stdout[-2000:] + done.stderr[-3000:]
    )
