"""Child processes, the one way every part handles them: tethered to the process that starts them,
a free port to serve on, waiting until one answers, stopping one (SIGTERM, a grace period, SIGKILL)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx


def tethered(command: list[str]) -> list[str]:
    """`command` run through core/tether.py: started with start_new_session=True, it and everything
    it starts end when this process ends, however it ends (SIGKILL included), within about
    tether.POLL_S + tether.GRACE_S. Its exit code is the command's."""
    return [sys.executable, str(Path(__file__).with_name("tether.py")), str(os.getpid()), "--", *command]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def wait_answering(url: str, alive: Callable[[], bool], timeout_s: float, poll_s: float = 0.25) -> bool:
    """GET `url` every `poll_s` until it answers 200 (True); False as soon as `alive()` says the
    process that should answer has ended, or once `timeout_s` has passed. The caller says which."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive():
            return False
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return True
        time.sleep(poll_s)
    return False


def stop_process(process: subprocess.Popen, timeout_s: float = 30.0, *, whole_group: bool = True) -> int | None:
    """SIGTERM, then SIGKILL if it has not ended within timeout_s; returns its exit code.

    whole_group: signal its process group (a child started with start_new_session=True, so what
    it started itself, such as vLLM's engine and workers, stops with it and none is orphaned);
    else the process alone. A process that is already gone is only reaped.
    """
    if process.poll() is not None:
        return process.returncode

    def send(sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):  # ended between the poll and the signal
            if whole_group:
                os.killpg(process.pid, sig)
            else:
                process.send_signal(sig)

    send(signal.SIGTERM)
    try:
        return process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        send(signal.SIGKILL)
        return process.wait()


def stop_child_group(pid: int, timeout_s: float = 30.0) -> None:
    """stop_process for a child known by its pid alone, started in a session of its own (one a
    command started before it ran itself again with exec, which keeps its children): SIGTERM to
    its group, SIGKILL if it has not ended within timeout_s, then reaped."""

    def ended() -> bool:
        try:
            return os.waitpid(pid, os.WNOHANG)[0] != 0
        except ChildProcessError:  # not ours to reap, or reaped already: ended when it is gone
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            return False

    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, sig)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if ended():
                return
            time.sleep(0.05)
