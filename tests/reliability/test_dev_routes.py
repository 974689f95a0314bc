"""Nobody let in, the policy server: off-machine clients try its dev routes.

A server on 0.0.0.0 with an API key, asked from an address that is not this machine's loopback
(its own non-loopback address) on every route its OpenAPI lists and some it does not: 401 without a key and with every wrong one, answers
with the right one; a loopback server cannot be reached at all; the key is compared with
hmac.compare_digest.
"""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import json
import subprocess
import sys

import pytest

from tests.conftest import KEYED_SERVER_KEY as KEY
from tests.reliability.sandbox_attacks import REPO, host_address

# ---------------------------------------------------------------------------------------------
# The policy server's dev routes


def test_the_key_is_compared_only_in_constant_time() -> None:
    """No ==, !=, in or is touches the key or the token in clotho_auth; hmac.compare_digest does."""
    path = REPO / "inference" / "vllm_plugins" / "clotho_auth.py"
    tree = ast.parse(path.read_text())
    secrets_named = {"key", "token"}

    def names(node: ast.AST) -> set[str]:
        return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}

    compares = [node for node in ast.walk(tree) if isinstance(node, ast.Compare)]
    for node in compares:
        assert not names(node) & secrets_named, (
            f"line {node.lineno} of {path.name} compares the key with {ast.unparse(node)!r}"
        )
    digests = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "hmac.compare_digest"
    ]
    assert digests and all(names(call) >= secrets_named for call in digests)


async def test_the_middleware_decides_by_compare_digest(monkeypatch) -> None:
    """Run in this process: every request's token goes through hmac.compare_digest, whose answer
    alone lets it in."""
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse

    spec = importlib.util.spec_from_file_location("clotho_auth", REPO / "inference" / "vllm_plugins" / "clotho_auth.py")
    auth = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(auth)
    calls = []

    class Spy:
        @staticmethod
        def compare_digest(a, b):
            calls.append((a, b))
            return __import__("hmac").compare_digest(a, b)

    monkeypatch.setattr(auth, "hmac", Spy)
    monkeypatch.setenv("VLLM_API_KEY", "sk-dummy-SECRET-123")

    async def answered(path: str, authorization: str | None) -> int:
        headers = [(b"authorization", authorization.encode())] if authorization else []
        request = Request({"type": "http", "method": "POST", "path": path, "headers": headers, "query_string": b""})
        response = await auth.require_api_key(request, lambda request: asyncio.sleep(0, PlainTextResponse("in")))
        return response.status_code

    assert await answered("/collective_rpc", "Bearer sk-dummy-SECRET-123") == 200
    assert calls[-1] == (b"sk-dummy-SECRET-123", b"sk-dummy-SECRET-123")
    for wrong in ("sk-dummy-SECRET-124", "sk-dummy-SECRET-12", "sk-dummy-SECRET-1234", "x" * 19, ""):
        before = len(calls)
        assert await answered("/collective_rpc", f"Bearer {wrong}") == 401
        assert calls[before:] == [(wrong.encode(), b"sk-dummy-SECRET-123")]
    assert await answered("/pause", None) == 401 and await answered("/pause", "sk-dummy-SECRET-123") == 401
    assert await answered("/health", None) == 200
    monkeypatch.setenv("VLLM_API_KEY", "")
    assert await answered("/pause", "Bearer ") == 401  # no key configured lets nobody in


class Remote:
    """A client that is not on this machine's loopback: requests from this machine's own
    non-loopback address, to it (the server sees a client address other than 127.0.0.1, as from
    another machine). It touches none of the machine's network; the loop across separate hosts is
    tests/cluster's, in namespaces of its own."""

    def __init__(self):
        self.address = self.client_address = host_address()
        if self.address is None:
            pytest.skip("no non-loopback address on this machine")

    def send(self, port: int, requests: list[dict]) -> list[dict]:
        """Each request {method, path, headers?, raw?} to this machine's address from that address:
        [{status, body} or {error}]."""
        command = [sys.executable, "-I", "-c", CLIENT, self.address, str(port), self.client_address]
        done = subprocess.run(command, input=json.dumps(requests), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout)


# Runs on the remote: plain http.client (paths sent exactly as written), or raw bytes for an upgrade.
CLIENT = r"""
import http.client, json, socket, sys
host, port, source = sys.argv[1], int(sys.argv[2]), sys.argv[3]
answers = []
for request in json.load(sys.stdin):
    try:
        if "raw" in request:
            with socket.create_connection((host, port), timeout=10, source_address=(source, 0)) as sock:
                sock.sendall(request["raw"].encode())
                answers.append({"status": int(sock.recv(4096).split(b" ")[1]), "body": ""})
            continue
        connection = http.client.HTTPConnection(host, port, timeout=30, source_address=(source, 0))
        body = request.get("body", "{}").encode() if request["method"] in ("POST", "PUT", "PATCH") else None
        headers = {"Content-Type": "application/json", **request.get("headers", {})}
        connection.request(request["method"], request["path"], body=body, headers=headers)
        response = connection.getresponse()
        answers.append({"status": response.status, "body": response.read(300).decode(errors="replace")})
        connection.close()
    except OSError as error:
        answers.append({"error": f"{type(error).__name__}: {error}"})
print(json.dumps(answers))
"""

WRONG_CREDENTIALS = [
    {},
    {"Authorization": "Bearer wrong"},
    {"Authorization": f"Bearer {KEY[:-1]}"},
    {"Authorization": f"Bearer {KEY}4"},
    {"Authorization": f"Bearer {KEY.upper()}"},
    {"Authorization": f"Basic {KEY}"},
    {"Authorization": KEY},
    {"Authorization": "Bearer "},
    {"X-API-Key": KEY},
    {"Cookie": f"api_key={KEY}"},
]
# Not in the OpenAPI document, or the same routes spelled otherwise.
EXTRA_PATHS = [
    "/docs",
    "/redoc",
    "/openapi.json",
    "/nonexistent",
    "//pause",
    "/pause/",
    "/./pause",
    "/health/../pause",
    "/%70ause",
    "/health/%2e%2e/collective_rpc",
    "/PAUSE",
    f"/pause?api_key={KEY}",
]
OPEN_PATHS = {"/health"}


@pytest.fixture(scope="module")
def remote():
    return Remote()


@pytest.fixture(scope="module")
def public_server(keyed_server):
    """A server bound to every address, with an API key: the suite's keyed server (tests/conftest.py)."""
    assert keyed_server.host == "0.0.0.0" and keyed_server.api_key == KEY
    return keyed_server


def every_route(server) -> list[tuple[str, str]]:
    import httpx

    document = httpx.get(f"http://127.0.0.1:{server.port}/openapi.json", headers=server.headers, timeout=30).json()
    routes = [
        (method.upper(), path.replace("{", "").replace("}", ""))
        for path, methods in document["paths"].items()
        for method in methods
    ]
    routes += [("HEAD", path) for method, path in routes if method == "GET"]
    return routes + [("POST", path) for path in EXTRA_PATHS] + [("GET", path) for path in EXTRA_PATHS]


@pytest.mark.integration
def test_dev_routes_refuse_every_request_without_the_right_key_from_off_this_machine(public_server, remote) -> None:
    routes = every_route(public_server)
    dev = {
        "/pause",
        "/resume",
        "/collective_rpc",
        "/reset_prefix_cache",
        "/update_weight_version",
        "/weight_info",
        "/sleep",
    }
    assert dev <= {path for _, path in routes}, "vLLM's dev mode is off: the routes under test are missing"
    requests = [
        {"method": method, "path": path, "headers": headers} for method, path in routes for headers in WRONG_CREDENTIALS
    ]
    # A body the route would act on: an announcement that must not happen.
    requests += [
        {"method": "POST", "path": "/update_weight_version", "headers": headers, "body": '{"new_version": "999"}'}
        for headers in WRONG_CREDENTIALS
    ]
    # An upgrade to a WebSocket: clotho's middleware sees HTTP only, vLLM's own check covers /v1.
    upgrade = (
        "GET {} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    requests += [{"raw": upgrade.format(path)} for path in ("/v1/realtime", "/collective_rpc", "/pause")]
    answers = remote.send(public_server.port, requests)
    # An HTTP request is refused with 401; an upgrade with anything but 101 Switching Protocols.
    let_in = [
        (r.get("method"), r.get("path") or r["raw"].split()[1], r.get("headers"), a)
        for r, a in zip(requests, answers, strict=True)
        if (
            a.get("status") == 101
            if "raw" in r
            else r["path"].split("?")[0] not in OPEN_PATHS and a.get("status") != 401
        )
    ]
    assert let_in == [], (
        f"{len(let_in)} of {len(requests)} requests from {remote.client_address} were not refused: {let_in[:10]}"
    )

    # The right key opens them, from the same remote: the refusals above were for want of the key.
    authorized = {"Authorization": f"Bearer {KEY}"}
    checks = [
        ("GET", "/health", {}),
        ("GET", "/is_paused", authorized),
        ("GET", "/weight_info", authorized),
        ("GET", "/is_sleeping", authorized),
        ("GET", "/v1/models", authorized),
        ("POST", "/pause", authorized),
        ("GET", "/is_paused", authorized),
        ("POST", "/resume", authorized),
        ("GET", "/is_paused", authorized),
    ]
    answers = remote.send(public_server.port, [{"method": m, "path": p, "headers": h} for m, p, h in checks])
    assert [a.get("status") for a in answers] == [200] * len(checks), answers
    # Nothing refused had an effect: never paused or put to sleep before the keyed /pause, version unchanged.
    paused = [json.loads(a["body"])["is_paused"] for a in (answers[1], answers[6], answers[8])]
    assert paused == [False, True, False] and json.loads(answers[3]["body"])["is_sleeping"] is False
    from inference.client import parse_weight_version

    assert parse_weight_version(json.loads(answers[2]["body"]).get("weight_version")) == 0, answers[
        2
    ]  # never announced


@pytest.mark.integration
def test_options_requests_pass_the_key_check_but_run_nothing(public_server, remote) -> None:
    """The middleware lets OPTIONS through unauthenticated (CORS preflights carry no credentials):
    none of them may reach a handler."""
    posts = [
        "/pause",
        "/sleep",
        "/collective_rpc",
        "/update_weight_version",
        "/reset_prefix_cache",
        "/scale_elastic_ep",
    ]
    preflight = {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"}
    requests = [
        {"method": "OPTIONS", "path": path, "headers": headers} for path in posts for headers in ({}, preflight)
    ]
    answers = remote.send(public_server.port, requests)
    assert all(a.get("status") in (200, 400, 405) for a in answers), answers
    authorized = {"Authorization": f"Bearer {KEY}"}
    state = remote.send(
        public_server.port,
        [{"method": "GET", "path": p, "headers": authorized} for p in ("/is_paused", "/is_sleeping")],
    )
    assert [json.loads(a["body"]) for a in state] == [{"is_paused": False}, {"is_sleeping": False}], state


@pytest.mark.integration
def test_a_server_without_a_key_cannot_be_reached_off_loopback(policy_server, remote) -> None:
    """Without a key PolicyServer binds loopback only (a public bind without a key is refused:
    tests/inference/test_server.py): from another address nothing answers on its port."""
    port = int(policy_server.base_url.rsplit(":", 1)[1].split("/")[0])
    answers = remote.send(port, [{"method": "POST", "path": "/collective_rpc"}, {"method": "GET", "path": "/health"}])
    assert all("error" in answer for answer in answers), f"{policy_server.base_url} answered off loopback: {answers}"
    assert "Connection" in answers[0]["error"] or "refused" in answers[0]["error"].lower(), answers
