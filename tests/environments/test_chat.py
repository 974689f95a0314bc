"""Chat rendering and turn closing, with the tiny model's real tokenizer (no server)."""

from environments.chat import ChatRenderer, ChatSession
from inference.client import Completion


def test_turn_end_and_closing_ids(tiny_tokenizer):
    renderer = ChatRenderer(tiny_tokenizer)
    eos = tiny_tokenizer.eos_token_id
    assert renderer.turn_end == "<|im_end|>\n"
    stopped = Completion(token_ids=[300, eos], logprobs=[-1.0, -0.5], finish_reason="stop", text="")
    cut = Completion(token_ids=[300, 301], logprobs=[-1.0, -0.5], finish_reason="length", text="")
    assert tiny_tokenizer.decode(renderer.closing_ids(stopped)) == "\n"
    assert tiny_tokenizer.decode(renderer.closing_ids(cut)) == "<|im_end|>\n"


def test_session_masks_environment_turns_and_keeps_sampled_ids(tiny_tokenizer):
    renderer = ChatRenderer(tiny_tokenizer)
    session = ChatSession(renderer, [{"role": "user", "content": "Guess."}])
    prompt = list(session.prompt_ids)
    session.add_completion(Completion(token_ids=[400, 401], logprobs=[-2.0, -3.0], finish_reason="length", text=""))
    session.add_messages([{"role": "user", "content": "Too low."}])
    session.add_completion(
        Completion(token_ids=[402, tiny_tokenizer.eos_token_id], logprobs=[-1.0, -0.1], finish_reason="stop", text="")
    )
    t = session.trajectory
    assert t.tokens[: len(prompt)] == prompt
    assert t.tokens[len(prompt) : len(prompt) + 2] == [400, 401]
    decoded = tiny_tokenizer.decode(t.tokens)
    assert decoded.endswith(
        "<|im_end|>\n<|im_start|>user\nToo low.<|im_end|>\n<|im_start|>assistant\n"
        + tiny_tokenizer.decode([402])
        + "<|im_end|>"
    )
    assert [tok for tok, m in zip(t.tokens, t.mask) if m] == [400, 401, 402, tiny_tokenizer.eos_token_id]
    assert [lp for lp, m in zip(t.logprobs, t.mask) if m] == [-2.0, -3.0, -1.0, -0.1]
    assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.mask) if not m)
    assert t.finish_reason == "stop"
