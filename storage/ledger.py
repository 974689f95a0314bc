"""The consumer ledger: which shards (and how many groups of a shard) a trainer has consumed.

A watermark: every shard whose id sorts before `watermark` is consumed, plus the exceptions after
it: shards consumed out of order (`consumed`) and shards part-way through (`partial`). Its size is
bounded by what is in flight, not by the run's history.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from storage.layout import parse_shard_name

LEDGER_FORMAT = 2  # bumped when the layout changes; a ledger of another format is refused


def shard_id_of(name: str) -> str:
    """`env=E/policy_version=V/ID.parquet` (or a bare id) -> ID: shard ids are unique in a run."""
    location = parse_shard_name(name)
    return location.shard_id if location is not None else name


@dataclass
class Ledger:
    """Saved with each trainer checkpoint so a resumed trainer consumes every shard exactly once.

    Shards are identified by id (unique in a run and independent of its root), so a ledger stays
    valid when a run's root is copied elsewhere (s3:// to file://, say). Methods take a shard's name
    (`env=E/policy_version=V/ID.parquet`) or its id.
    """

    watermark: str = ""  # every shard id < watermark is consumed
    consumed: set[str] = field(default_factory=set)  # ids >= watermark consumed
    # Groups already handed out of a shard the trainer is part-way through.
    partial: dict[str, int] = field(default_factory=dict)

    def is_consumed(self, name: str) -> bool:
        shard_id = shard_id_of(name)
        return shard_id < self.watermark or shard_id in self.consumed

    def groups_taken(self, name: str) -> int:
        return self.partial.get(shard_id_of(name), 0)

    def take_groups(self, name: str, count: int, total: int) -> None:
        """Record that `count` more of the shard's `total` groups were handed to the trainer."""
        taken = self.groups_taken(name) + count
        if taken > total:
            raise ValueError(f"{name}: {taken} groups taken but the shard has {total}")
        if taken == total:
            self.mark_consumed(name)
        else:
            self.partial[shard_id_of(name)] = taken

    def mark_consumed(self, name: str) -> None:
        shard_id = shard_id_of(name)
        self.partial.pop(shard_id, None)
        if shard_id >= self.watermark:
            self.consumed.add(shard_id)

    def advance(self, listed: Iterable[str], before: str) -> None:
        """Move the watermark up to the first listed shard id not consumed, but not past `before`
        (the reader's clock less the grace for late arrivals); `listed` is every id >= the
        watermark that the reader could consume, sorted. Drops the exceptions it passes."""
        limit = before
        for shard_id in listed:
            if shard_id >= limit:
                break
            if shard_id not in self.consumed:
                limit = shard_id
                break
        if limit > self.watermark:
            self.watermark = limit
            self.consumed = {shard_id for shard_id in self.consumed if shard_id >= limit}

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": LEDGER_FORMAT,
            "watermark": self.watermark,
            "consumed": sorted(self.consumed),
            "partial": dict(sorted(self.partial.items())),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Ledger:
        """The inverse of to_dict; an empty dict (nothing saved yet) is an empty ledger."""
        if not data:
            return cls()
        if data.get("format") != LEDGER_FORMAT:
            raise ValueError(
                f"ledger format {data.get('format')!r} is not {LEDGER_FORMAT}; it was saved by another clotho version"
            )
        consumed = set(data["consumed"])
        partial = {str(shard_id): int(count) for shard_id, count in data["partial"].items()}
        both = consumed & partial.keys()
        if both:
            raise ValueError(f"ledger lists {sorted(both)} as both consumed and partial; the file is damaged")
        return cls(watermark=str(data["watermark"]), consumed=consumed, partial=partial)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> Ledger:
        return cls.from_dict(json.loads(text))
