"""Single turn over a list of items: the whole environment is its items and its reward (Environment.items)."""

from __future__ import annotations

from environments.base import Environment, Item, final_answer

CAPITALS = "France Paris|Japan Tokyo|Kenya Nairobi|Peru Lima|Canada Ottawa|Egypt Cairo|Norway Oslo|Spain Madrid"
CAPITALS += "|Chile Santiago|Ghana Accra|Nepal Kathmandu"
HELD_OUT = {"Chile", "Ghana", "Nepal"}  # evaluate scores these; get_item never hands them out


class Capitals(Environment):
    """'What is the capital of Peru?' -> 1.0 if the answer is the city, else 0.0."""

    name = "capitals"

    def items(self, split: str) -> list[Item]:
        pairs = [pair.split(" ", 1) for pair in CAPITALS.split("|")]
        return [
            Item(id=country, prompt=f"What is the capital of {country}? Answer with the city only.", answer=city)
            for country, city in pairs
            if (country in HELD_OUT) == (split == "eval")
        ]

    def reward(self, item: Item, messages: list[dict]) -> float:
        return float(final_answer(messages).strip().rstrip(".").lower() == item.answer.lower())

    def gold_completion(self, item: Item) -> str:
        return item.answer
