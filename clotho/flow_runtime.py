"""Running a Prefect flow from a command: its own event loop thread, signals turned into a
cancel, a local Prefect server of its own in a session of its own, logs drained before exit."""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import os
import signal
import subprocess
import sys
import threading
import time
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
    """Without PREFECT_API_URL a command's flows run against a local Prefect server that the
    command owns: `prefect server start` on a free loopback port, started here once, its URL set in
    the environment (for the processes the command starts) and Prefect's settings read again from
    it (prefect.context.refresh_global_settings_context: the command goes on in this process, not
    run a second time). It stops when the command exits. Why not Prefect's temporary server:

    - The server gets a session of its own: in our process group, a Ctrl-C in the terminal (sent to
      the whole group) would stop it in the middle of the flow's cleanup, which then hangs reporting
      to it. Prefect starts its temporary server in our group and offers no way to change that.
    - Its Prefect UI serves the run while it runs: the command prints the address.
    - PREFECT_HOME is created first: with its parent missing, SQLite cannot open the database.
    - The wait fits a first start (FIRST_START_TIMEOUT_S, or Prefect's setting when larger), and a
      start that still fails says what it waited for and how to fix it.

    A process that is not the `clotho` command (a test calling a command in-process) keeps its
    environment: Prefect's temporary server serves it.
    """
    from prefect.context import refresh_global_settings_context
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_HOME,
        PREFECT_SERVER_EPHEMERAL_ENABLED,
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
    )

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value() or not is_the_command():
        return
    home = Path(PREFECT_HOME.value()).expanduser()
    if not (home / "prefect.db").exists():
        print(f"clotho: first start of the local Prefect server: creating its database in {home}", file=sys.stderr)
    make_prefect_home(home)
    timeout_s = max(FIRST_START_TIMEOUT_S, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value())
    url, server = serve_prefect(home, timeout_s)
    atexit.register(stop_server, server.pid)
    print(
        f"clotho: Prefect UI at {url.removesuffix('/api')} while this command runs (its runs stay in {home}; "
        "`prefect server start` shows them later)",
        file=sys.stderr,
    )
    os.environ["PREFECT_API_URL"] = url
    refresh_global_settings_context()
    if PREFECT_API_URL.value() != url:  # a settings context entered before this one would hide the URL
        raise PrefectStartError(f"Prefect did not take PREFECT_API_URL={url}; set it before running the command")


def is_the_command() -> bool:
    """Whether this process is the `clotho` command (its console script or `python -m clotho.cli`)."""
    main = Path(sys.argv[0])
    return main.name == "clotho" or main.parts[-2:] == ("clotho", "cli.py")


def prefect_server_process(
    home: Path, port: int, environment: dict[str, str] | None = None
) -> tuple[list[str], dict[str, str]]:
    """The command and environment of `prefect server start` on 127.0.0.1:`port` with its database
    in `home`: what every Prefect server clotho starts runs (the command's, the tests', the soak's).
    `environment`: what it starts from (os.environ by default), less any PREFECT_API_URL (the
    server is not a client of another)."""
    env = dict(os.environ if environment is None else environment)
    env.pop("PREFECT_API_URL", None)
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_UI_API_URL=f"http://127.0.0.1:{port}/api",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
    )
    command = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    return command, env


def serve_prefect(home: Path, timeout_s: float) -> tuple[str, subprocess.Popen]:
    """`prefect server start` on a free loopback port in a session of its own, answering its
    health check, ended with the command however it ends (core.processes.tethered); its API URL
    and process. PrefectStartError if it does not come up in time."""
    from core.processes import free_port, tethered, wait_answering

    log_path = home / "clotho-local-server.log"
    started = time.monotonic()
    for _ in range(3):  # a port taken between finding it and binding it: another one
        port = free_port()
        command, env = prefect_server_process(home, port)
        with open(log_path, "ab") as log:
            server = subprocess.Popen(
                tethered(command),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
            )
        url = f"http://127.0.0.1:{port}/api"
        left_s = timeout_s - (time.monotonic() - started)
        if wait_answering(f"{url}/health", lambda server=server: server.poll() is None, left_s):
            return url, server
        if server.poll() is None:
            break
    stop_server(server.pid)
    raise PrefectStartError(
        f"the local Prefect server did not answer {url}/health within {timeout_s:.0f} s "
        f"(waited {time.monotonic() - started:.0f} s; its log: {log_path}; its database: {home / 'prefect.db'})\n"
        "Fix: give it longer (PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=600), or run a server "
        "of your own (`prefect server start`) and point clotho at it "
        "(PREFECT_API_URL=http://127.0.0.1:4200/api)."
    )


def stop_server(pid: int) -> None:
    from core.processes import stop_child_group

    stop_child_group(pid, timeout_s=10.0)


def drain_prefect_reporting(timeout_s: float = 15.0) -> None:
    """Send the flow's last logs and events while the Prefect server is still up: at exit Prefect
    may stop its temporary server first, and the log worker then retries a dead server for minutes."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for service in (APILogWorker, EventsWorker):
        service.drain_all(timeout=timeout_s)


SLOW_CALLBACK_S = 0.25


class FlowThread(threading.Thread):
    """One coroutine run to its end on an event loop of this thread's own; `outcome` holds its result
    or error, `cancel()` (from any thread) cancels it at an await."""

    def __init__(self, coroutine):
        super().__init__(name="clotho-flow")
        self.coroutine, self.loop = coroutine, asyncio.new_event_loop()
        # Nothing on the flow's loop may block it (storage, process waits and sleeps run in threads):
        # with PYTHONASYNCIODEBUG=1 asyncio logs every callback that runs longer than this.
        self.loop.slow_callback_duration = SLOW_CALLBACK_S
        self.outcome: concurrent.futures.Future = concurrent.futures.Future()
        self.task: asyncio.Task | None = None
        self.started = threading.Event()

    def run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.task = self.loop.create_task(self.coroutine)  # here: its context is this thread's, not the caller's
        self.started.set()
        try:
            self.outcome.set_result(self.loop.run_until_complete(self.task))
        except BaseException as error:  # noqa: BLE001 - handed to the caller
            self.outcome.set_exception(error)
        finally:
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    def cancel(self) -> None:
        self.started.wait()
        self.loop.call_soon_threadsafe(self.task.cancel)


def run_flow(coroutine):
    """Runs an async flow to its end on an event loop of its own thread; Ctrl-C or SIGTERM (a
    supervisor's stop) cancels it there, at an await, so its cleanup stores every finished group.

    Why a thread: in the main thread Prefect answers SIGTERM by raising an exception wherever the
    interpreter happens to be, event-loop internals included, which can leave the flow's cleanup
    half-run; off the main thread it installs no handler. SIGINT is handled explicitly too, because
    a shell starts background jobs with it ignored. Raises Stopped after a signal.
    """
    start_local_prefect_server()
    flow = FlowThread(coroutine)
    signals: list[int] = []

    def stop(signum, _frame) -> None:
        signals.append(signum)
        flow.cancel()

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    flow.start()
    try:
        while flow.is_alive():
            flow.join(0.2)  # in slices: the main thread runs the signal handlers between them
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        drain_prefect_reporting()
    if signals:
        raise Stopped(signals[0])
    return flow.outcome.result()


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
