"""The item stream the base class runs for an environment that returns its items (Environment.items)."""

from __future__ import annotations

import asyncio

import datasets
import pytest

from environments.base import Environment, Item
from environments.bundled.capitals import HELD_OUT, Capitals


class Listed(Environment):
    name = "listed"

    def __init__(self, config=None, rows=None, eval_rows=None):
        super().__init__(config, client=None, tokenizer=FakeTokenizer())
        self.rows, self.eval_rows = rows, eval_rows

    def items(self, split):
        return self.rows if split == "train" else self.eval_rows

    def reward(self, item, messages):
        return 0.0


class FakeTokenizer:
    def __len__(self):
        return 16


def draw(env, count, method="get_item"):
    return [asyncio.run(getattr(env, method)()) for _ in range(count)]


def test_each_pass_hands_out_every_item_once_in_an_order_drawn_from_the_seed():
    rows = [Item(id=str(i), prompt=f"p{i}") for i in range(6)]
    first = [item.id for item in draw(Listed({"seed": 3}, rows), 12)]
    assert sorted(first[:6]) == sorted(first[6:]) == [str(i) for i in range(6)]
    assert first[:6] != first[6:] or first[:6] != [str(i) for i in range(6)]  # shuffled, per pass
    assert [item.id for item in draw(Listed({"seed": 3}, rows), 12)] == first  # the same seed, the same stream
    assert [item.id for item in draw(Listed({"seed": 4}, rows), 6)] != first[:6]


def test_without_cycle_the_stream_ends_with_none():
    rows = [Item(id="a", prompt="p"), Item(id="b", prompt="q")]
    assert [i and i.id for i in draw(Listed({"cycle": False}, rows), 3)][2] is None


def test_dataset_rows_become_items_with_ids_from_their_place():
    table = datasets.Dataset.from_dict({"prompt": ["2 + 2?", "3 + 3?"], "answer": [4, 6], "id": [None, "six"]})
    items = draw(Listed({"cycle": False}, table), 3)
    assert {(i.id, i.answer) for i in items[:2]} == {("train-0", 4), ("six", 6)} and items[2] is None


def test_evaluate_draws_the_eval_split_in_order_and_never_the_train_one():
    env = Listed(rows=[Item(id="t", prompt="p")], eval_rows=[{"prompt": "e0"}, {"prompt": "e1"}])
    assert [i and i.id for i in draw(env, 3, "get_eval_item")] == ["eval-0", "eval-1", None]
    no_eval = Listed(rows=[Item(id="t", prompt="p")])  # no eval split: the train stream
    assert draw(no_eval, 1, "get_eval_item")[0].id == "t"


def test_rows_of_another_kind_and_no_items_are_named_with_the_fix():
    with pytest.raises(TypeError, match=r"items\('train'\)\[0\] is a str; return Items, or mappings"):
        draw(Listed(rows=["just text"]), 1)
    with pytest.raises(NotImplementedError, match="return them from items\\(split\\).*or write get_item"):
        draw(Listed(), 1)


def test_capitals_hands_out_the_training_countries_and_evaluates_the_held_out_ones():
    env = Capitals(client=None, tokenizer=FakeTokenizer())
    training = {item.id for item in draw(env, 8)}
    held_out = {item.id for item in draw(env, 3, "get_eval_item")}
    assert held_out == HELD_OUT and not training & HELD_OUT and len(training) == 8
    item = draw(env, 1)[0]
    assert env.reward(item, [{"role": "assistant", "content": f" {item.answer.upper()}."}]) == 1.0
    assert env.reward(item, [{"role": "assistant", "content": "Springfield"}]) == 0.0


def test_a_bundled_environment_s_path_outside_bundled_names_where_it_is() -> None:
    from environments.bundled.capitals import Capitals
    from environments.loading import EnvironmentLoadError, load_environment_class

    assert load_environment_class("capitals") is Capitals
    with pytest.raises(
        EnvironmentLoadError, match="use 'environments.bundled.capitals:Capitals' or the name 'capitals'"
    ):
        load_environment_class("environments.capitals:Capitals")
    with pytest.raises(Exception, match="cannot import environments.nothing_here"):
        load_environment_class("environments.nothing_here:Thing")


class Made(Environment):
    """Items made, not listed: a problem generator in new_item (here async, as a search would be)."""

    name = "made"

    def __init__(self, config=None):
        super().__init__(config, client=None, tokenizer=FakeTokenizer())

    async def new_item(self, rng, index):
        a = rng.randint(0, 99)
        return (
            {"prompt": f"{a} + {index}?", "answer": a + index} if index != 2 else Item(id="own", prompt="p", answer=0)
        )

    def reward(self, item, messages):
        return 0.0


def test_made_items_are_drawn_from_the_seed_and_numbered_from_it():
    items = draw(Made({"seed": 5}), 4)
    assert [i.id for i in items] == ["5-1", "5-2", "own", "5-4"]  # an item's own id is kept
    assert all(
        i.answer == int(i.prompt.split(" + ")[0]) + n for n, i in enumerate(items) if i.id != "own"
    )  # a mapping made an Item
    assert (
        draw(Made({"seed": 5}), 4) == items and draw(Made({"seed": 6}), 4) != items
    )  # the seed decides, one stream an instance


def test_an_environment_with_no_items_says_the_three_ways_to_give_them():
    class Nothing(Made):
        new_item = Environment.new_item

    with pytest.raises(NotImplementedError, match=r"items\(split\).*new_item\(rng, index\).*get_item"):
        draw(Nothing(), 1)
