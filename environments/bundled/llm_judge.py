"""LLM-as-judge reward: the policy writes a joke on a topic, a judge model rates how funny it is, 1-10.

The judge is any OpenAI-compatible chat endpoint (by default the policy server itself). Its answer
is constrained with vLLM structured outputs to one of "1".."10", so even a tiny judge returns a
valid score, and it is greedy, so a joke always gets the same one; reward = (score - 1) / 9.

Two paths share one request and one parser, so they cannot disagree: collect_trajectories judges a
group's jokes concurrently (async), `reward` judges one synchronously (the conformance check and
`clotho reprocess ... rescore` call it). A judge that cannot score a joke (unreachable, past
judge_timeout_s, or answering outside 1..10) is the machinery failing, not the joke: the call is
tried again with backoff (environments.failures.infra_attempts), and when the tries run out the
whole group fails with reason `infra`, never scored, never a joke dropped from it (dropping the
slow ones would bias the group). A judge refusing the key stops the run, as the policy server
does: every request would fail the same way.
"""

from __future__ import annotations

import os
import random
from contextlib import contextmanager
from typing import Any

import httpx
from pydantic import Field

from core.scored_group import ScoredGroup, ScoredSequence
from environments.base import Environment, EnvironmentConfig, Item, final_answer, prompt_messages
from environments.chat import Messages
from environments.failures import InfraError, async_infra_attempts, infra_attempts
from inference.client import Completion, PolicyServerAuthError

TOPICS = (
    "cats",
    "coffee",
    "computers",
    "the weather",
    "Mondays",
    "airports",
    "dentists",
    "pirates",
    "socks",
    "the moon",
)
SCORES = [str(score) for score in range(1, 11)]
CONNECT_RETRIES = 2  # a judge restarting refuses connections for a moment


class JudgeError(InfraError):
    """The judge could not score a joke: tried again, then the group fails as `infra`."""


class JudgeConfig(EnvironmentConfig):
    max_tokens: int = Field(default=64, ge=1, description="Most tokens of a joke.")
    judge_url: str | None = Field(
        default=None, description="Base URL of the judge's OpenAI-compatible (vLLM) server; None: the policy server."
    )
    judge_model: str | None = Field(
        default=None, description="Model name to ask; None: the one the judge serves (/v1/models)."
    )
    judge_api_key_env: str | None = Field(
        default=None,
        description="Name of the environment variable holding the judge's API key (never the key itself); "
        "None: no key, or the policy server's key when judge_url is None.",
    )
    judge_timeout_s: float = Field(
        default=120.0, gt=0, description="Seconds one judge call may take before it is tried again."
    )


def judge_request(model: str, topic: str, joke: str) -> dict[str, Any]:
    """The chat completion asking the judge for a score: greedy, constrained to "1".."10"."""
    question = (
        f"Here is a joke about {topic}:\n\n{joke}\n\n"
        "How funny is this joke, on a scale from 1 to 10? Answer with the number only."
    )
    return {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "temperature": 0.0,
        "max_tokens": 4,
        "structured_outputs": {"choice": SCORES},
    }


def checked(response: httpx.Response) -> dict[str, Any]:
    if response.status_code in (401, 403):
        raise PolicyServerAuthError(
            f"judge {response.request.url} refused the key ({response.status_code}); export the judge's key in "
            "the variable named by judge_api_key_env (or leave judge_url unset to judge on the policy server)"
        )
    if response.status_code >= 400:
        raise JudgeError(f"judge {response.request.url} answered {response.status_code}: {response.text[:300]}")
    try:
        return response.json()
    except ValueError:
        raise JudgeError(f"judge {response.request.url} answered no JSON: {response.text[:300]!r}") from None


def read_score(response: httpx.Response) -> float:
    """The reward in [0, 1] from the judge's answer."""
    answer = checked(response)
    try:
        content = str(answer["choices"][0]["message"]["content"]).strip()
    except (KeyError, IndexError, TypeError):
        raise JudgeError(f"judge {response.request.url} answered no chat completion: {str(answer)[:300]}") from None
    if content not in SCORES:
        raise JudgeError(
            f"judge {response.request.url} answered {content[:100]!r}, not a score 1..10; the judge must be a vLLM "
            "server that honours the request field structured_outputs: {choice: [...]}"
        )
    return (int(content) - 1) / 9


def served_model_id(response: httpx.Response) -> str:
    return checked(response)["data"][0]["id"]


@contextmanager
def judge_errors(url: str):
    """Transport failures as JudgeError, naming the judge and the field to fix."""
    try:
        yield
    except httpx.HTTPError as error:
        raise JudgeError(
            f"judge {url} could not be reached ({error!r}); is judge_url right and the server up?"
        ) from None


class LLMJudge(Environment):
    """'Write a short joke about cats.' -> (judge's 1-10 score - 1) / 9; no gold answer."""

    name = "llm_judge"
    config_class = JudgeConfig
    _served_model: str | None = None  # the judge's model, asked once when judge_model is None

    async def setup(self) -> None:
        self.judge_endpoint()  # a missing key variable fails here, before anything samples

    def new_item(self, rng: random.Random, index: int) -> dict[str, Any]:
        topic = rng.choice(TOPICS)
        return dict(prompt=[{"role": "user", "content": f"Write a short joke about {topic}."}], extras={"topic": topic})

    def judge_endpoint(self) -> tuple[str, dict[str, str]]:
        """The judge's base URL and headers: the configured judge, or the policy server and its key."""
        name = self.config.judge_api_key_env
        key = os.environ.get(name) if name else None
        if name and not key:
            raise ValueError(
                f"judge_api_key_env: environment variable {name} is not set; export the judge's API key in it"
            )
        url = self.config.judge_url
        if url is None:
            if self.client is None:
                raise ValueError(
                    "judge_url: unset means the policy server, and there is none here (offline rescoring); set judge_url"
                )
            url, key = self.client.base_url, key or self.client.api_key
        return url.rstrip("/"), {"Authorization": f"Bearer {key}"} if key else {}

    def judge_model(self) -> str | None:
        return self.config.judge_model or self._served_model

    def reward(self, item: Item, messages: Messages) -> float:
        """One synchronous judge call (0.0 for an empty joke, nothing to judge); raises JudgeError."""
        joke = final_answer(messages)
        if not joke.strip():
            return 0.0
        url, headers = self.judge_endpoint()
        transport = httpx.HTTPTransport(retries=CONNECT_RETRIES)
        for attempt in infra_attempts(f"judge {url}"):
            with attempt, judge_errors(url):
                with httpx.Client(
                    base_url=url, headers=headers, timeout=self.config.judge_timeout_s, transport=transport
                ) as http:
                    if self.judge_model() is None:
                        self._served_model = served_model_id(http.get("/v1/models"))
                    body = judge_request(self.judge_model(), item.extras["topic"], joke)
                    return read_score(http.post("/v1/chat/completions", json=body))
        raise AssertionError("infra_attempts raises its last error")

    async def judge(self, http: httpx.AsyncClient, item: Item, messages: Messages) -> float:
        """`reward`, asynchronously: the same request, the same parser."""
        joke = final_answer(messages)
        if not joke.strip():
            return 0.0
        async for attempt in async_infra_attempts(f"judge {http.base_url}"):
            with attempt, judge_errors(str(http.base_url)):
                if self.judge_model() is None:
                    self._served_model = served_model_id(await http.get("/v1/models"))
                body = judge_request(self.judge_model(), item.extras["topic"], joke)
                return read_score(await http.post("/v1/chat/completions", json=body))
        raise AssertionError("async_infra_attempts raises its last error")

    async def collect_trajectories(self, item: Item) -> ScoredGroup:
        prompt_ids, completions = await self.sample_chat(prompt_messages(item))
        url, headers = self.judge_endpoint()
        transport = httpx.AsyncHTTPTransport(retries=CONNECT_RETRIES)
        # One connection pool per group: a client outlives no event loop it was made in.
        async with httpx.AsyncClient(
            base_url=url, headers=headers, timeout=self.config.judge_timeout_s, transport=transport
        ) as http:

            async def judged(completion: Completion) -> ScoredSequence:
                joke = {"role": "assistant", "content": self.renderer.decode(completion.token_ids)}
                messages = prompt_messages(item) + [joke]
                score = await self.judge(http, item, messages)
                return ScoredSequence.from_completion(prompt_ids, completion, score=score, messages=messages)

            sequences, errors = await self.gather_sequences([judged(completion) for completion in completions])
        return self.make_group(item, sequences, errors=errors)
