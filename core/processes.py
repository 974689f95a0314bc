"""Stopping a child process, the one way every part does it: SIGTERM, a grace period, SIGKILL."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess


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
