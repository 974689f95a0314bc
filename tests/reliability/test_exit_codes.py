"""A command that ends with too little of what it was asked for exits non-zero, with one line naming
the main failure reason and its fix (clotho.shortfall)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from clotho.shortfall import MIN_SHARE, SHORTFALL_EXIT, shortfall
from environments.testing import cached_tiny_model

CLOTHO = str(Path(sys.executable).with_name("clotho"))


def test_a_shortfall_names_the_main_reason_and_its_fix():
    assert shortfall("clotho rollout", "groups", 5, {"timeout": 5}) is None  # MIN_SHARE made: success
    assert shortfall("clotho rollout", "groups", 0, {}) is None  # nothing tried (no items): nothing failed
    line = shortfall("clotho rollout", "groups", 1, {"timeout": 2, "unreachable": 7}, "http://h:8000")
    assert line.startswith("clotho rollout: 1 groups made, 9 failed") and "7 as unreachable" in line
    assert "http://h:8000" in line and "clotho serve" in line and "\n" not in line
    assert "clotho env check" in shortfall("clotho rollout", "groups", 0, {"ragged": 4})  # a contract break
    assert 0 < MIN_SHARE <= 1


@pytest.mark.integration
def test_a_rollout_against_no_server_exits_non_zero_naming_it(prefect_server, tmp_path):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = f"http://127.0.0.1:{port}"
    done = subprocess.run(
        [
            CLOTHO,
            "rollout",
            "--env",
            "arithmetic",
            "--run",
            f"{tmp_path}/store/run",
            "--server",
            server,
            "--groups",
            "2",
            "--tokenizer",
            str(cached_tiny_model()),
            "--set",
            "group_size=2",
            "--max-concurrent-groups",
            "2",
        ],
        env={**os.environ, **prefect_server.env()},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == SHORTFALL_EXIT, done.stdout[-2000:] + done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("clotho rollout: 0 groups made") and "as unreachable" in last and server in last, last
