"""The group chat environment: its own `[name]:` template, only the organisers' turns trained,
one sequence per organiser, the scheduling reward, and the conformance suite on the live server."""

from __future__ import annotations

import asyncio

import pytest

from environments.bundled.group_chat import HOURS, Game, GroupChat, seen_by
from environments.chat import ChatRenderer
from environments.conformance import trained_segments
from environments.testing import EnvironmentConformance
from inference.client import Completion, PolicyClient


def group_chat(tiny_model_dir, **config) -> GroupChat:
    env = GroupChat({"seed": 7, **config}, client=None, tokenizer=str(tiny_model_dir))
    asyncio.run(env.setup())
    return env


def said(env: GroupChat, text: str) -> Completion:
    """The model's words as token ids, as vLLM returns a turn that stopped on EOS."""
    ids = env.renderer.encode(text) + [env.renderer.eos_token_id]
    return Completion(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop", text=text)


def test_turns_follow_the_group_chat_template_not_chatml(tiny_model_dir) -> None:
    env = group_chat(tiny_model_dir)
    item = asyncio.run(env.get_item())
    [attendee, _], [organiser] = item.extras["free"], item.extras["speakers"]
    messages = item.prompt + [{"role": "assistant", "name": organiser, "content": "PROPOSE 9"}]
    ours = ChatRenderer(env.tokenizer, env.chat_template, env.chat_template_name, {"speaker": attendee})
    chatml = ChatRenderer(env.tokenizer)  # the tiny model's own template
    assert ours.prompt_ids(messages) != chatml.prompt_ids(messages)
    text = env.tokenizer.decode(ours.prompt_ids(messages))
    hours = ", ".join(map(str, item.extras["free"][attendee]))
    assert text.startswith("* Group chat: find one hour") and "<|im_start|>" not in text
    assert f"\n[{attendee}]: I am free at {hours}.<|im_end|>\n" in text
    assert text.endswith(f"[{organiser}]: PROPOSE 9<|im_end|>\n[{attendee}]: ")  # the next speaker's header
    assert "<|im_start|>user\nI am free at" in env.tokenizer.decode(chatml.prompt_ids(messages))
    assert ours.turn_end == "<|im_end|>\n"  # the tokenizer's EOS ends a turn: where sampling stops
    with pytest.raises(Exception, match="say who speaks next"):
        env.renderer.prompt_ids(messages)  # a generation prompt needs a speaker


def test_each_organiser_is_one_sequence_and_only_its_turns_train(tiny_model_dir) -> None:
    env = group_chat(tiny_model_dir, policy_speakers=2, rounds=2)
    item = asyncio.run(env.get_item())
    first, second = item.extras["speakers"]
    good = item.answer[0]
    bad = next(hour for hour in HOURS if hour not in item.answer)
    game = Game(env, item)
    # Round 1: first proposes an hour that suits not everyone, second one that suits all (and is
    # done); round 2: only first speaks again, and takes second's hour.
    for speaker, text in [(first, f"PROPOSE {bad}"), (second, f"I say PROPOSE {good}"), (first, f"PROPOSE {good}")]:
        game.session_for(speaker).add_completion(said(env, text))
        game.record(speaker)
    assert game.agreed == {first, second}
    one, two = sequences = game.sequences()
    assert [s.extras for s in sequences] == [{"speaker": first, "turns": 2}, {"speaker": second, "turns": 1}]
    assert [s.score for s in sequences] == [1.0, 1.0]
    decode = env.tokenizer.decode
    for sequence, speaker, turns in [
        (one, first, [f"PROPOSE {bad}", f"PROPOSE {good}"]),
        (two, second, [f"I say PROPOSE {good}"]),
    ]:
        mine = [m for m in sequence.messages if m["role"] == "assistant"]
        assert [m["content"] for m in mine] == turns and {m["name"] for m in mine} == {speaker}
        assert [decode(sequence.tokens[a:b], skip_special_tokens=True) for a, b in trained_segments(sequence)] == turns
        assert sequence.tokens[-1] == env.renderer.eos_token_id and sequence.mask[-1]  # ends on its own last token
    context = decode([t for t, m in zip(one.tokens, one.mask, strict=True) if not m])
    # The first organiser heard the second as context, by name, with the attendees' replies.
    assert f"[{second}]: I say PROPOSE {good}<|im_end|>\n" in context and f"{good} works for me." in context
    assert f"I can't make {bad}." in context and context.endswith(f"[{first}]: ")
    assert [m["role"] for m in two.messages if m.get("name") == first] == ["user"]  # another organiser is context
    group = env.make_group(item, sequences)
    assert group.chat_template == "group_chat" and len(group.sequences) == 2


def test_the_reward_is_the_share_of_attendees_free_at_the_last_proposal(tiny_model_dir) -> None:
    env = group_chat(tiny_model_dir, attendees=3)
    item = asyncio.run(env.get_item())
    free = item.extras["free"]
    [organiser] = item.extras["speakers"]
    common = item.answer[0]
    lonely = next(h for h in HOURS if sum(h in hours for hours in free.values()) == 1)

    def turns(*texts: str, other: str = "") -> list[dict]:
        chat = [{"role": "assistant", "name": organiser, "content": text} for text in texts]
        return (
            item.prompt
            + chat
            + ([seen_by(organiser, {"role": "user", "name": "zed", "content": other})] if other else [])
        )

    assert set(free) == {m["name"] for m in item.prompt[1:]} and organiser not in free and common in HOURS
    assert env.reward(item, turns(f"Let us meet. PROPOSE {common}")) == 1.0
    assert env.reward(item, turns(f"PROPOSE {lonely}")) == pytest.approx(1 / 3)
    assert env.reward(item, turns("PROPOSE 3")) == 0.0 and env.reward(item, turns("noon?")) == 0.0
    assert env.reward(item, turns(f"PROPOSE {common}", "no idea")) == 0.0  # only the last turn counts
    assert env.reward(item, turns("no idea", other=f"PROPOSE {common}")) == 0.0  # another's proposal is not its own
    assert env.reward(item, turns(env.gold_completion(item))) == 1.0
    assert [r["content"] for r in env.replies(item, f"PROPOSE {common}")] == [f"{common} works for me."] * 3
    assert [r["content"] for r in env.replies(item, "hello")] == ["Please propose an hour: PROPOSE <hour>."]
    items = [asyncio.run(env.get_item()) for _ in range(20)]
    assert len({i.id for i in items}) == 20 and all(i.answer for i in items)


@pytest.mark.integration
async def test_two_organisers_make_two_sequences_per_game_on_the_live_server(policy_server, policy_tokenizer) -> None:
    config = {"group_size": 4, "max_tokens": 6, "policy_speakers": 2, "rounds": 2, "seed": 3}
    async with PolicyClient(policy_server.base_url, api_key=policy_server.api_key) as client:
        env = GroupChat(config, client=client, tokenizer=policy_tokenizer)
        await env.setup()
        item = await env.get_item()
        group = await env.collect_trajectories(item)
    first, second = item.extras["speakers"]
    assert [s.extras["speaker"] for s in group.sequences] == [first, second, first, second]
    assert group.chat_template == "group_chat"
    for sequence in group.sequences:
        speaker = sequence.extras["speaker"]
        mine = [m for m in sequence.messages if m["role"] == "assistant"]
        assert {m["name"] for m in mine} == {speaker} and len(trained_segments(sequence)) == len(mine)
        assert sequence.score == env.reward(item, sequence.messages)


@pytest.mark.integration
class TestGroupChatConformance(EnvironmentConformance):
    environment_class = GroupChat
    config = {"group_size": 4, "max_tokens": 8, "policy_speakers": 2, "rounds": 2}
