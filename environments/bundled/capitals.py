"""Single turn over a list of items: the whole environment is its items and its reward (Environment.items)."""

from __future__ import annotations

import re
from typing import ClassVar

from environments.answers import AnswerConfig, Reader, graded
from environments.base import Environment, Item, final_answer

CAPITALS = "France Paris|Japan Tokyo|Kenya Nairobi|Peru Lima|Canada Ottawa|Egypt Cairo|Norway Oslo|Spain Madrid"
CAPITALS += "|Chile Santiago|Ghana Accra|Nepal Kathmandu"
HELD_OUT = {"Chile", "Ghana", "Nepal"}  # evaluate scores these; get_item never hands them out
CITIES = [pair.split(" ", 1)[1] for pair in CAPITALS.split("|")]


def names_only(city: str, span: str) -> bool:
    """Whether `span` names `city` (as a word, any case) and no other capital of the list: "The capital
    of Peru is Lima." answers Lima; "Lima, Paris or Oslo" answers nothing."""
    named = {other for other in CITIES if re.search(rf"\b{re.escape(other)}\b", span, re.IGNORECASE)}
    return named == {city}


class Capitals(Environment):
    """'What is the capital of Peru?' -> 1.0 if the answer names the city (and no other capital): the
    whole answer, a boxed or tagged one, what follows "the answer is", else its first sentence."""

    name = "capitals"
    config_class = AnswerConfig
    readers: ClassVar[tuple[Reader, ...]] = ("only", "boxed", "answer_tag", "answer_is", "first_sentence")

    def items(self, split: str) -> list[Item]:
        pairs = [pair.split(" ", 1) for pair in CAPITALS.split("|")]
        return [
            Item(id=country, prompt=f"What is the capital of {country}? Answer with the city only.", answer=city)
            for country, city in pairs
            if (country in HELD_OUT) == (split == "eval")
        ]

    def reward(self, item: Item, messages: list[dict]) -> float:
        readers = self.config.readers or self.readers
        matches = lambda span: names_only(item.answer, span)  # noqa: E731
        return graded(final_answer(messages), readers, matches, self.config.format_reward, kind="text")

    def gold_completion(self, item: Item) -> str:
        return item.answer
