"""The item stream the base class runs for an environment that hands it its items
(`Environment.items`): seeded order, ids, starting over, and a held-out split for `evaluate`; and
the rows an environment gives (listed, or made by `Environment.new_item`) made into items."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pydantic import BaseModel

Rows = Sequence[Any]  # Items, or mappings of an Item's fields; a datasets.Dataset is one too


class ItemStream:
    """Hands out `rows` one at a time as items, in an order drawn from `seed` for each pass when
    `shuffle` (else as given), starting over after the last when `cycle`, else then None.

    A row is an Item, or a mapping of the item class's fields (a datasets.Dataset row): a missing
    or None `id` becomes "{split}-{index}", the row's place in the split, so a problem keeps its id.
    """

    def __init__(
        self, rows: Rows, make_item: Callable[..., BaseModel], *, split: str, seed: int, cycle: bool, shuffle: bool
    ):
        self.rows, self.make_item, self.split = rows, make_item, split
        self.seed, self.cycle, self.shuffle = seed, cycle, shuffle
        self.passes = 0
        self.order = self._order()
        self.position = 0

    def restart(self) -> None:
        """Back to the first item of the first pass."""
        self.passes, self.position = 0, 0
        self.order = self._order()

    def _order(self) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(f"{self.seed}:{self.passes}").shuffle(order)
        return order

    def next(self) -> Any:
        if self.position == len(self.order):
            if not self.cycle or not self.order:
                return None
            self.passes += 1
            self.order, self.position = self._order(), 0
        index = self.order[self.position]
        self.position += 1
        return self.item(index)

    def item(self, index: int) -> Any:
        return as_item(self.rows[index], self.make_item, f"{self.split}-{index}", f"items({self.split!r})[{index}]")


def as_item(row: Any, make_item: Callable[..., BaseModel], default_id: str, where: str) -> Any:
    """`row` as an item: an Item as it is, a mapping of the item class's fields made into one
    (a missing or None `id` becomes `default_id`); anything else a TypeError naming `where`."""
    if isinstance(row, BaseModel):
        return row
    if isinstance(row, Mapping):  # a dataset's missing value is None: an id is made for it too
        fields = dict(row)
        if fields.get("id") is None:
            fields["id"] = default_id
        return make_item(**fields)
    raise TypeError(
        f"{where} is a {type(row).__name__}; return Items, or mappings of the item class's fields "
        "(id, prompt, answer, ...), e.g. the rows of a datasets.Dataset"
    )
