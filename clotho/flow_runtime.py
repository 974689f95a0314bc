"""Running a Prefect flow from a command: its own event loop thread, signals turned into a
cancel, a local Prefect server in a session of its own, logs drained before exit."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
from pathlib import Path


class Stopped(Exception):
    """The flow was cancelled by SIGINT or SIGTERM; its finished work is stored."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# Seconds to wait for the local Prefect server. Its first start in a new PREFECT_HOME creates and
# migrates the SQLite database, which on 2 loaded cores takes longer than Prefect's 20 s default.
FIRST_START_TIMEOUT_S = 300


class PrefectStartError(RuntimeError):
    """The local Prefect server did not come up; the message says what was waited for and the fix."""


def make_prefect_home(home: Path | None = None) -> Path:
    """Creates the Prefect home (PREFECT_HOME, else ~/.prefect) with its parents: Prefect makes only
    the last directory (and warns at import when it cannot). PrefectStartError if it cannot be
    made or written, the one thing to fix named."""
    home = home or Path(os.environ.get("PREFECT_HOME") or "~/.prefect").expanduser()
    try:
        home.mkdir(parents=True, exist_ok=True)
        probe = home / ".clotho-write-probe"
        probe.touch()
        probe.unlink()
    except OSError as error:  # else the server fails to open its database and Prefect restarts it forever
        raise PrefectStartError(
            f"PREFECT_HOME={home}: cannot create or write it ({error}); point PREFECT_HOME at a writable directory"
        ) from None
    return home


def start_local_prefect_server() -> None:
    """Without PREFECT_API_URL a flow runs against a temporary local Prefect server. Start it here,
    on a new machine as on a used one:

    - PREFECT_HOME is created first: with its parent missing, SQLite cannot open the database, the
      server exits with uvicorn's start-up failure code 3, which Prefect takes for a busy port and
      restarts it on another one, forever.
    - The wait fits a first start (FIRST_START_TIMEOUT_S, or Prefect's setting when larger), and a
      start that still fails says what it waited for and how to fix it.
    - The server gets a session of its own: as Prefect's child in our process group, a Ctrl-C in
      the terminal (sent to the whole group) would stop it in the middle of the flow's cleanup,
      which then hangs reporting to it (uvicorn installs its own SIGINT handler, so ignoring the
      signal is not enough). Prefect still stops it when this process exits.
    """
    import subprocess
    import sys
    import time

    from prefect.settings import (
        PREFECT_API_URL, PREFECT_HOME, PREFECT_SERVER_EPHEMERAL_ENABLED, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
    )  # fmt: skip

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return
    from prefect.server.api import server as prefect_server

    home = Path(PREFECT_HOME.value()).expanduser()
    first_start = not (home / "prefect.db").exists()
    make_prefect_home(home)
    if first_start:
        print(f"clotho: first start of the local Prefect server: creating its database in {home}", file=sys.stderr)
    timeout_s = max(FIRST_START_TIMEOUT_S, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value())

    class OwnSession(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, start_new_session=True, **kwargs)

    popen = prefect_server.subprocess.Popen
    prefect_server.subprocess.Popen = OwnSession  # only while this one server starts
    server = prefect_server.SubprocessASGIServer()  # the instance Prefect's client then uses
    started = time.monotonic()
    try:
        server.start(timeout=timeout_s)
    except RuntimeError as error:
        raise PrefectStartError(
            f"the local Prefect server did not answer {server.api_url}/health within {timeout_s} s "
            f"(waited {time.monotonic() - started:.0f} s; its database: {home / 'prefect.db'}): {error}\n"
            "Fix: give it longer (PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=600), or run a server "
            "of your own (`prefect server start`) and point clotho at it "
            "(PREFECT_API_URL=http://127.0.0.1:4200/api)."
        ) from error
    finally:
        prefect_server.subprocess.Popen = popen


def drain_prefect_reporting(timeout_s: float = 15.0) -> None:
    """Send the flow's last logs and events while the Prefect server is still up: at exit Prefect
    may stop its temporary server first, and the log worker then retries a dead server for minutes."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for service in (APILogWorker, EventsWorker):
        service.drain_all(timeout=timeout_s)


def run_flow(coroutine):
    """Runs an async flow to its end on an event loop of its own thread; Ctrl-C or SIGTERM (a
    supervisor's stop) cancels it there, at an await, so its cleanup stores every finished group.

    Why a thread: in the main thread Prefect answers SIGTERM by raising an exception wherever the
    interpreter happens to be, event-loop internals included, which can leave the flow's cleanup
    half-run; off the main thread it installs no handler. SIGINT is handled explicitly too, because
    a shell starts background jobs with it ignored. Raises Stopped after a signal.
    """
    start_local_prefect_server()
    loop = asyncio.new_event_loop()
    started = threading.Event()
    outcome: dict = {}
    holder: dict = {}

    def run() -> None:
        asyncio.set_event_loop(loop)
        holder["task"] = loop.create_task(coroutine)
        started.set()
        try:
            outcome["value"] = loop.run_until_complete(holder["task"])
        except BaseException as error:  # handed to the main thread
            outcome["error"] = error
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def stop(signum, _frame) -> None:
        outcome.setdefault("signal", signum)
        started.wait()
        loop.call_soon_threadsafe(holder["task"].cancel)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    thread = threading.Thread(target=run, name="clotho-flow")
    thread.start()
    try:
        while thread.is_alive():
            thread.join(0.2)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        drain_prefect_reporting()
    if "signal" in outcome:
        raise Stopped(outcome["signal"])
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


class TaskRunChatter(logging.Filter):
    """Drops task runs' INFO lines ("Task run 'lane 3' - Finished in state Completed()", hundreds a
    run) on their way to the terminal; they still reach the Prefect UI (its own handler)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name.startswith("prefect.task_runs") and record.levelno <= logging.INFO)


def quiet_terminal(verbose: bool) -> None:
    """Unless `verbose`: no task-run chatter on the terminal and no model-loading progress bars
    (transformers' "Loading weights", one per parity check after a reload, here and in the
    processes started from here). Call it once Prefect has set up its logging (after importing it)."""
    if verbose:
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers reads it when imported
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, TaskRunChatter) for f in handler.filters):
            handler.addFilter(TaskRunChatter())
