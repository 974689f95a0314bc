"""Async client for a vLLM OpenAI server that speaks token ids in and token ids + logprobs out.

Imports httpx only (no torch), so environments can use it anywhere.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import httpx

from core.retrying import async_attempts

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


@dataclass(frozen=True)
class Completion:
    """One sampled continuation: exactly the ids the sampler produced, with their logprobs."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (EOS or stop sequence) or "length"
    text: str


def parse_weight_version(raw: str | int | None) -> int:
    """vLLM reports 'default' until a version is announced; that is policy version 0."""
    try:
        return int(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0


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
    ):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.max_retries = max_retries
        self.backoff = backoff
        # Kept for what talks to the same server on the run's behalf (an LLM judge, a remote environment).
        self.api_key = api_key
        self.has_api_key = bool(api_key)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=timeout,
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
        )

    async def request(self, method: str, path: str, **kwargs) -> httpx.Response:
        """One HTTP call, tried again under core.retrying's policy on connection errors and 5xx/429."""
        try:
            async for attempt in async_attempts(
                retry_on=_transient, first_s=self.backoff, max_s=MAX_BACKOFF_S, tries=self.max_retries + 1,
                what=f"{method} {self.base_url}{path}", logger=log,
            ):  # fmt: skip
                with attempt:
                    return self._checked(await self._http.request(method, path, **kwargs), method, path)
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
        stop: list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        seed: int | None = None,
    ) -> list[Completion]:
        """Samples n continuations of a token-id prompt; never re-tokenizes any text."""
        if temperature == 0.0 and n > 1:
            # vLLM refuses n > 1 with greedy sampling; n identical requests give the same group.
            single = dict(max_tokens=max_tokens, min_tokens=min_tokens, temperature=0.0, top_p=top_p,
                          stop=stop, stop_token_ids=stop_token_ids, seed=seed)  # fmt: skip
            batches = await asyncio.gather(*(self.complete(prompt_ids, n=1, **single) for _ in range(n)))
            return [completion for batch in batches for completion in batch]
        body = {
            "model": self.model,
            "prompt": list(prompt_ids),
            "n": n,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "logprobs": 0,
            "return_token_ids": True,
            # Keep the EOS id in token_ids so a stopped turn ends exactly as the model ended it.
            "include_stop_str_in_output": True,
            "skip_special_tokens": False,
        }
        if min_tokens:
            body["min_tokens"] = min_tokens
        if stop:
            body["stop"] = stop
        if stop_token_ids:
            body["stop_token_ids"] = stop_token_ids
        if seed is not None:
            body["seed"] = seed
        response = await self.request("POST", "/v1/completions", json=body)
        return [self._parse_choice(choice) for choice in response.json()["choices"]]

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
                f"logprobs for {len(token_ids)} tokens expected, got "
                f"{None if logprobs is None else len(logprobs)}"
            )
        finish = choice.get("finish_reason") or "stop"
        return Completion(
            token_ids=list(token_ids),
            logprobs=[float(x) for x in logprobs],
            finish_reason="length" if finish == "length" else ("abort" if finish == "abort" else "stop"),
            text=choice.get("text", ""),
        )

    async def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """The served model's logprob of each of `token_ids` given the ones before it (vLLM's
        prompt_logprobs; the first token, which nothing predicts, gets 0.0): a teacher's score of
        tokens another model sampled, with no sampling and no re-tokenization."""
        body = {"model": self.model, "prompt": list(token_ids), "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}
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
