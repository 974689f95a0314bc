"""The base-model environment: a raw text prefix (no chat template) continued by the model, and
the conformance suite (the rollout mixing it with a chat environment: tests/flows/test_mixed_rollout.py)."""

from __future__ import annotations

import asyncio

import pytest

from environments.bundled.continuation import Continuation
from environments.testing import EnvironmentConformance


def test_the_prompt_is_the_raw_prefix_and_the_reward_reads_the_next_term(tiny_model_dir) -> None:
    env = Continuation({"seed": 2, "terms": 3}, client=None, tokenizer=str(tiny_model_dir))
    asyncio.run(env.setup())
    item = asyncio.run(env.get_item())
    terms = [int(t) for t in item.prompt.rstrip(",").split(", ")]
    assert len(terms) == 3 and item.answer == terms[-1] + (terms[1] - terms[0])
    assert "<|im_start|>" not in env.tokenizer.decode(env.tokenizer.encode(item.prompt, add_special_tokens=False))
    said = lambda text: [{"role": "user", "content": item.prompt}, {"role": "assistant", "content": text}]  # noqa: E731
    assert env.reward(item, said(f" {item.answer}, {item.answer + 1}")) == 1.0
    assert env.reward(item, said(f" {item.answer + 1}")) == 0.0 and env.reward(item, said(" next")) == 0.0


@pytest.mark.integration
class TestContinuationConformance(EnvironmentConformance):
    environment_class = Continuation
    config = {"group_size": 3, "max_tokens": 4}
