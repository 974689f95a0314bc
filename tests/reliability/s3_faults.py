"""Storage faults on command: an HTTP proxy between s3fs and the moto S3 server that delays, fails,
cuts or refuses requests, and one randomized storage-fault trial for the soak runner.

    s3fs (clotho's storage) --HTTP--> S3FaultProxy --HTTP--> moto_server

The proxy speaks just enough HTTP/1.1 to find request and response boundaries (Content-Length,
chunked bodies, HEAD), so faults hit exactly the requests they match: by method and a regular
expression searched in the request target (`/bucket/key?query`). Faults, checked in the order they
were added, each for `count` matching requests (None: until cleared):

    status          answer `status` (500, 503, ...) with an S3 error document; moto never sees it
    delay           forward, then hold the response `seconds` (a slow server; past the client's read
                    timeout it is a lost response)
    drop_request    forward the head and half the body, then cut both connections (mid-upload)
    drop_response   forward the whole request (moto acts on it), then cut the client's connection
                    before the response (the write happened; the writer cannot know)
    truncate        forward, then send the response head and half its body, and cut (a torn read)
    hang            take the request and never answer (until the client gives up)
    stop            forward half the body, then stop: every connection cut, new ones refused, for
                    `seconds` (None: until `resume()`): the server stopped mid-write
    stop_after      forward the whole request (moto acts on it), then stop as above before the
                    response: the write landed, then the server went away

Every exchange is recorded (`exchanges`), so tests count attempts and measure the backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import socket
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ACTIONS = ("status", "delay", "drop_request", "drop_response", "truncate", "hang", "stop", "stop_after")
_REASONS = {500: "Internal Server Error", 502: "Bad Gateway", 503: "Service Unavailable", 504: "Gateway Timeout"}
_CODES = {500: "InternalError", 502: "BadGateway", 503: "ServiceUnavailable", 504: "GatewayTimeout"}


@dataclass
class Fault:
    action: str
    count: int | None = 1
    method: str | None = None
    path: str | None = None
    status: int = 503
    seconds: float | None = 0.0
    hits: int = 0

    def matches(self, method: str, target: str) -> bool:
        if self.count is not None and self.hits >= self.count:
            return False
        if self.method is not None and method != self.method:
            return False
        return self.path is None or re.search(self.path, target) is not None


@dataclass(frozen=True)
class Exchange:
    """One request the proxy saw: when (monotonic), what, and what it did with it."""

    at: float
    method: str
    target: str
    action: str  # "forwarded" or a fault action
    status: int | None = None  # the status the client got, when it got one


class _Cut(Exception):
    """The connection is to be cut now."""


class S3FaultProxy:
    """A TCP proxy on a loopback port in front of an S3 API server; see the module's doc."""

    def __init__(self, upstream_url: str) -> None:
        upstream = urlsplit(upstream_url)
        self._upstream = (upstream.hostname or "127.0.0.1", upstream.port or 80)
        self._faults: list[Fault] = []
        self._lock = threading.Lock()
        self.exchanges: list[Exchange] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="s3-fault-proxy", daemon=True)
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.StreamWriter] = set()
        self._resume_handle: asyncio.TimerHandle | None = None
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.endpoint_url = f"http://127.0.0.1:{self.port}"

    # -- control, from any thread --------------------------------------------------------------

    def start(self) -> S3FaultProxy:
        self._thread.start()
        self._call(self._listen())
        return self

    def close(self) -> None:
        self._call(self._shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def inject(
        self,
        action: str,
        *,
        count: int | None = 1,
        method: str | None = None,
        path: str | None = None,
        status: int = 503,
        seconds: float | None = 0.0,
    ) -> Fault:
        if action not in ACTIONS:
            raise ValueError(f"fault action {action!r} is not one of {ACTIONS}")
        fault = Fault(action, count, method, path, status, seconds)
        with self._lock:
            self._faults.append(fault)
        return fault

    def clear(self) -> None:
        """Drop every fault (a stopped proxy stays stopped: see resume)."""
        with self._lock:
            self._faults.clear()

    def reset(self) -> None:
        """Drop every fault and forget the exchanges seen, listening again if stopped."""
        self.clear()
        with self._lock:
            self.exchanges.clear()
        if not self.listening:
            self.resume()

    def stop(self, seconds: float | None = None) -> None:
        """Cut every connection and refuse new ones, for `seconds` (None: until resume)."""
        self._call(self._stop(seconds))

    def resume(self) -> None:
        self._call(self._listen())

    @property
    def listening(self) -> bool:
        return self._server is not None

    def count(self, *, action: str | None = None, method: str | None = None, path: str | None = None) -> int:
        """Exchanges seen so far with this action, method and target pattern (None: any)."""
        with self._lock:
            exchanges = list(self.exchanges)
        return sum(
            1
            for exchange in exchanges
            if (action is None or exchange.action == action)
            and (method is None or exchange.method == method)
            and (path is None or re.search(path, exchange.target))
        )

    def _call(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=30)

    # -- the event loop's side -----------------------------------------------------------------

    async def _listen(self) -> None:
        if self._resume_handle is not None:
            self._resume_handle.cancel()
            self._resume_handle = None
        if self._server is None:
            self._server = await asyncio.start_server(
                self._serve, "127.0.0.1", self.port, reuse_address=True
            )

    async def _stop(self, seconds: float | None = None) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._connections):
            writer.transport.abort()
        self._connections.clear()
        if seconds is not None:
            self._resume_handle = self._loop.call_later(
                seconds, lambda: self._loop.create_task(self._listen())
            )

    async def _shutdown(self) -> None:
        await self._stop()  # cut connections end their tasks; a delayed answer's is cancelled
        tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        _, pending = await asyncio.wait(tasks, timeout=1.0) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    def _take_fault(self, method: str, target: str) -> Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.matches(method, target):
                    fault.hits += 1
                    return fault
        return None

    def _record(self, method: str, target: str, action: str, status: int | None = None) -> None:
        with self._lock:
            self.exchanges.append(Exchange(time.monotonic(), method, target, action, status))

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self._connections.add(client_writer)
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while True:
                head = await _read_head(client_reader)
                if head is None:
                    return
                method, target, headers = _parse_request_head(head)
                fault = self._take_fault(method, target)
                action = fault.action if fault else "forwarded"
                if headers.get("expect", "").lower() == "100-continue":
                    # Answer the interim response here and forward without it: the upstream then
                    # reads the body straight away, with no second interim response to relay.
                    client_writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                    head = _drop_header(head, "expect")
                if action in ("drop_request", "stop"):
                    self._record(method, target, action)
                    upstream = upstream or await self._connect()
                    upstream[1].write(head)
                    await _copy_body(client_reader, upstream[1], headers, limit_fraction=0.5)
                    await upstream[1].drain()
                    upstream[1].transport.abort()
                    if action == "stop":
                        await self._stop(fault.seconds)
                    raise _Cut
                if action in ("status", "hang"):
                    await _copy_body(client_reader, None, headers)
                    if action == "hang":
                        self._record(method, target, action)
                        await client_reader.read()  # until the client gives up
                        raise _Cut
                    self._record(method, target, action, fault.status)
                    client_writer.write(_error_response(fault.status, target, with_body=method != "HEAD"))
                    await client_writer.drain()
                    continue
                upstream = upstream or await self._connect()
                upstream[1].write(head)
                await _copy_body(client_reader, upstream[1], headers)
                await upstream[1].drain()
                response_head, response_body, keep_upstream = await _read_response(upstream[0], method)
                status = int(response_head.split(b" ", 2)[1])
                if not keep_upstream:
                    upstream[1].close()
                    upstream = None
                if action in ("drop_response", "stop_after"):
                    self._record(method, target, action)
                    if action == "stop_after":
                        await self._stop(fault.seconds)
                    raise _Cut
                if action == "truncate":
                    self._record(method, target, action, status)
                    client_writer.write(response_head + response_body[: len(response_body) // 2])
                    await client_writer.drain()
                    raise _Cut
                self._record(method, target, action, status)  # when it arrived, for a delay
                if action == "delay":
                    await asyncio.sleep(fault.seconds or 0.0)
                client_writer.write(response_head + response_body)
                await client_writer.drain()
        except (_Cut, ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            client_writer.transport.abort()  # cancelled only when the proxy closes: end quietly
        finally:
            self._connections.discard(client_writer)
            if upstream is not None:
                upstream[1].transport.abort()
            with contextlib.suppress(Exception):
                client_writer.close()

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection(*self._upstream, limit=2**20)


async def _read_head(reader: asyncio.StreamReader) -> bytes | None:
    try:
        return await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as error:
        if error.partial.strip():
            raise
        return None


def _parse_request_head(head: bytes) -> tuple[str, str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = lines[0].split(" ", 2)
    return method, target, _headers(lines[1:])


def _headers(lines: list[str]) -> dict[str, str]:
    headers = {}
    for line in lines:
        if ":" in line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    return headers


def _drop_header(head: bytes, name: str) -> bytes:
    lines = head.split(b"\r\n")
    kept = [line for line in lines if not line.lower().startswith(name.encode() + b":")]
    return b"\r\n".join(kept)


async def _copy_body(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter | None,
    headers: dict[str, str],
    limit_fraction: float = 1.0,
) -> None:
    """Relay a request body (Content-Length or chunked) to `writer` (None: discard); with
    `limit_fraction` < 1 only that part of a Content-Length body, leaving the rest unread."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        body = await _read_chunked(reader)
        if writer is not None:
            writer.write(body[: int(len(body) * limit_fraction)])
        return
    remaining = int(int(headers.get("content-length", "0")) * limit_fraction)
    while remaining > 0:
        block = await reader.read(min(remaining, 2**20))
        if not block:
            raise asyncio.IncompleteReadError(b"", remaining)
        remaining -= len(block)
        if writer is not None:
            writer.write(block)
            await writer.drain()


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    """A chunked body as it was on the wire, trailers included."""
    parts = []
    while True:
        size_line = await reader.readuntil(b"\r\n")
        parts.append(size_line)
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            while True:  # trailers, then the empty line
                line = await reader.readuntil(b"\r\n")
                parts.append(line)
                if line == b"\r\n":
                    return b"".join(parts)
        parts.append(await reader.readexactly(size + 2))


async def _read_response(reader: asyncio.StreamReader, method: str) -> tuple[bytes, bytes, bool]:
    """(head, body, whether the connection stays open) of the upstream's next final response."""
    while True:
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        if status >= 200:
            break
    lines = head.decode("latin-1").split("\r\n")
    headers = _headers(lines[1:])
    keep = headers.get("connection", "").lower() != "close" and lines[0].startswith("HTTP/1.1")
    if method == "HEAD" or status in (204, 304):
        return head, b"", keep
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return head, await _read_chunked(reader), keep
    if "content-length" in headers:
        return head, await reader.readexactly(int(headers["content-length"])), keep
    return head, await reader.read(), False  # delimited by the close


def _error_response(status: int, target: str, *, with_body: bool) -> bytes:
    code = _CODES.get(status, "InternalError")
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>injected fault {status}</Message>"
        f"<Resource>{target.split('?')[0]}</Resource><RequestId>fault</RequestId></Error>"
    ).encode()
    head = (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
        "Content-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    return head + body if with_body else head


# -- what a reader sees while faults hit ----------------------------------------------------------


class RunWatcher(threading.Thread):
    """Polls a run as the trainer and the reload watcher do, while faults hit: takes new groups
    through a ShardReader (its ledger), lists the rollouts and reads every shard listed, and
    verifies every checkpoint step that shows a STABLE. Counts what it must never see: a listed
    shard that does not read back whole, a temporary file among the rollouts, a STABLE step whose
    files do not match it. Storage errors are counted, not raised: a poll that failed clearly left
    the ledger where it was, and the next poll goes on."""

    def __init__(self, root: str, run: str, *, poll_s: float = 0.1, checkpoints: bool = True) -> None:
        super().__init__(name="run-watcher", daemon=True)
        from storage.reader import ShardReader

        self.root, self.run_name, self.poll_s, self.checkpoints = root, run, poll_s, checkpoints
        self.reader = ShardReader(root, run)
        self.seen: dict[str, int] = {}  # group id -> times handed out
        self.torn: list[str] = []
        self.errors: list[str] = []
        self.trusted_steps: set[int] = set()
        self.polls = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.poll()
            self._stop_event.wait(self.poll_s)

    def poll(self) -> None:
        from storage.checkpoints import CheckpointError, checkpoint_url, published_steps, read_checkpoint
        from storage.filesystem import list_files, resolve
        from storage.layout import rollouts_url
        from storage.schema import ShardFormatError
        from storage.shard_file import find_shards, read_shard

        try:
            for group in self.reader.groups():
                self.seen[group.group_id] = self.seen.get(group.group_id, 0) + 1
            url = rollouts_url(self.root, self.run_name)
            fs, path = resolve(url)
            for name in list_files(fs, path):
                if not name.endswith(".parquet") or "/." in name:
                    self.torn.append(f"a file other than a shard is visible among the rollouts: {name}")
            for shard in find_shards(url)[1]:
                try:
                    read_shard(fs, shard)
                except ShardFormatError as error:
                    self.torn.append(str(error))
                except FileNotFoundError:
                    pass  # listed, then moved away (quarantine): not a torn read
            if self.checkpoints:
                for step in published_steps(self.root, self.run_name):
                    try:
                        read_checkpoint(checkpoint_url(self.root, self.run_name, step))
                        self.trusted_steps.add(step)
                    except CheckpointError as error:
                        if "no STABLE" not in str(error):  # else deleted between listing and read
                            self.torn.append(str(error))
        except OSError as error:
            self.errors.append(str(error).splitlines()[0])
        self.polls += 1

    def stop(self, timeout_s: float = 90.0) -> None:
        self._stop_event.set()
        self.join(timeout=timeout_s)

    def finish(self) -> None:
        """Stop polling, then poll once more with the faults gone."""
        self.stop()
        self.poll()

    def counts(self, committed: list[str]) -> tuple[int, int]:
        """(lost, twice): committed groups never handed out, groups handed out more than once."""
        lost = sum(1 for group_id in committed if group_id not in self.seen)
        twice = sum(1 for count in self.seen.values() if count > 1)
        return lost, twice


# -- randomized storage-fault trials, for the soak runner -----------------------------------------

# (name, fault) a trial draws from; every fault is bounded (a count, or an outage of seconds), so
# each heals within clotho's retry budget and every write must land exactly once.
TRANSIENT_FAULTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("500 x2", dict(action="status", status=500, count=2)),
    ("503 x3", dict(action="status", status=503, count=3)),
    ("503 on shard PUTs x4", dict(action="status", status=503, count=4, method="PUT", path=r"\.parquet")),
    ("slow 1.5 s x3", dict(action="delay", seconds=1.5, count=3)),
    ("dropped mid-upload", dict(action="drop_request", method="PUT", count=1)),
    ("lost response to a shard PUT", dict(action="drop_response", method="PUT", path=r"\.parquet", count=1)),
    ("lost response to STABLE", dict(action="drop_response", method="PUT", path=r"/STABLE", count=1)),
    ("lost response", dict(action="drop_response", count=1)),
    ("torn GET", dict(action="truncate", method="GET", count=2)),
    ("stopped mid-write 1 s", dict(action="stop", method="PUT", seconds=1.0, count=1)),
    ("stopped mid-write 4 s", dict(action="stop", method="PUT", seconds=4.0, count=1)),
)


@dataclass
class StorageTrial:
    """One trial's outcome; `row()` is its line in the soak table."""

    seed: int
    faults: list[str] = field(default_factory=list)  # armed, one before each write
    fired: int = 0  # requests a fault hit
    committed: int = 0  # groups in shards the writer reported written
    lost: int = 0
    twice: int = 0
    torn: int = 0
    checkpoints: int = 0  # steps published, each verified against its STABLE afterwards
    errors: list[str] = field(default_factory=list)  # clear failures a write raised (then retried)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.committed > 0 and self.lost == 0 and self.twice == 0 and self.torn == 0

    def row(self) -> dict[str, Any]:
        return {
            "fault": "storage (S3 API)",
            "seed": self.seed,
            "armed": len(self.faults),
            "fired": self.fired,
            "committed": self.committed,
            "lost": self.lost,
            "twice": self.twice,
            "torn": self.torn,
            "checkpoints": self.checkpoints,
            "seconds": round(self.seconds, 1),
            "result": "ok" if self.ok else "FAIL",
        }


def run_storage_fault_trial(
    seed: int,
    proxy: S3FaultProxy,
    bucket: str,
    *,
    flushes: int = 6,
    groups_per_flush: int = 3,
    checkpoints: int = 2,
    checkpoint_bytes: int = 256 * 1024,
) -> StorageTrial:
    """Write `flushes` shards and publish `checkpoints` checkpoints to a fresh run in s3://`bucket`
    through `proxy`, one random TRANSIENT_FAULTS entry (drawn by `seed`) armed before each write,
    while a RunWatcher polls; then heal the proxy, let the watcher catch up and count lost, twice
    and torn. A write that still fails clearly is retried after a pause, as its caller would.

    The caller points clotho at the proxy first: AWS_ENDPOINT_URL=proxy.endpoint_url and the
    credentials of tests.s3_server.CREDENTIALS in the environment.
    """
    import s3fs

    from storage.checkpoints import checkpoint_url, publish_checkpoint, read_checkpoint
    from storage.writer import ShardWriter
    from tests.storage.factory import make_group

    rng = random.Random(seed)
    trial = StorageTrial(seed)
    started = time.monotonic()
    seen_before = len(proxy.exchanges)
    s3fs.S3FileSystem.clear_instance_cache()
    root, run = f"s3://{bucket}/soak-{seed}-{uuid.uuid4().hex[:8]}", "run"

    def with_fault(write: Any) -> bool:
        name, fault = rng.choice(TRANSIENT_FAULTS)
        trial.faults.append(name)
        proxy.inject(**fault)
        try:
            for pause_s in (2.0, 5.0, 10.0):
                try:
                    write()
                    return True
                except OSError as error:
                    trial.errors.append(str(error).splitlines()[0])
                    time.sleep(pause_s)
            return False
        finally:
            proxy.clear()
            if not proxy.listening:
                proxy.resume()

    watcher = RunWatcher(root, run)
    watcher.start()
    committed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="storage-trial-") as temporary:
        writer = ShardWriter(root, run, tokenizer="tiny", max_groups=10**6)
        for _ in range(flushes):
            groups = [make_group(rng) for _ in range(groups_per_flush)]
            writer.add_many(groups)
            if with_fault(writer.flush):
                committed += [group.group_id for group in groups]
        writer.close()
        for step in range(checkpoints):
            source = Path(temporary) / f"step-{step}"
            source.mkdir()
            (source / "config.json").write_text(json.dumps({"step": step}))
            (source / "model.safetensors").write_bytes(rng.randbytes(checkpoint_bytes))

            def publish(source: Path = source, step: int = step) -> None:
                try:
                    publish_checkpoint(source, root, run, step)
                except FileExistsError:  # a try that failed clearly after its STABLE landed
                    read_checkpoint(checkpoint_url(root, run, step))

            trial.checkpoints += with_fault(publish)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(group_id not in watcher.seen for group_id in committed):
        time.sleep(0.2)
    watcher.finish()
    trial.committed = len(committed)
    trial.lost, trial.twice = watcher.counts(committed)
    trial.torn = len(watcher.torn)
    for step in range(trial.checkpoints):
        try:
            read_checkpoint(checkpoint_url(root, run, step))
        except Exception as error:  # a published step that does not verify is a torn checkpoint
            trial.torn += 1
            trial.errors.append(str(error).splitlines()[0])
    trial.fired = sum(1 for exchange in proxy.exchanges[seen_before:] if exchange.action != "forwarded")
    trial.seconds = time.monotonic() - started
    return trial


def run_storage_fault_soak(trials: int = 20, seed: int = 0, *, report: Any = print) -> list[dict[str, Any]]:
    """`trials` randomized storage-fault trials against a moto server of their own behind a fault
    proxy (seeds seed..seed+trials-1); returns one soak-table row per trial, `report`ed as it ends.
    Sets AWS_ENDPOINT_URL and test credentials for the duration, and restores them."""
    from tests.s3_server import CREDENTIALS, create_bucket, s3_environment, start_s3_server, stop_s3_server

    server = start_s3_server()
    proxy = S3FaultProxy(server.endpoint_url).start()
    rows = []
    try:
        with s3_environment({**CREDENTIALS, "AWS_ENDPOINT_URL": proxy.endpoint_url}):
            create_bucket(server, "clotho-soak")
            for index in range(trials):
                row = run_storage_fault_trial(seed + index, proxy, "clotho-soak").row()
                report(row)
                rows.append(row)
    finally:
        proxy.close()
        stop_s3_server(server)
    return rows


if __name__ == "__main__":  # python -m tests.reliability.s3_faults [TRIALS] [SEED]
    import sys

    results = run_storage_fault_soak(*(int(value) for value in sys.argv[1:3]))
    sys.exit(0 if all(row["result"] == "ok" for row in results) else 1)
