"""Running a Prefect flow from a command: its own event loop thread, signals turned into a
cancel, a local Prefect server in a session of its own, logs drained before exit."""

from __future__ import annotations

import asyncio
import signal
import threading


class Stopped(Exception):
    """The flow was cancelled by SIGINT or SIGTERM; its finished work is stored."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def start_local_prefect_server() -> None:
    """Without PREFECT_API_URL a flow runs against a temporary local Prefect server that Prefect
    starts on first use, as a child in our process group: a Ctrl-C in the terminal (sent to the
    whole group) would stop it in the middle of the flow's cleanup, which then hangs reporting to
    it. Start it here in a session of its own (uvicorn installs its own SIGINT handler, so ignoring
    the signal is not enough); Prefect still stops it when this process exits."""
    import subprocess

    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return
    from prefect.server.api import server as prefect_server

    class OwnSession(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, start_new_session=True, **kwargs)

    popen = prefect_server.subprocess.Popen
    prefect_server.subprocess.Popen = OwnSession  # only while this one server starts
    try:
        prefect_server.SubprocessASGIServer().start()  # the instance Prefect's client then uses
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
