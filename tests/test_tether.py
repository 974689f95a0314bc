"""core/tether.py: a tethered command, and all it starts, ends with the process that started it,
however that process ends; until then it runs as itself (its exit code, the group's signals)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import psutil

from core import tether
from core.processes import stop_process, tethered

SLEEPER = [
    sys.executable,
    "-c",
    "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)",
]


def test_a_tethered_command_exits_as_the_command_and_stops_with_its_group():
    assert subprocess.run(tethered([sys.executable, "-c", "raise SystemExit(7)"]), timeout=60).returncode == 7
    process = subprocess.Popen(tethered(SLEEPER), start_new_session=True)
    time.sleep(1.0)
    started = psutil.Process(process.pid).children(recursive=True)
    assert len(started) == 2  # the command and what it started
    assert stop_process(process, 10) == -signal.SIGTERM  # ended by the group's SIGTERM, seen as the command's
    assert not [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_the_command_and_what_it_started_end_when_the_parent_is_killed_outright():
    # A parent that starts a tethered sleeper (which starts one of its own), prints their pids, then waits.
    parent_code = textwrap.dedent(f"""
        import subprocess, sys, time
        from core.processes import tethered
        child = subprocess.Popen(tethered({SLEEPER!r}), start_new_session=True)
        time.sleep(1.0)
        import psutil
        print(" ".join(str(p.pid) for p in psutil.Process(child.pid).children(recursive=True)) + " " + str(child.pid), flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True)
    pids = [int(pid) for pid in parent.stdout.readline().split()]
    assert len(pids) == 3
    parent.kill()  # SIGKILL: the parent cannot stop anything itself
    parent.wait()
    deadline = time.monotonic() + tether.POLL_S + tether.GRACE_S + 5.0
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.2)
    assert alive == [], "a tethered process outlived the process that started it"
