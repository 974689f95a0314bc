"""Runs a command that must not outlive the process that started it: core.processes.tethered.

    python core/tether.py PARENT_PID -- COMMAND [ARG ...]

A clotho command starts a Prefect server, policy servers and a trainer, each in a session of its
own (so that a Ctrl-C meant for the command reaches them once, through its stop). Killed outright
(SIGKILL: the OOM killer, `kill -9`, a CI timeout), the command cannot stop them, and they would live
on, orphaned. This process stands between: it runs COMMAND in its own process group (the session
the caller made for it), waits for it and exits as it did; and once PARENT_PID is no longer its
parent, it ends the whole group: SIGTERM, then SIGKILL after GRACE_S.

It ignores SIGTERM and SIGINT itself: the caller signals the whole group (core.processes.
stop_process), which reaches COMMAND and what it started. Standard library only: it starts in
tens of milliseconds, from any Python.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

GRACE_S = 10.0  # for the group to stop on SIGTERM once the parent is gone
POLL_S = 0.5  # how often the parent is looked at: the bound on noticing it is gone


def parent_gone(parent: int) -> bool:
    return os.getppid() != parent


def end_group(child: subprocess.Popen) -> None:
    """SIGTERM to the group (COMMAND and what it started), SIGKILL to what is left after GRACE_S."""
    os.killpg(0, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    os.killpg(0, signal.SIGKILL)  # this process too: the group ends whole


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python core/tether.py PARENT_PID -- COMMAND [ARG ...]", file=sys.stderr)
        return 2
    parent = int(argv[0])
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the group's signal is COMMAND's to act on
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    child = subprocess.Popen(
        argv[2:], preexec_fn=lambda: [signal.signal(s, signal.SIG_DFL) for s in (signal.SIGTERM, signal.SIGINT)]
    )
    while True:
        if parent_gone(parent):
            end_group(child)
        try:
            code = child.wait(POLL_S)
        except subprocess.TimeoutExpired:
            continue
        if code < 0:  # ended by a signal: end by the same one, as the caller would have seen it
            if -code != signal.SIGKILL:
                signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
