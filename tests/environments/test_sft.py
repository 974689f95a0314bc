"""The SFT environment: demonstrations from a dataset file or another environment's gold answers,
as conformant groups of one whose trained tokens are exactly the answer and the end of turn."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from environments.base import RolloutFailure
from environments.bundled.sft import SFT, SFTConfig
from environments.testing import EnvironmentConformance
from inference.client import PolicyClient

pytestmark = pytest.mark.integration

DEMONSTRATIONS = Path(__file__).parent / "data" / "demonstrations.jsonl"


class TestSFTFromADatasetConformance(EnvironmentConformance):
    environment_class = SFT
    config = {"data": str(DEMONSTRATIONS), "max_tokens": 8}


class TestSFTFromGoldAnswersConformance(EnvironmentConformance):
    environment_class = SFT
    config = {"env": "arithmetic", "env_config": {"max_tokens": 8}}


async def sft_group(server, tokenizer, config):
    async with PolicyClient(server.base_url) as client:
        env = SFT(config, client=client, tokenizer=tokenizer)
        await env.setup()
        item = await env.get_item()
        return env, item, await env.sample_group(item)


async def test_a_demonstration_trains_the_answer_and_the_end_of_turn(policy_server, tiny_model_dir):
    env, item, group = await sft_group(policy_server, str(tiny_model_dir), {"data": str(DEMONSTRATIONS)})
    [sequence] = group.sequences
    assert group.objective == "sft" and group.env == "sft"
    rows = [json.loads(line) for line in DEMONSTRATIONS.read_text().splitlines()]
    row = rows[int(item.id)]
    answer = env.tokenizer.encode(row["completion"], add_special_tokens=False)
    prompt = env.renderer.prompt_ids([{"role": "user", "content": row["prompt"]}])
    assert sequence.tokens == prompt + answer + [env.tokenizer.eos_token_id]
    assert sequence.mask == [False] * len(prompt) + [True] * (len(answer) + 1)
    assert set(sequence.logprobs) == {0.0} and sequence.score == 1.0


async def test_the_gold_answers_of_an_environment_and_its_reward(policy_server, tiny_model_dir):
    env, item, group = await sft_group(policy_server, str(tiny_model_dir), {"env": "arithmetic", "seed": 3})
    assert env.source.name == "arithmetic" and item.id.startswith("0-")
    assert group.sequences[0].messages[-1]["content"] == str(item.answer)
    assert group.sequences[0].score == 1.0


async def test_chat_prompts_and_other_column_names(policy_server, tiny_model_dir, tmp_path):
    data = tmp_path / "chats.jsonl"
    chat = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Is 7 higher than 3?"}]
    data.write_text(json.dumps({"messages": chat, "reply": "higher"}) + "\n")
    config = {"data": str(data), "prompt_column": "messages", "completion_column": "reply"}
    env, _, group = await sft_group(policy_server, str(tiny_model_dir), config)
    assert group.sequences[0].messages == chat + [{"role": "assistant", "content": "higher"}]
    assert env.tokenizer.decode(group.sequences[0].tokens).count("<|im_start|>") == 3


async def test_an_empty_completion_is_a_recorded_failure_not_a_trained_group(policy_server, tiny_model_dir, tmp_path):
    data = tmp_path / "empty.jsonl"
    data.write_text(json.dumps({"prompt": "Say nothing.", "completion": ""}) + "\n")
    _, _, result = await sft_group(policy_server, str(tiny_model_dir), {"data": str(data)})
    assert isinstance(result, RolloutFailure)
    assert "completion: row 0 holds ''" in result.error and "non-empty string" in result.error


async def test_bad_sources_name_the_field_and_the_fix(policy_server, tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="data / env: set exactly one"):
        SFTConfig()
    with pytest.raises(ValueError, match="data / env: set exactly one"):
        SFTConfig(data="x.jsonl", env="arithmetic")
    with pytest.raises(ValueError, match="group_size"):
        SFTConfig(data="x.jsonl", group_size=2)
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"question": "q", "completion": "a"}) + "\n")
    for config, message in [
        (
            {"data": str(data)},
            r"data: .* has no column 'prompt' \(columns: \['question', 'completion'\]\); set prompt_column",
        ),
        ({"data": str(tmp_path / "missing.jsonl")}, r"data: cannot load .*missing.jsonl.*no such file"),
    ]:
        with pytest.raises(ValueError, match=message):
            await sft_group(policy_server, str(tiny_model_dir), config)
