"""What the model writes as it learns: a few sampled completions of the newest group a run stored,
with their scores (what TRL's `log_completions` shows), for the live card and the run's summary.

Read from storage, where every group lands whoever sampled it: the shard index names the newest
shard, and only that shard is read (storage.shard_file.read_shard: its schema checked), at most
every `interval_s`."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import pyarrow as pa

from storage.filesystem import resolve
from storage.index import list_entries
from storage.layout import ROLLOUTS, join, rollouts_url, run_url
from storage.schema import SchemaVersionError, ShardFormatError
from storage.shard_file import ShardInfo, read_shard

log = logging.getLogger(__name__)

SHOWN = 4  # completions of one group
PROMPT_CHARS, COMPLETION_CHARS = 160, 400
COLUMNS = ["env", "policy_version", "group_id", "sequence_index", "score", "finish_reason", "messages"]


def completion_rows(table: pa.Table, count: int = SHOWN) -> list[dict[str, Any]]:
    """Up to `count` sequences of the table's last group: env, policy version, score, the prompt
    (the first user turn) and the completion (every assistant turn), as stored in `messages`."""
    rows = table.select(COLUMNS).to_pylist()  # not the token and logprob lists
    if not rows:
        return []
    group = [row for row in rows if row["group_id"] == rows[-1]["group_id"]]
    shown = []
    for row in sorted(group, key=lambda row: row["sequence_index"])[:count]:
        messages = json.loads(row["messages"]) if row["messages"] else []
        prompt = next((str(m.get("content")) for m in messages if m.get("role") == "user"), "")
        completion = "\n".join(str(m.get("content")) for m in messages if m.get("role") == "assistant")
        shown.append(
            {
                "env": row["env"],
                "policy_version": row["policy_version"],
                "score": row["score"],
                "finish_reason": row["finish_reason"],
                "prompt": prompt if messages else "(no messages stored: a token-level environment)",
                "completion": completion,
            }
        )
    return shown


def cell(text: str, limit: int) -> str:
    """One markdown table cell: cut to `limit` characters, newlines shown as ⏎, pipes escaped."""
    text = text if len(text) <= limit else text[: limit - 1] + "…"
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\r", "").replace("\n", " ⏎ ")


def completions_markdown(rows: list[dict[str, Any]], title: str) -> list[str]:
    """A table of the rows under a heading; [] when there are none."""
    if not rows:
        return []
    lines = [f"## {title}", "", "| env | version | score | prompt | completion |", "|---|---|---|---|---|"]
    for row in rows:
        cut = " (cut: max_tokens)" if row["finish_reason"] == "length" else ""
        lines.append(
            f"| {row['env']} | {row['policy_version']} | {row['score']:.3g} | {cell(row['prompt'], PROMPT_CHARS)} "
            f"| {cell(row['completion'], COMPLETION_CHARS)}{cut} |"
        )
    return [*lines, ""]


def completions_text(completions: dict[str, list[dict[str, Any]]]) -> str:
    """The first and the last group's completions as plain lines, for a terminal."""
    lines = []
    for when in ("first", "last"):
        if rows := completions.get(when):
            lines.append(f"sampled completions, the {when} group stored (policy v{rows[0]['policy_version']}):")
            lines.append(f"  prompt: {cell(rows[0]['prompt'], PROMPT_CHARS)}")
            lines += [f"  score {row['score']:.3g}: {cell(row['completion'], COMPLETION_CHARS)}" for row in rows]
    return "\n".join(lines)


class LatestCompletions:
    """The newest group's completions of a run (`latest`), and the first ones it saw (`first`)."""

    def __init__(self, storage: str, run: str, *, interval_s: float = 5.0, storage_options: dict | None = None):
        self.fs, self.run_path = resolve(run_url(storage, run), storage_options)
        self.rollouts_url = rollouts_url(storage, run)
        self.interval_s = interval_s
        self.shard_id = ""  # the newest shard read
        self.checked = -float("inf")  # time.monotonic() of the last look
        self.first: list[dict[str, Any]] = []
        self.latest: list[dict[str, Any]] = []

    def update(self, force: bool = False) -> bool:
        """Reads the newest shard when one landed since the last look (at most every interval_s
        unless `force`); whether `latest` changed. A storage error keeps what was shown."""
        if not force and time.monotonic() - self.checked < self.interval_s:
            return False
        self.checked = time.monotonic()
        try:
            entries = list_entries(self.fs, self.run_path, after=self.shard_id)
            for entry in reversed(entries[-3:]):  # an entry is written before its shard: try an older one
                if entry.shard_id <= self.shard_id:
                    break
                name = entry.location.name
                shard = ShardInfo(
                    join(self.rollouts_url, name), join(self.run_path, ROLLOUTS, name), entry.location, None
                )
                try:
                    table = read_shard(self.fs, shard)
                except FileNotFoundError:
                    continue
                rows = completion_rows(table)
                self.shard_id = entry.shard_id
                if rows:
                    self.latest = rows
                    self.first = self.first or rows
                    return True
                return False
        except (OSError, ValueError, KeyError, pa.ArrowException, ShardFormatError, SchemaVersionError) as error:
            # the card never stops a run
            log.warning("latest completions not read (%s): the card keeps the previous ones", error)
        return False
