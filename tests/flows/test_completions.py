"""What the live card shows of the model's writing: the newest stored group's completions with their
scores, read from real shards of a run (the index names the newest), and kept when storage fails."""

from __future__ import annotations

import random

from core.scored_group import ScoredGroup, ScoredSequence
from flows.completions import LatestCompletions, cell, completions_text
from flows.live_view import live_markdown
from storage.filesystem import resolve
from storage.index import add_entry
from storage.layout import ShardLocation, new_shard_id
from storage.writer import ShardWriter


def answered(item: str, answers: list[tuple[str, float]], version: int = 0) -> ScoredGroup:
    rng = random.Random(item)
    sequences = [
        ScoredSequence.from_prompt(
            [1, 2, 3],
            [rng.randrange(100) for _ in range(4)],
            [-0.5] * 4,
            score=score,
            finish_reason="length" if len(text) > 20 else "stop",
            messages=[
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": f"What is {item}?"},
                {"role": "assistant", "content": text},
            ],
        )
        for text, score in answers
    ]
    return ScoredGroup(env="arithmetic", item_id=item, sequences=sequences, policy_version=version)


def write(tmp_path, *groups: ScoredGroup) -> None:
    with ShardWriter(str(tmp_path), "run", tokenizer="tok") as writer:
        writer.add_many(groups)


def test_the_newest_groups_completions_are_read_and_the_first_ones_kept(tmp_path):
    latest = LatestCompletions(str(tmp_path), "run", interval_s=0)
    assert not latest.update() and latest.latest == []  # no shard yet
    write(tmp_path, answered("2 + 2", [("2 + 2 = 5", 0.0), ("4", 1.2)]))
    assert latest.update()
    assert [(r["prompt"], r["completion"], r["score"]) for r in latest.latest] == [
        ("What is 2 + 2?", "2 + 2 = 5", 0.0),
        ("What is 2 + 2?", "4", 1.2),
    ]
    assert not latest.update()  # nothing new
    write(tmp_path, answered("7 * 3", [("21", 1.2)], version=1), answered("9 - 4", [("It is | 5\nok", 1.0)], version=1))
    assert latest.update()
    assert [(r["completion"], r["policy_version"]) for r in latest.latest] == [("It is | 5\nok", 1)]  # the last group
    assert latest.first[0]["completion"] == "2 + 2 = 5"
    # An index entry whose shard is not there yet (its writer publishes it next): the newest readable one.
    fs, path = resolve(str(tmp_path / "run"))
    add_entry(fs, path, ShardLocation("arithmetic", 2, new_shard_id()))
    assert not latest.update() and latest.latest[0]["completion"] == "It is | 5\nok"


def test_a_throttled_look_and_a_broken_store_keep_what_was_shown(tmp_path):
    write(tmp_path, answered("1 + 1", [("2", 1.0)]))
    latest = LatestCompletions(str(tmp_path), "run", interval_s=3600)
    assert latest.update() and not latest.update()  # throttled, not re-read
    write(tmp_path, answered("1 + 2", [("3", 1.0)]))
    assert not latest.update() and latest.update(force=True)
    location = ShardLocation("arithmetic", 0, new_shard_id())  # a shard that is not Parquet
    fs, path = resolve(str(tmp_path / "run"))
    add_entry(fs, path, location)
    (tmp_path / "run" / "rollouts" / location.name).write_bytes(b"not parquet")
    assert not latest.update(force=True) and latest.latest[0]["completion"] == "3"


def test_the_card_and_the_terminal_show_the_completions_escaped():
    rows = [
        {
            "env": "arithmetic",
            "policy_version": 3,
            "score": 1.2,
            "finish_reason": "stop",
            "prompt": "What is 2 + 2?",
            "completion": "a | b\nc",
        },
        {
            "env": "arithmetic",
            "policy_version": 3,
            "score": 0.0,
            "finish_reason": "length",
            "prompt": "What is 2 + 2?",
            "completion": "x" * 500,
        },
    ]
    card = live_markdown("run", "rl", 10, [], [], {}, 1.0, {}, completions=rows)
    assert "## Latest sampled completions (the newest group stored)" in card
    assert "| arithmetic | 3 | 1.2 | What is 2 + 2? | a \\| b ⏎ c |" in card
    assert "…  (cut: max_tokens) |" not in card and "… (cut: max_tokens) |" in card
    assert cell("x" * 500, 400) == "x" * 399 + "…"
    text = completions_text({"first": rows[:1], "last": rows[1:]})
    assert text.splitlines()[:3] == [
        "sampled completions, the first group stored (policy v3):",
        "  prompt: What is 2 + 2?",
        "  score 1.2: a \\| b ⏎ c",
    ]
    assert "the last group stored" in text
