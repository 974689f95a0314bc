"""A stop asked of the trainer (SIGTERM from `clotho run` or a supervisor, Ctrl-C) ends it at a step
boundary: at once while it waits for data or loads, after the step in progress otherwise, so every
published checkpoint has its metrics row and its resume state. Asked twice, it stops at once.
SIGKILL stays safe (the resume state is written after the checkpoint) but may cut a step's rows.

Only `clotho train` installs the handlers (a process's signal handlers belong to its entry point);
`train()` used as a library marks its steps and stops as its caller decides."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

_in_step = False
_pending: int | None = None


class StopRequested(KeyboardInterrupt):
    """The trainer was asked to stop by a signal; the steps it finished are published and saved."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def stop_at_step_boundaries() -> None:
    """SIGTERM and SIGINT end the trainer between steps (call from the main thread)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _on_signal)


def _on_signal(signum: int, frame) -> None:
    global _pending
    if _in_step and _pending is None:
        _pending = signum
        return
    _pending = None  # taken now: a later step of this process is not stopped by it
    raise StopRequested(signum)


@contextlib.contextmanager
def step_in_progress() -> Iterator[None]:
    """A step's update, publish and bookkeeping: a stop asked inside waits for stop_if_asked()."""
    global _in_step
    _in_step = True
    try:
        yield
    finally:
        _in_step = False


def stop_if_asked() -> None:
    """Between steps (after the last one's metrics went out): raise the stop asked during it."""
    global _pending
    if _pending is not None:
        signum, _pending = _pending, None
        raise StopRequested(signum)
