"""Reading answers the way evaluation harnesses do (environments.answers), checked on what a real
model wrote: SmolLM2-135M-Instruct's completions (`clotho model get`), labelled by hand."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from environments.answers import graded, number_matches, parse_number, read_answer
from environments.base import Item
from environments.bundled.arithmetic import Arithmetic
from environments.bundled.capitals import Capitals
from environments.bundled.compare import Compare

COMPLETIONS = [
    json.loads(line) for line in (Path(__file__).parent / "data" / "smollm2_completions.jsonl").read_text().splitlines()
]
CLASSES = {"arithmetic": Arithmetic, "compare": Compare, "capitals": Capitals}


def make_environment(cls, config=None, *, tokenizer):
    return cls(config, client=None, tokenizer=tokenizer)  # reward never calls the policy


def messages(question: str, completion: str) -> list[dict]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": completion}]


@pytest.fixture(scope="module")
def environments(tiny_tokenizer):
    return {name: make_environment(cls, tokenizer=tiny_tokenizer) for name, cls in CLASSES.items()}


@pytest.mark.parametrize("row", COMPLETIONS, ids=[f"{r['env']}-{n}" for n, r in enumerate(COMPLETIONS)])
def test_the_real_models_completions_score_as_read_by_hand(environments, row):
    item = Item(id="x", prompt=row["question"], answer=row["answer"])
    assert environments[row["env"]].reward(item, messages(row["question"], row["completion"])) == row["score"]


def test_the_first_integer_misread_what_the_model_wrote():
    """What the old rule (the first integer) scored differently from the hand labels: the restated
    question ("16 + 12 = 28") and the list marker ("1. 3 is ...") it read as the answer."""
    numeric = [row for row in COMPLETIONS if row["env"] != "capitals"]
    first = lambda text: int(m.group()) if (m := re.search(r"-?\d+", text)) else None  # noqa: E731
    misread = [row for row in numeric if float(first(row["completion"]) == row["answer"]) != row["score"]]
    right = [row for row in numeric if row["score"] == 1.0]
    assert len(misread) >= 8 and sum(row["score"] == 1.0 for row in misread) >= 6
    assert len(right) >= 12


@pytest.mark.parametrize(
    ("completion", "reader", "span"),
    [
        ("7", "only", "7"),
        (" **-4**.\n", "only", "-4"),
        ("10 - 14 = -4", "after_equals", "-4"),
        ("12 - 16 = 12 + 16 = 20", "after_equals", "20"),
        ("The answer is 11. So 10 + 0 = 10", "answer_is", "11. So 10 + 0 = 10"),
        ("so \\boxed{\\frac{1}{2}} or \\boxed{12}", "boxed", "12"),
        ("<answer> 9 </answer> then 3 = 3", "answer_tag", "9"),
        ("14 - 15 is 1, or 2", "last_number", "2"),
        ("nothing here", None, None),
    ],
)
def test_readers_in_order(completion, reader, span):
    readers = ("only", "boxed", "answer_tag", "answer_is", "after_equals", "last_number")
    reading = read_answer(completion, readers)
    assert (reading.reader, reading.text) == (reader, span)


def test_numbers_are_read_exactly():
    assert parse_number("1,000 apples") == 1000
    assert parse_number("\u22124 degrees") == -4  # a Unicode minus
    assert parse_number("2.50") == parse_number("2.5")
    assert parse_number("x2 and 2nd") is None
    assert read_answer("1. 8 is a multiple of 8.", ["first_number"]).text == "8"  # a list's marker is skipped
    assert read_answer("1. That is it", ["first_number"]).text == "1"


def test_format_reward_pays_for_the_asked_form_right_or_wrong(tiny_tokenizer):
    readers = ("only", "after_equals")
    assert graded("12", readers, number_matches(12), 0.25) == 1.25
    assert graded("11", readers, number_matches(12), 0.25) == 0.25
    assert graded("5 + 7 = 12", readers, number_matches(12), 0.25) == 1.0
    env = make_environment(Arithmetic, {"format_reward": 0.1}, tokenizer=tiny_tokenizer)
    item = Item(id="x", prompt="What is 5 + 7?", answer=12)
    assert env.reward(item, messages("q", "12")) == pytest.approx(1.1)
    assert env.reward(item, messages("q", "5 + 7 = 12")) == 1.0
    strict = make_environment(Arithmetic, {"readers": ["only"]}, tokenizer=tiny_tokenizer)
    assert strict.reward(item, messages("q", "5 + 7 = 12")) == 0.0


def test_capitals_names_the_city_and_no_other(tiny_tokenizer):
    env = make_environment(Capitals, tokenizer=tiny_tokenizer)
    item = Item(id="Peru", prompt="What is the capital of Peru?", answer="Lima")
    assert env.reward(item, messages("q", "The capital of Peru is Lima. It has 10 million people.")) == 1.0
    assert env.reward(item, messages("q", "lima")) == 1.0
    assert env.reward(item, messages("q", "Lima, Paris or Oslo.")) == 0.0  # listing capitals is no answer
    assert env.reward(item, messages("q", "Cusco. Lima is the largest city.")) == 0.0  # the first sentence answers
