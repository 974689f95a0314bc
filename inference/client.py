"""Async client for a vLLM OpenAI server that speaks token ids in and token ids + logprobs out.

Imports httpx only (no torch), so environments can use it anywhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import httpx

from core.retrying import async_attempts
from core.sampling import LOGPROBS_MODES, LogprobsMode, Sampling

log = logging.getLogger(__name__)

# Transient failures worth a retry: the server restarting, a reload pause, overload.
RETRY_STATUS = {408, 429, 500, 502, 503, 504}


class PolicyServerUnreachable(ConnectionError):
    """The policy server could not be reached after all retries."""


class PolicyServerError(RuntimeError):
    """The policy server answered with an error that a retry will not fix."""


class PolicyServerAuthError(PolicyServerError):
    """The policy server refused the API key (401/403): every request would fail the same way,
    so the run stops instead of recording each group as a failure."""


class BusyServer(PolicyServerError):
    """A 5xx or 429 answer, which may pass if the request is tried again."""


MAX_BACKOFF_S = 30.0


def _transient(error: BaseException) -> bool:
    return isinstance(error, (httpx.TransportError, httpx.TimeoutException, BusyServer))


def _finish_reason(choice: dict) -> str:
    finish = choice.get("finish_reason") or "stop"
    return finish if finish in ("length", "abort") else "stop"


@dataclass(frozen=True)
class Completion:
    """One sampled continuation: exactly the ids the sampler produced, with their logprobs, the
    policy version of the weights that sampled each token (None from a server that does not say) and
    the sampling parameters the request sent, with what the server's logprobs are of."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (EOS or stop sequence) or "length"
    text: str = ""
    versions: list[int] | None = None
    sampling: Sampling | None = None

    @property
    def policy_versions(self) -> tuple[int, int] | None:
        """(first, last) policy version that sampled its tokens: two apart when a reload swapped the
        weights while it was generating (in-flight reload)."""
        return (min(self.versions), max(self.versions)) if self.versions else None


# The weight version tag a clotho reload gives vLLM while it swaps (inference.reload): the engine
# stamps every token it samples with its tag, so the tag changes where the weights change, but
# parity is not checked yet. "7 unverified, announced 6": tokens sampled now are version 7's, and
# the version announced to the run (what admission and the watcher read) is still 6.
UNVERIFIED = " unverified, announced "


def version_tag(loaded: int, announced: int | None = None) -> str:
    """The engine's tag for weights `loaded`, while `announced` (another version) is still the one
    the run is told it serves."""
    return str(loaded) if announced is None or announced == loaded else f"{loaded}{UNVERIFIED}{announced}"


def parse_weight_version(raw: str | int | None) -> int:
    """The announced policy version in a weight version tag. vLLM reports 'default' until a
    version is announced; that is policy version 0."""
    if isinstance(raw, str) and UNVERIFIED in raw:
        raw = raw.partition(UNVERIFIED)[2]
    try:
        return int(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0


def loaded_version(raw: str | int | None) -> int:
    """The policy version whose weights sampled tokens tagged `raw` (see version_tag)."""
    return parse_weight_version(raw.partition(UNVERIFIED)[0] if isinstance(raw, str) else raw)


def token_versions(spans: list[dict] | None, count: int) -> list[int] | None:
    """Per-token policy versions from vLLM's weight_versions spans ({version, start, end} over the
    output tokens), or None when the server gave none."""
    if not spans:
        return None
    versions = [0] * count
    for span in spans:
        versions[span["start"] : span["end"]] = [loaded_version(span["version"])] * (span["end"] - span["start"])
    return versions


# The completions sampled while a group is collected (recording_completions); None for one sampled
# where this process cannot see it.
_recorded: contextvars.ContextVar[list[Completion | None] | None] = contextvars.ContextVar(
    "clotho_completions", default=None
)


@contextlib.contextmanager
def recording_completions() -> Iterator[list[Completion | None]]:
    """Collects every completion this context (and the tasks it starts) samples through a
    PolicyClient: what Environment.sample_group stamps a group's policy versions and sampling
    parameters from, whatever its environment did with the tokens."""
    recorded: list[Completion | None] = []
    token = _recorded.set(recorded)
    try:
        yield recorded
    finally:
        _recorded.reset(token)


def record_completions(completions: Iterable[Completion | None]) -> None:
    """Adds completions to the group being recorded (recording_completions), for ones sampled where
    the context does not reach: an adapter's own route answering a harness in another thread or
    process (environments.adapters.verifiers). None for a completion this process never saw."""
    recorded = _recorded.get()
    if recorded is not None:
        recorded.extend(completions)


def served_model(base_url: str, api_key: str | None = None) -> str:
    """PolicyClient.served_model from synchronous code (a CLI before its flow starts, a fixture)."""

    async def ask() -> str:
        async with PolicyClient(base_url, api_key=api_key, timeout=10.0, max_retries=1) as client:
            return await client.served_model()

    return asyncio.run(ask())


class PolicyClient:
    """Completions in tokens, with retries on transient errors and the served weight version."""

    def __init__(
        self,
        base_url: str,
        *,
        model: str = "policy",
        api_key: str | None = None,
        timeout: float = 300.0,
        max_retries: int = 5,
        backoff: float = 0.5,
        priority: int = 0,
    ):
        """`priority`: of every request that does not name one (complete, prompt_logprobs): below 0
        (inference.server.URGENT) goes before the requests waiting, on a server with priority
        scheduling only (what the pipeline's evaluator asks, so the curve is not queued behind rollouts)."""
        self.base_url = base_url.rstrip("/")
        self.priority = priority
        self.model = model
        self.max_retries = max_retries
        self.backoff = backoff
        # Kept for what talks to the same server on the run's behalf (an LLM judge, a remote environment).
        self.api_key = api_key
        self.has_api_key = bool(api_key)
        # Whether the server has vLLM's /inference/v1/generate (None: not asked yet).
        self.generate_route: bool | None = None
        self._logprobs_mode: asyncio.Future[LogprobsMode | None] | None = None
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=timeout,
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
        )

    async def request(self, method: str, path: str, *, answered: tuple[int, ...] = (), **kwargs) -> httpx.Response:
        """One HTTP call, tried again under core.retrying's policy on connection errors and 5xx/429.
        A status in `answered` is returned as it is, for the caller to read."""
        try:
            async for attempt in async_attempts(
                retry_on=_transient,
                first_s=self.backoff,
                max_s=MAX_BACKOFF_S,
                tries=self.max_retries + 1,
                what=f"{method} {self.base_url}{path}",
                logger=log,
            ):
                with attempt:
                    response = await self._http.request(method, path, **kwargs)
                    return response if response.status_code in answered else self._checked(response, method, path)
        except (httpx.TransportError, httpx.TimeoutException) as error:
            raise PolicyServerUnreachable(
                f"policy server {self.base_url} unreachable after {self.max_retries + 1} tries "
                f"({error!r}); is it running? start one with `clotho serve --model PATH`"
            ) from None
        raise AssertionError("unreachable: the policy returns or raises")

    def _checked(self, response: httpx.Response, method: str, path: str) -> httpx.Response:
        if response.status_code < 400:
            return response
        if response.status_code in (401, 403):
            given = "the API key given" if self.has_api_key else "no API key"
            raise PolicyServerAuthError(
                f"policy server {self.base_url} refused {given} ({response.status_code} on "
                f"{method} {path}); pass the key the server was started with: --api-key KEY "
                "or CLOTHO_API_KEY (a deployment: the Prefect Secret block named by api_key_secret)"
            )
        if response.status_code not in RETRY_STATUS:
            raise PolicyServerError(f"{method} {self.base_url}{path} -> {response.status_code}: {response.text[:500]}")
        raise BusyServer(f"{response.status_code}: {response.text[:200]}")

    async def complete(
        self,
        prompt_ids: list[int],
        *,
        n: int = 1,
        max_tokens: int = 64,
        min_tokens: int = 0,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int | None = None,
        min_p: float = 0.0,
        stop: list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        seed: int | None = None,
        priority: int = 0,
    ) -> list[Completion]:
        """Samples n continuations of a token-id prompt; never re-tokenizes any text. Each
        completion says how it was drawn (Completion.sampling: these parameters and the server's
        logprobs mode). A priority below 0 is scheduled before the requests waiting (a server with
        priority scheduling only: inference.server.URGENT)."""
        if temperature == 0.0 and n > 1:
            # vLLM refuses n > 1 with greedy sampling; n identical requests give the same group.
            single = dict(
                max_tokens=max_tokens,
                min_tokens=min_tokens,
                temperature=0.0,
                top_p=top_p,
                top_k=top_k,
                min_p=min_p,
                stop=stop,
                stop_token_ids=stop_token_ids,
                seed=seed,
                priority=priority,
            )
            batches = await asyncio.gather(*(self.complete(prompt_ids, n=1, **single) for _ in range(n)))
            return [completion for batch in batches for completion in batch]
        mode = self._asked_logprobs_mode()  # read beside the first request, not before it
        sampling = {
            "n": n,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "logprobs": 0,
            # Keep the EOS id in token_ids so a stopped turn ends exactly as the model ended it.
            "include_stop_str_in_output": True,
            "skip_special_tokens": False,
        }
        if min_tokens:
            sampling["min_tokens"] = min_tokens
        if stop:
            sampling["stop"] = stop
        if stop_token_ids:
            sampling["stop_token_ids"] = stop_token_ids
        if seed is not None:
            sampling["seed"] = seed
        if top_k is not None:
            sampling["top_k"] = top_k
        if min_p:
            sampling["min_p"] = min_p
        priority = priority or self.priority
        scheduling = {"priority": priority} if priority else {}
        completions = (
            await self._generate(list(prompt_ids), sampling, scheduling) if self.generate_route is not False else None
        )
        if completions is None:
            body = {"model": self.model, "prompt": list(prompt_ids), "return_token_ids": True, **sampling, **scheduling}
            response = await self.request("POST", "/v1/completions", json=body)
            completions = [self._parse_choice(choice) for choice in response.json()["choices"]]
        drawn = Sampling(
            temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, logprobs_mode=await asyncio.shield(mode)
        )
        completions = [dataclasses.replace(completion, sampling=drawn) for completion in completions]
        record_completions(completions)
        return completions

    async def logprobs_mode(self) -> LogprobsMode | None:
        """What the server's logprobs are (vLLM's --logprobs-mode), read once from its /server_info
        (VLLM_SERVER_DEV_MODE, which every server clotho starts has); None from a server that does
        not say."""
        return await asyncio.shield(self._asked_logprobs_mode())

    def _asked_logprobs_mode(self) -> asyncio.Future[LogprobsMode | None]:
        asked = self._logprobs_mode
        if asked is None or (asked.done() and asked.exception() is not None):  # an error is asked again
            self._logprobs_mode = asyncio.ensure_future(self._read_logprobs_mode())
            # Its error reaches whoever awaits it; one whose request failed first never does.
            self._logprobs_mode.add_done_callback(lambda future: future.cancelled() or future.exception())
        return self._logprobs_mode

    async def _read_logprobs_mode(self) -> LogprobsMode | None:
        response = await self.request("GET", "/server_info", params={"config_format": "json"}, answered=(404, 405))
        if response.status_code != 200:
            log.info("%s has no /server_info (%s): its logprobs mode is unknown", self.base_url, response.status_code)
            return None
        try:
            mode = response.json()["vllm_config"]["model_config"]["logprobs_mode"]
        except (KeyError, TypeError, ValueError):
            return None
        return mode if mode in LOGPROBS_MODES else None

    async def _generate(self, prompt_ids: list[int], sampling: dict, scheduling: dict) -> list[Completion] | None:
        """vLLM's token-in-token-out route, whose answer says which weight version sampled each
        token (the OpenAI routes do not); None when the server lacks it (vLLM without
        --enable-scale-out, or another server), after which this client uses /v1/completions."""
        body = {"model": self.model, "token_ids": prompt_ids, "sampling_params": sampling, **scheduling}
        response = await self.request("POST", "/inference/v1/generate", json=body, answered=(403, 404, 405))
        if response.status_code in (404, 405) or (response.status_code == 403 and "scale-out" in response.text.lower()):
            if self.generate_route is None:
                log.info(
                    "%s has no /inference/v1/generate (%s); sampling through /v1/completions, without "
                    "per-token weight versions",
                    self.base_url,
                    response.status_code,
                )
            self.generate_route = False
            return None
        self.generate_route = True
        choices = sorted(
            self._checked(response, "POST", "/inference/v1/generate").json()["choices"], key=lambda c: c["index"]
        )
        return [self._parse_generated(choice) for choice in choices]

    @staticmethod
    def _parse_generated(choice: dict) -> Completion:
        token_ids = choice.get("token_ids") or []
        content = (choice.get("logprobs") or {}).get("content") or []
        if len(content) != len(token_ids):
            raise PolicyServerError(f"logprobs for {len(token_ids)} tokens expected, got {len(content)}")
        return Completion(
            token_ids=list(token_ids),
            logprobs=[float(entry["logprob"]) for entry in content],
            finish_reason=_finish_reason(choice),
            text=choice.get("text") or "",
            versions=token_versions(choice.get("weight_versions"), len(token_ids)),
        )

    @staticmethod
    def _parse_choice(choice: dict) -> Completion:
        token_ids = choice.get("token_ids")
        if token_ids is None:
            raise PolicyServerError(
                "the server returned no token_ids; clotho needs a vLLM server that supports "
                "'return_token_ids' (vLLM >= 0.10)"
            )
        logprobs = choice["logprobs"]["token_logprobs"] if choice.get("logprobs") else None
        if logprobs is None or len(logprobs) != len(token_ids):
            raise PolicyServerError(
                f"logprobs for {len(token_ids)} tokens expected, got {None if logprobs is None else len(logprobs)}"
            )
        return Completion(
            token_ids=list(token_ids),
            logprobs=[float(x) for x in logprobs],
            finish_reason=_finish_reason(choice),
            text=choice.get("text", ""),
        )

    async def prompt_logprobs(self, token_ids: list[int], *, priority: int = 0) -> list[float]:
        """The served model's logprob of each of `token_ids` given the ones before it (vLLM's
        prompt_logprobs; the first token, which nothing predicts, gets 0.0): a teacher's score of
        tokens another model sampled, with no sampling and no re-tokenization. `priority` as in
        complete()."""
        body = {
            "model": self.model,
            "prompt": list(token_ids),
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": 0,
        }
        priority = priority or self.priority
        if priority:
            body["priority"] = priority
        response = await self.request("POST", "/v1/completions", json=body)
        scored = response.json()["choices"][0].get("prompt_logprobs")
        if scored is None or len(scored) != len(token_ids):
            raise PolicyServerError(
                f"prompt_logprobs for {len(token_ids)} tokens expected from {self.base_url}, got "
                f"{None if scored is None else len(scored)}; a teacher must be a vLLM server (prompt_logprobs)"
            )
        values = [0.0]
        for token, entry in zip(token_ids[1:], scored[1:], strict=True):
            if not entry or str(token) not in entry:
                raise PolicyServerError(f"prompt_logprobs from {self.base_url} lack token {token}")
            values.append(float(entry[str(token)]["logprob"]))
        return values

    async def served_model(self) -> str:
        """The model path or id the server serves (its /v1/models 'root'): the tokenizer to use."""
        response = await self.request("GET", "/v1/models")
        return response.json()["data"][0]["root"]

    async def max_model_len(self) -> int | None:
        """The served model's context length in tokens (prompt and completion), as vLLM's /v1/models
        gives it; None from a server that does not say."""
        response = await self.request("GET", "/v1/models")
        value = response.json()["data"][0].get("max_model_len")
        return int(value) if value else None

    async def weight_version(self) -> int:
        """The policy version of the served weights (0 until a reload announced one)."""
        response = await self.request("GET", "/weight_info")
        return parse_weight_version(response.json().get("weight_version"))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> PolicyClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
