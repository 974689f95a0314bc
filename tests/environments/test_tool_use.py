"""The tool-use environment: its tools, malformed calls as observations, tool outputs masked out,
and the conformance suite against the live tiny server."""

from __future__ import annotations

import asyncio

import pytest

from environments.bundled.tool_use import PRICES, ToolUse, calculate, run_tool
from environments.testing import EnvironmentConformance
from inference.client import Completion


def test_tools_answer_and_malformed_calls_are_observations() -> None:
    assert run_tool("I need a price.\nCALL lookup(apple)") == "apple: 3"
    assert run_tool("CALL calc(3 * 4 + 2 * (5 - 1))") == "20"
    assert run_tool("CALL calc(7 / 2)") == "3.5"
    assert run_tool("no call here") is None
    assert run_tool("CALL lookup(caviar)").startswith("Tool error: no item 'caviar'; items: apple")
    assert run_tool("CALL search(news)") == "Tool error: unknown tool 'search'; tools: lookup(item), calc(expression)."
    assert run_tool("CALL calc(2 +)") == "Tool error: calc could not parse '2 +'."
    assert run_tool("CALL calc(__import__('os'))").startswith("Tool error: calc takes numbers and + - * / ( )")
    assert run_tool("CALL calc(1/0)") == "Tool error: calc: division by zero."
    assert run_tool("CALL lookup apple").startswith("Tool error: write a call as CALL tool(argument)")
    with pytest.raises(ValueError):
        calculate("2 ** 100")


def test_tool_outputs_are_masked_and_the_reward_reads_the_final_answer(tiny_model_dir) -> None:
    env = ToolUse({"seed": 3}, client=None, tokenizer=str(tiny_model_dir))
    asyncio.run(env.setup())
    item = asyncio.run(env.get_item())
    assert item.answer == sum(PRICES[name] * quantity for name, quantity in item.extras["basket"].items())
    session = env.chat(item.prompt)
    turns = ["CALL lookup(apple)", f"ANSWER: {item.answer}"]
    masks = []
    for index, text in enumerate(turns):  # the model's words as token ids, as vLLM returns them
        ids = env.renderer.encode(text) + [env.renderer.eos_token_id]
        session.add_completion(Completion(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop", text=text))
        if index == 0:
            before = len(session.trajectory.tokens)
            session.add_messages([{"role": "tool", "content": run_tool(text)}])
            masks.append(session.trajectory.mask[before:])
    sequence = session.to_sequence(env.reward(item, session.messages))
    assert sequence.score == 1.0 and [m["role"] for m in session.messages] == ["user", "assistant", "tool", "assistant"]
    tool_text = env.renderer.decode([t for t, m in zip(sequence.tokens, sequence.mask, strict=True) if not m])
    assert "apple: 3" in tool_text and not any(masks[0])  # the tool's output is context, never trained
    wrong = session.messages[:-1] + [{"role": "assistant", "content": "ANSWER: 0"}]
    assert env.reward(item, wrong) == 0.0


@pytest.mark.integration
class TestToolUseConformance(EnvironmentConformance):
    environment_class = ToolUse
    config = {"group_size": 3, "max_tokens": 8, "turns": 3}
