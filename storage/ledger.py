"""The consumer ledger: which shards (and how many groups of a shard) a trainer has consumed."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

LEDGER_FORMAT = 1


@dataclass
class Ledger:
    """Saved with each trainer checkpoint so a resumed trainer consumes every shard exactly once.

    Shards are named relative to the rollouts directory (`env=E/policy_version=V/ID.parquet`), so a
    ledger stays valid when a run's root is copied elsewhere (s3:// to file://, say).
    """

    consumed: set[str] = field(default_factory=set)
    # Groups already handed out of a shard the trainer is part-way through.
    partial: dict[str, int] = field(default_factory=dict)

    def is_consumed(self, name: str) -> bool:
        return name in self.consumed

    def groups_taken(self, name: str) -> int:
        return self.partial.get(name, 0)

    def take_groups(self, name: str, count: int, total: int) -> None:
        """Record that `count` more of the shard's `total` groups were handed to the trainer."""
        taken = self.groups_taken(name) + count
        if taken > total:
            raise ValueError(f"{name}: {taken} groups taken but the shard has {total}")
        if taken == total:
            self.mark_consumed(name)
        else:
            self.partial[name] = taken

    def mark_consumed(self, name: str) -> None:
        self.partial.pop(name, None)
        self.consumed.add(name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": LEDGER_FORMAT,
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
                f"ledger format {data.get('format')!r} != {LEDGER_FORMAT}; "
                "it was saved by another clotho version"
            )
        consumed = set(data["consumed"])
        partial = {str(name): int(count) for name, count in data.get("partial", {}).items()}
        both = consumed & partial.keys()
        if both:
            raise ValueError(
                f"ledger lists {sorted(both)} as both consumed and partial; the file is damaged"
            )
        return cls(consumed=consumed, partial=partial)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> Ledger:
        return cls.from_dict(json.loads(text))
