"""A remote environment: the Environment API over HTTP to a `clotho env serve` process.

`load_environment_class("http://host:port")` returns a subclass of RemoteEnvironment named as the
served environment, so a URL goes wherever a name or import path does (the rollout flow, a run's
YAML, `clotho env check`). The service samples from the policy server itself (this side passes its
URL, key and tokenizer path when it opens a session), stamps the policy version and records failed
rollouts as data, exactly as sample_group does in process.

What this side adds: a service that cannot be reached, or dies mid-group, is tried again and then
fails that group as a RolloutFailure with reason `infra` naming the URL (the flow keeps the groups
it finished and records the failure; never a score); the
policy server being unreachable on the far side raises here the same exception it would in process,
so the run waits for it or stops.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, ClassVar

import httpx
from pydantic import ConfigDict, ValidationError, model_validator

from core.retrying import async_attempts
from core.scored_group import InvalidGroupError, ScoredGroup
from environments.base import Environment, EnvironmentConfig, EnvironmentLoadError, Item, RolloutFailure
from environments.chat import Messages
from environments.failures import InfraError, async_infra_attempts
from inference.client import PolicyServerAuthError, PolicyServerUnreachable
from storage.layout import check_env_name

log = logging.getLogger(__name__)

PROTOCOL = 1
RUN_ERRORS = {"PolicyServerUnreachable": PolicyServerUnreachable, "PolicyServerAuthError": PolicyServerAuthError}
# A multi-turn group can take minutes; the connection failing is what the short timeout catches.
TIMEOUT = httpx.Timeout(600.0, connect=5.0)
# get_item tries (core.retrying's waits): a service restarting gets about 15 s before the flow gives it up.
GET_ITEM_TRIES, GET_ITEM_FIRST_WAIT_S = 6, 0.5


class RemoteServiceError(RuntimeError):
    """The environment service answered with an error, or could not be reached."""


class RemoteServiceUnreachable(RemoteServiceError, InfraError):
    """The environment service could not be reached or did not answer in time: the machinery, not
    the candidate. A group is tried again (environments.failures.async_infra_attempts), then fails
    with reason `infra`; a reward asked of it raises, never a score."""


def is_remote(name_or_path: str) -> bool:
    return name_or_path.startswith(("http://", "https://"))


def _answer(url: str, call: str, response: httpx.Response) -> dict[str, Any]:
    body = response.json() if response.headers.get("content-type", "").startswith("application/json") else {}
    if response.status_code == 503 and body.get("run_error") in RUN_ERRORS:
        raise RUN_ERRORS[body["run_error"]](body.get("message", ""))
    if response.status_code >= 400:
        raise RemoteServiceError(
            f"environment service {url}: {call} -> {response.status_code}: {body.get('error') or response.text[:300]}"
        )
    return body


def _unreachable(url: str, call: str, error: Exception) -> RemoteServiceUnreachable:
    return RemoteServiceUnreachable(
        f"environment service {url}: {call} failed ({type(error).__name__}: {error}); is it running? "
        f"start it with `clotho env serve NAME --port PORT` in the environment's own virtual environment"
    )


def call_sync(url: str, method: str, path: str, body: dict | None = None) -> dict[str, Any]:
    try:
        response = httpx.request(method, url + path, json=body, timeout=TIMEOUT)
    except httpx.TransportError as error:
        raise _unreachable(url, path, error) from None
    return _answer(url, path, response)


class RemoteConfig(EnvironmentConfig):
    """The served environment's config, validated by the service (POST /config) and kept whole:
    the fields every environment has are read here (group_size for the group checks)."""

    model_config = ConfigDict(extra="allow")
    service_url: ClassVar[str]

    @model_validator(mode="before")
    @classmethod
    def _validated_by_the_service(cls, data: Any) -> Any:
        try:
            response = httpx.post(cls.service_url + "/config", json={"config": dict(data or {})}, timeout=TIMEOUT)
        except httpx.TransportError as error:
            raise EnvironmentLoadError(str(_unreachable(cls.service_url, "/config", error))) from None
        if response.status_code == 422:  # the service's own message, naming the field and the fix
            raise EnvironmentLoadError(f"{response.json()['error']} (served by {cls.service_url})")
        return _answer(cls.service_url, "/config", response)["config"]


class RemoteEnvironment(Environment):
    """The proxy: every call of the Environment API is a call to the service's session."""

    url: ClassVar[str]
    observes: ClassVar[bool] = False  # the served environment learns from stored groups (observe)
    config_class = RemoteConfig

    def __init__(self, config=None, *, client, tokenizer):
        super().__init__(config, client=client, tokenizer=tokenizer)
        self.session: str | None = None
        self._metrics: dict[str, float] = {}
        self._max_sequences: int | None = None  # what the service's environment expects of a group (setup)
        self._expected: str | None = None
        self._http = httpx.AsyncClient(base_url=self.url, timeout=TIMEOUT)

    async def _call(self, path: str, body: dict | None = None) -> dict[str, Any]:
        if self.session is None:
            raise RemoteServiceError(f"environment service {self.url}: call setup() before {path}")
        try:
            response = await self._http.post(f"/sessions/{self.session}{path}", json=body or {})
        except httpx.TransportError as error:
            raise _unreachable(self.url, path, error) from None
        return _answer(self.url, path, response)

    async def setup(self) -> None:
        tokenizer = getattr(self.tokenizer, "name_or_path", None)
        body = {
            # What the service validated (exclude_unset): never a field only this side's clotho has.
            "config": self.config.model_dump(mode="json", exclude_unset=True),
            "server_url": self.client.base_url,
            "api_key": self.client.api_key,
            "tokenizer": tokenizer,
        }
        try:
            response = await self._http.post("/sessions", json=body)
        except httpx.TransportError as error:
            raise _unreachable(self.url, "/sessions", error) from None
        answer = _answer(self.url, "/sessions", response)
        self.session = answer["session"]
        # What the served environment expects of a group (a service from before says nothing: group_size).
        self._max_sequences, self._expected = answer.get("max_group_sequences"), answer.get("group_sequences_expected")

    async def get_item(self) -> Item | None:
        async for attempt in async_attempts(  # a service restarting: wait a little (about 15 s in all)
            retry_on=lambda error: isinstance(error, RemoteServiceError),
            first_s=GET_ITEM_FIRST_WAIT_S,
            max_s=8.0,
            tries=GET_ITEM_TRIES,
            what=f"{self.url}/get_item",
            logger=log,
        ):
            with attempt:
                answer = await self._call("/get_item")
        self._metrics = answer.get("metrics") or {}
        return None if answer["item"] is None else RemoteItem.model_validate(answer["item"])

    async def get_eval_item(self) -> Item | None:
        item = (await self._call("/get_eval_item"))["item"]
        return None if item is None else RemoteItem.model_validate(item)

    async def sample_group(self, item: Item) -> ScoredGroup | RolloutFailure:
        try:
            async for attempt in async_infra_attempts(f"{self.url}/collect"):  # a service restarting: again
                with attempt:
                    answer = await self._call("/collect", {"item": item.model_dump(mode="json")})
        except RemoteServiceError as error:  # the service is gone (reason `infra`): this group failed, the run goes on
            return RolloutFailure.of(self.name, item.id, error)
        self._metrics = answer.get("metrics") or {}
        if "failure" in answer:
            return RolloutFailure.model_validate(answer["failure"])
        try:  # what the service sent is checked here too, against this side's vocabulary
            group = ScoredGroup.model_validate(answer["group"])
            group.check_limits(
                vocab_size=self.vocab_size,
                max_group_size=self.max_group_sequences,
                max_tokens=self.config.max_group_tokens,
                expected=self.group_sequences_expected(),
            )
        except (InvalidGroupError, ValidationError) as error:
            return RolloutFailure.of(self.name, item.id, error)
        return group

    @property
    def max_group_sequences(self) -> int:
        return int(self._max_sequences or super().max_group_sequences)

    def group_sequences_expected(self) -> str:
        return self._expected or super().group_sequences_expected()

    async def collect_trajectories(self, item: Item) -> ScoredGroup:
        result = await self.sample_group(item)
        if isinstance(result, RolloutFailure):
            raise RemoteServiceError(result.error)
        return result

    async def observe(self, group: ScoredGroup) -> None:
        if not self.observes:
            return
        try:
            self._metrics = (await self._call("/observe", {"group": group.model_dump(mode="json")})).get(
                "metrics"
            ) or {}
        except RemoteServiceError:
            pass  # the service is gone: its next get_item says so, and the flow lets it go

    def metrics(self) -> dict[str, float]:
        return self._metrics  # as the service reported with its last answer

    def reward(self, item: Item, messages: Messages) -> float:
        return call_sync(
            self.url,
            "POST",
            f"/sessions/{self.session}/reward",
            {"item": item.model_dump(mode="json"), "messages": messages},
        )["reward"]

    def gold_completion(self, item: Item) -> str | None:
        return call_sync(self.url, "POST", f"/sessions/{self.session}/gold", {"item": item.model_dump(mode="json")})[
            "completion"
        ]

    async def evaluate(self, num_items: int = 16) -> dict[str, float]:
        return (await self._call("/evaluate", {"num_items": num_items}))["report"]

    async def aclose(self) -> None:
        if self.session is not None:
            try:
                await self._http.delete(f"/sessions/{self.session}")
            except httpx.TransportError:
                pass  # the service is gone, and its sessions with it
        await self._http.aclose()


class RemoteItem(Item):
    """An item as the service made it: the served environment's own fields kept for the way back."""

    model_config = ConfigDict(extra="allow")


@functools.lru_cache(maxsize=64)
def remote_environment_class(url: str) -> type[RemoteEnvironment]:
    """The RemoteEnvironment subclass of the service at `url`, named as the environment it serves."""
    url = url.rstrip("/")
    try:
        info = call_sync(url, "GET", "/info")
    except RemoteServiceError as error:
        raise EnvironmentLoadError(str(error)) from None
    if info.get("protocol") != PROTOCOL:
        raise EnvironmentLoadError(
            f"environment service {url} speaks protocol {info.get('protocol')}, this clotho {PROTOCOL}; "
            "run the same clotho version on both sides"
        )
    try:
        check_env_name(info["name"])
    except ValueError as error:
        raise EnvironmentLoadError(f"environment service {url}: its name: {error}") from None
    config_class = type(f"{info['name']}RemoteConfig", (RemoteConfig,), {"service_url": url})
    return type(
        f"Remote_{info['name']}",
        (RemoteEnvironment,),
        {
            "name": info["name"],
            "url": url,
            "config_class": config_class,
            "served_import_path": info["import_path"],
            "observes": bool(info.get("observes")),
            "__module__": __name__,
        },
    )
