"""The verifiers adapter's model route: vLLM's /inference/v1/generate, what verifiers' TrainClient
calls, served on loopback in front of clotho's policy server (environments.adapters.verifiers points
each episode's TrainClient at it). It answers in verifiers' terms and keeps, beside them, each
completion's policy versions and sampling parameters, which those terms have no field for.
"""

from __future__ import annotations

import collections
import contextlib
import socket
import threading
import time
import uuid
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from inference.client import Completion, PolicyClient, PolicyServerAuthError, PolicyServerError, PolicyServerUnreachable

# The route's latest completions, kept until the episodes that asked for them
# are stored: far more than the completions of the groups one service collects at once.
KEPT_COMPLETIONS = 65536


# Sampling parameters the route passes to /v1/completions, and the ones renderers sets on every
# request that need nothing: the sampled token's logprob is always returned, ids never text, and
# router replay (routed_experts) is for MoE engines.
SAMPLING = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "seed")
ANSWERED_ANYWAY = ("logprobs", "skip_special_tokens", "routed_experts_prompt_start")


def completion_parameters(body: dict[str, Any]) -> dict[str, Any]:
    """PolicyClient.complete's keywords for one generate request; ValueError for what it cannot do."""
    unknown = set(body) - {"model", "token_ids", "sampling_params", "cache_salt", "priority"}
    if unknown:
        raise ValueError(f"generate: {sorted(unknown)} not supported (text-only prompts of token ids)")
    parameters = dict(body.get("sampling_params") or {})
    unknown = set(parameters) - set(SAMPLING) - set(ANSWERED_ANYWAY)
    if unknown:
        raise ValueError(f"generate: sampling parameters {sorted(unknown)} not supported; supported: {SAMPLING}")
    return {name: parameters[name] for name in SAMPLING if parameters.get(name) is not None}


class GenerateServer:
    """vLLM's /inference/v1/generate, what verifiers' TrainClient calls, in front of the policy
    server's /v1/completions: on a loopback port, in a thread of its own (its own event loop, so
    it needs nothing from whoever runs the environment). One per policy client's settings.

    The route answers in verifiers' terms, which have no field for the policy versions and sampling
    parameters of a completion, so it keeps the completions here, by their ids and logprobs (what
    verifiers stores in the message node the reply becomes, exactly), for `completion_of` to give
    each stored sequence."""

    def __init__(self, policy_url: str, api_key: str | None, max_retries: int, backoff: float):
        self.policy = dict(base_url=policy_url, api_key=api_key, max_retries=max_retries, backoff=backoff)
        self.client: PolicyClient | None = None
        # The policy server unreachable or refusing the key breaks the run, not a rollout:
        # collect_trajectories raises what the route saw (verifiers would record a failed trace).
        self.run_errors = 0
        self.last_run_error: Exception | None = None
        self.completions: collections.OrderedDict[tuple, Completion] = collections.OrderedDict()
        self.completions_lock = threading.Lock()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        routes = [Route("/v1/models", self.models), Route("/inference/v1/generate", self.generate, methods=["POST"])]
        app = Starlette(routes=routes, lifespan=self.lifespan)
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, daemon=True, name="verifiers-generate"
        ).start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the generate route on {self.url} did not start within 30 s")
            time.sleep(0.02)

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        async with PolicyClient(**self.policy) as client:
            self.client = client
            yield

    async def models(self, request: Request) -> JSONResponse:
        """The served model card (renderers reads max_model_len from it to refuse overlong prompts)."""
        try:
            return JSONResponse((await self.client.request("GET", "/v1/models")).json())
        except (PolicyServerUnreachable, PolicyServerAuthError) as error:
            return self.run_error(error)

    async def generate(self, request: Request) -> JSONResponse:
        body = await request.json()
        try:
            [completion] = await self.client.complete(body["token_ids"], n=1, **completion_parameters(body))
        except ValueError as error:
            return JSONResponse({"error": str(error)}, status_code=400)
        except (PolicyServerUnreachable, PolicyServerAuthError) as error:
            return self.run_error(error)
        except PolicyServerError as error:  # the policy server refused the request (a prompt too long ...)
            return JSONResponse({"error": str(error)}, status_code=400)
        with self.completions_lock:
            self.completions[(tuple(completion.token_ids), tuple(completion.logprobs))] = completion
            while len(self.completions) > KEPT_COMPLETIONS:
                self.completions.popitem(last=False)
        pairs = zip(completion.token_ids, completion.logprobs)
        content = [{"token": f"token_id:{token}", "logprob": logprob} for token, logprob in pairs]
        return JSONResponse(
            {
                "request_id": f"clotho-{uuid.uuid4().hex}",
                "prompt_token_ids": body["token_ids"],
                "choices": [
                    {
                        "index": 0,
                        "token_ids": completion.token_ids,
                        "logprobs": {"content": content},
                        "finish_reason": completion.finish_reason,
                    }
                ],
            }
        )

    def completion_of(self, token_ids: list[int], logprobs: list[float]) -> Completion | None:
        """This route's completion of these ids and logprobs (with its policy versions and sampling
        parameters); None where it is not one of its latest."""
        with self.completions_lock:
            return self.completions.get((tuple(token_ids), tuple(logprobs)))

    def run_error(self, error: Exception) -> JSONResponse:
        """424, not 5xx: the policy client already retried, and the harness's SDK retries 5xx again."""
        self.run_errors, self.last_run_error = self.run_errors + 1, error
        return JSONResponse({"error": str(error)}, status_code=424)


_generate_servers: dict[tuple, GenerateServer] = {}
_generate_servers_lock = threading.Lock()


def generate_server(client: PolicyClient) -> GenerateServer:
    with _generate_servers_lock:
        key = (client.base_url, client.api_key, client.max_retries, client.backoff)
        if key not in _generate_servers:
            _generate_servers[key] = GenerateServer(*key)
        return _generate_servers[key]
