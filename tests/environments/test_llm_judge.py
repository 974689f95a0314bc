"""The LLM-judge environment: its request and parser, a judge that fails tried again and then failing
its group as `infra` (never a score), the tiny model as a judge that always answers a score, and
the conformance suite against the live server."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import httpx
import pytest

from environments.base import RolloutFailure
from environments.bundled.llm_judge import SCORES, TOPICS, JudgeError, LLMJudge, judge_request, read_score
from environments.testing import EnvironmentConformance
from inference.client import PolicyClient, PolicyServerAuthError

JOKES = [
    template.format(topic=topic)
    for template in (
        "Why did {topic} cross the road? To get to the punchline.",
        "I told {topic} a secret; now everyone knows.",
    )
    for topic in TOPICS
]


def answer(status: int, **body) -> httpx.Response:
    """A judge's HTTP answer as the environment receives it."""
    return httpx.Response(status, request=httpx.Request("POST", "http://judge/v1/chat/completions"), **body)


def chat_answer(content: str) -> httpx.Response:
    return answer(200, json={"choices": [{"message": {"role": "assistant", "content": content}}]})


def closed_port() -> int:
    """A local port nobody listens on: bound, then released."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def conversation(joke: str, topic: str = "cats") -> list[dict]:
    return [{"role": "user", "content": f"Write a short joke about {topic}."}, {"role": "assistant", "content": joke}]


def test_the_judge_is_asked_greedily_for_one_of_ten_scores_and_its_answer_is_the_reward() -> None:
    body = judge_request("policy", "cats", "Why did the cat sit on the laptop?")
    assert body["temperature"] == 0.0 and body["structured_outputs"] == {"choice": SCORES} and SCORES[0] == "1"
    assert (
        "Why did the cat sit on the laptop?" in body["messages"][0]["content"]
        and "cats" in body["messages"][0]["content"]
    )
    assert [read_score(chat_answer(s)) for s in ("1", "10", " 4\n")] == [0.0, 1.0, pytest.approx(1 / 3)]
    for content in ("11", "seven", "", "7/10"):  # a judge that ignored the choice constraint
        with pytest.raises(JudgeError, match="not a score 1..10; the judge must be a vLLM server that honours"):
            read_score(chat_answer(content))
    with pytest.raises(JudgeError, match="answered 500: engine dead"):
        read_score(answer(500, text="engine dead"))
    with pytest.raises(JudgeError, match="answered no chat completion"):
        read_score(answer(200, json={"choices": []}))
    with pytest.raises(PolicyServerAuthError, match="refused the key .401.; export the judge's key"):
        read_score(answer(401, text="unauthorized"))


def test_items_are_jokes_on_topics_and_the_key_comes_from_a_named_variable(tiny_tokenizer, monkeypatch) -> None:
    config = {"seed": 5, "judge_url": "http://judge:8000/", "judge_api_key_env": "JUDGE_KEY"}
    env = LLMJudge(config, client=None, tokenizer=tiny_tokenizer)
    with pytest.raises(ValueError, match="judge_api_key_env: environment variable JUDGE_KEY is not set"):
        asyncio.run(env.setup())
    monkeypatch.setenv("JUDGE_KEY", "sesame")
    asyncio.run(env.setup())
    assert env.judge_endpoint() == ("http://judge:8000", {"Authorization": "Bearer sesame"})
    items = [asyncio.run(env.get_item()) for _ in range(6)]
    assert len({item.id for item in items}) == 6 and all(item.extras["topic"] in TOPICS for item in items)
    assert items[0].prompt == [{"role": "user", "content": f"Write a short joke about {items[0].extras['topic']}."}]
    assert env.reward(items[0], conversation("   ")) == 0.0  # nothing to judge: no call made
    offline = LLMJudge({}, client=None, tokenizer=tiny_tokenizer)  # as `clotho reprocess ... rescore` builds it
    with pytest.raises(ValueError, match="judge_url: unset means the policy server, and there is none here"):
        offline.reward(items[0], conversation("A joke."))


async def test_a_hanging_judge_is_tried_again_then_raises_infra_never_scores(tiny_tokenizer) -> None:
    """A judge that accepts connections and never answers: each call ends at judge_timeout_s, is
    tried INFRA_TRIES times with backoff, and then raises (the group fails as `infra`)."""
    import threading

    from environments.failures import INFRA_TRIES, InfraError, failure_reason

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    accepted: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                accepted.append(listener.accept()[0])  # held open, never answered

    threading.Thread(target=accept, daemon=True).start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    env = LLMJudge(
        {"judge_url": url, "judge_model": "judge", "judge_timeout_s": 0.3}, client=None, tokenizer=tiny_tokenizer
    )
    await env.setup()
    item = await env.get_item()
    try:
        async with httpx.AsyncClient(base_url=url, timeout=0.3) as http:
            with pytest.raises(InfraError, match=f"judge {url} could not be reached") as raised:
                await env.judge(http, item, conversation("A joke."))
        assert failure_reason(raised.value) == "infra" and len(accepted) == INFRA_TRIES
    finally:
        listener.close()
        for connection in accepted:
            connection.close()


@pytest.mark.integration
async def test_the_tiny_judge_scores_every_joke_and_both_paths_agree(policy_server, tiny_model_dir) -> None:
    async with PolicyClient(policy_server.base_url, api_key=policy_server.api_key) as client:
        env = LLMJudge({}, client=client, tokenizer=str(tiny_model_dir))
        await env.setup()
        item = await env.get_item()
        url, headers = env.judge_endpoint()
        synchronous = [env.reward(item, conversation(joke)) for joke in JOKES]  # raises unless all 20 parse
        async with httpx.AsyncClient(base_url=url, headers=headers) as http:
            concurrent = await asyncio.gather(*(env.judge(http, item, conversation(joke)) for joke in JOKES))
    assert len(set(JOKES)) == 20 and len(synchronous) == 20
    assert all(score in {(s - 1) / 9 for s in range(1, 11)} for score in synchronous)
    assert list(concurrent) == synchronous  # greedy: the batch and the single call give one score


@pytest.mark.integration
async def test_an_unreachable_judge_fails_the_group_as_infra_never_a_score(policy_server, tiny_model_dir) -> None:
    judge_url = f"http://127.0.0.1:{closed_port()}"
    async with PolicyClient(policy_server.base_url, api_key=policy_server.api_key) as client:
        env = LLMJudge(
            {"group_size": 2, "max_tokens": 4, "judge_url": judge_url}, client=client, tokenizer=str(tiny_model_dir)
        )
        await env.setup()
        item = await env.get_item()
        result = await env.sample_group(item)
    assert isinstance(result, RolloutFailure) and result.env == "llm_judge" and result.item_id == item.id
    assert result.reason == "infra"
    assert (
        f"JudgeError: judge {judge_url} could not be reached" in result.error and "is judge_url right" in result.error
    )
    with pytest.raises(JudgeError, match=f"judge {judge_url} could not be reached"):
        env.reward(item, conversation("A joke."))


@pytest.mark.integration
class TestLLMJudgeConformance(EnvironmentConformance):
    environment_class = LLMJudge
    config = {"group_size": 3, "max_tokens": 16}  # the judge is the policy server itself
