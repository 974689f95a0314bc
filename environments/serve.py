"""An environment as its own service: `clotho env serve NAME` puts any environment behind HTTP.

This is how environments with conflicting dependencies live side by side: each runs in its own
process and virtual environment (or machine), and the rollout flow and `clotho env check` use it by
URL exactly like a local one (environments/remote.py is the other end).

The API, JSON in and out, groups in ScoredGroup's own serialization (`PROTOCOL` names its version):

    GET    /info                          name, import path, protocol, config JSON schema, observes
    POST   /config         {config}       the config validated, defaults filled; 422 names the field
    POST   /sessions       {config, server_url, api_key, tokenizer}  -> {session}; runs setup()
    POST   /sessions/{id}/get_item        {item | null, metrics}  (get_eval_item: /get_eval_item)
    POST   /sessions/{id}/collect {item}  {group or failure, metrics}: sample_group, failures as data
    POST   /sessions/{id}/observe {group}  {metrics}: a stored group, for the curriculum
    POST   /sessions/{id}/reward {item, messages}   {reward}
    POST   /sessions/{id}/gold {item}     {completion | null}
    POST   /sessions/{id}/evaluate {num_items}      the evaluation report
    DELETE /sessions/{id}

A session is one environment instance sampling from the policy server its caller names. An error
that says the run is broken (the policy server unreachable or refusing the key) answers 503 with its
kind, so the caller raises the same exception a local environment would; a collect whose caller
hangs up is cancelled, like a cancelled local task.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Any

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from core.scored_group import ScoredGroup
from environments.base import Environment, Item, RolloutFailure
from environments.failures import fetch_failed
from environments.loading import EnvironmentLoadError, load_config, load_environment_class, resolve_import_path
from inference.client import PolicyClient, PolicyServerAuthError, PolicyServerUnreachable

log = logging.getLogger(__name__)

PROTOCOL = 1
# How often a running collect looks whether its caller is still there.
DISCONNECT_POLL_S = 0.2


class EnvironmentService:
    """The sessions of one environment class, and the handlers of its routes."""

    def __init__(self, name_or_path: str):
        self.import_path = resolve_import_path(name_or_path)
        self.env_class = load_environment_class(name_or_path)
        self.sessions: dict[str, Environment] = {}

    def env(self, request: Request) -> Environment:
        session = request.path_params["session"]
        if session not in self.sessions:
            raise KeyError(f"no session {session!r} (the service restarted?); open a new one with POST /sessions")
        return self.sessions[session]

    def item(self, env: Environment, body: dict[str, Any]) -> Item:
        return env.item_class.model_validate(body["item"])

    async def info(self, request: Request) -> JSONResponse:
        return JSONResponse(
            {
                "name": self.env_class.name,
                "import_path": self.import_path,
                "protocol": PROTOCOL,
                "config_schema": self.env_class.config_class.model_json_schema(),
                # Whether stored groups should come back to /observe (most environments learn nothing).
                "observes": self.env_class.observe is not Environment.observe,
            }
        )

    async def config(self, request: Request) -> JSONResponse:
        body = await request.json()
        return JSONResponse({"config": load_config(self.env_class, body.get("config")).model_dump(mode="json")})

    async def open_session(self, request: Request) -> JSONResponse:
        body = await request.json()
        client = PolicyClient(body["server_url"], api_key=body.get("api_key"))
        env = self.env_class(
            load_config(self.env_class, body.get("config")), client=client, tokenizer=body["tokenizer"]
        )
        try:
            await env.setup()
        except Exception as error:
            if (message := fetch_failed(f"environment {env.name} setup", error)) is not None:
                raise EnvironmentLoadError(message) from error
            raise
        session = secrets.token_hex(8)
        self.sessions[session] = env
        return JSONResponse(
            {
                "session": session,
                "name": env.name,
                "max_group_sequences": env.max_group_sequences,
                "group_sequences_expected": env.group_sequences_expected(),
            }
        )

    async def close_session(self, request: Request) -> JSONResponse:
        env = self.sessions.pop(request.path_params["session"], None)
        if env is not None:
            await env.client.aclose()
        return JSONResponse({"closed": env is not None})

    async def get_item(self, request: Request) -> JSONResponse:
        env = self.env(request)
        item = await env.get_item()
        return JSONResponse({"item": None if item is None else item.model_dump(mode="json"), "metrics": env.metrics()})

    async def get_eval_item(self, request: Request) -> JSONResponse:
        item = await self.env(request).get_eval_item()
        return JSONResponse({"item": None if item is None else item.model_dump(mode="json")})

    async def collect(self, request: Request) -> JSONResponse:
        env = self.env(request)
        work = asyncio.ensure_future(env.sample_group(self.item(env, await request.json())))
        while not work.done():  # a caller that hung up (a cancelled task) cancels the work
            await asyncio.wait([work], timeout=DISCONNECT_POLL_S)
            if not work.done() and await request.is_disconnected():
                work.cancel()
                return JSONResponse({"cancelled": True}, status_code=499)
        result, metrics = work.result(), env.metrics()
        if isinstance(result, RolloutFailure):
            return JSONResponse({"failure": result.model_dump(mode="json"), "metrics": metrics})
        return JSONResponse({"group": result.model_dump(mode="json"), "metrics": metrics})

    async def observe(self, request: Request) -> JSONResponse:
        env = self.env(request)
        await env.observe(ScoredGroup.model_validate((await request.json())["group"]))
        return JSONResponse({"metrics": env.metrics()})

    async def reward(self, request: Request) -> JSONResponse:
        env, body = self.env(request), await request.json()
        return JSONResponse({"reward": env.reward(self.item(env, body), body["messages"])})

    async def gold(self, request: Request) -> JSONResponse:
        env = self.env(request)
        return JSONResponse({"completion": env.gold_completion(self.item(env, await request.json()))})

    async def evaluate(self, request: Request) -> JSONResponse:
        body = await request.json()
        return JSONResponse({"report": await self.env(request).evaluate(int(body.get("num_items", 16)))})


def _errors(handler):
    """Errors as JSON the other end turns back into the exception a local environment raises."""

    async def wrapped(request: Request) -> JSONResponse:
        try:
            return await handler(request)
        except (PolicyServerUnreachable, PolicyServerAuthError) as error:
            return JSONResponse({"run_error": type(error).__name__, "message": str(error)}, status_code=503)
        except (EnvironmentLoadError, ValidationError) as error:
            return JSONResponse({"error": str(error)}, status_code=422)
        except KeyError as error:
            return JSONResponse({"error": str(error.args[0]) if error.args else "missing field"}, status_code=404)
        except Exception as error:  # an environment bug in get_item, reward ...: said, not hidden
            log.exception("%s %s failed", request.method, request.url.path)
            return JSONResponse({"error": f"{type(error).__name__}: {error}"}, status_code=500)

    return wrapped


def create_app(name_or_path: str) -> Starlette:
    service = EnvironmentService(name_or_path)
    session = "/sessions/{session}"
    routes = [
        Route("/info", _errors(service.info), methods=["GET"]),
        Route("/config", _errors(service.config), methods=["POST"]),
        Route("/sessions", _errors(service.open_session), methods=["POST"]),
        Route(session, _errors(service.close_session), methods=["DELETE"]),
        Route(f"{session}/get_item", _errors(service.get_item), methods=["POST"]),
        Route(f"{session}/get_eval_item", _errors(service.get_eval_item), methods=["POST"]),
        Route(f"{session}/collect", _errors(service.collect), methods=["POST"]),
        Route(f"{session}/observe", _errors(service.observe), methods=["POST"]),
        Route(f"{session}/reward", _errors(service.reward), methods=["POST"]),
        Route(f"{session}/gold", _errors(service.gold), methods=["POST"]),
        Route(f"{session}/evaluate", _errors(service.evaluate), methods=["POST"]),
    ]
    return Starlette(routes=routes)
