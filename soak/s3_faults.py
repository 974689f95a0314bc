"""Storage faults on command: an HTTP proxy between s3fs and the moto S3 server that delays, fails,
cuts or refuses requests (the trials that use it: soak.storage_faults).

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
import re
import socket
import threading
import time
from dataclasses import dataclass
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
            self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port, reuse_address=True)

    async def _stop(self, seconds: float | None = None) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._connections):
            writer.transport.abort()
        self._connections.clear()
        if seconds is not None:
            self._resume_handle = self._loop.call_later(seconds, lambda: self._loop.create_task(self._listen()))

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
