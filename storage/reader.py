"""ShardReader: the trainer's stream of new shards, filtered, in order, each consumed exactly once."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from core.scored_group import ScoredGroup
from storage.filesystem import resolve, storage_errors
from storage.index import GRACE_S, backfill, id_at, id_seconds, is_complete, list_entries
from storage.layout import ROLLOUTS, join, rollouts_url, run_url
from storage.ledger import Ledger
from storage.quarantine import quarantine
from storage.schema import METADATA_TOKENIZER, ShardFormatError, compacted_from, table_to_groups
from storage.shard_file import ShardInfo, read_shard

log = logging.getLogger(__name__)


# Shards read and decoded ahead of the one being consumed: Parquet decoding releases the GIL, so
# two in flight keep two cores busy, as a pyarrow.dataset scan does.
READ_AHEAD = 2


class TokenizerMismatchError(Exception):
    """A shard was tokenized by another tokenizer than the trainer's; its token ids mean other things."""


def group_starts(table: pa.Table) -> np.ndarray:
    """Row index where each group begins (rows of a group are contiguous in a shard)."""
    ids = table.column("group_id").to_numpy()
    return np.flatnonzero(np.concatenate([[len(ids) > 0], ids[1:] != ids[:-1]]))


@dataclass(frozen=True)
class RolloutBatch:
    """The not-yet-consumed rows of one shard, kept in Arrow so a trainer can build tensors from
    `table.column("tokens")` without per-token Python work; `groups()` decodes them to ScoredGroups."""

    shard: ShardInfo
    table: pa.Table
    tokenizer: str

    @property
    def num_sequences(self) -> int:
        return self.table.num_rows

    @property
    def num_groups(self) -> int:
        return len(group_starts(self.table))

    def groups(self) -> list[ScoredGroup]:
        return table_to_groups(self.table, validated=True)  # read_shard ran check_table on it


class ShardReader:
    """Reads the shards of `{root}/{run}/rollouts/` that the ledger has not consumed, oldest first.

    Shards are found through the run's index (storage.index), listed only from the ledger's
    watermark on, so a poll costs the same at shard 10**3 and 10**6. A shard listed in the index
    but not readable yet ends the pass (the next one retries it first, keeping the order) until it
    is `grace_s` old; then its writer is taken to have died before publishing it, and it is passed.

    Filter: `envs` (names to read, None for all; the watermark passes other envs' shards, so a
    reader resumed from this ledger with another filter does not see them). Staleness is not the reader's to judge: every shard
    is handed out, and the trainer consumes and skips stale groups itself (trainer.data.is_stale), so
    the ledger records them. A corrupt shard is logged and moved to `{run}/_quarantine/`; the pass
    goes on.

    A corrupt shard is consumed when it is quarantined, also when the move fails (it stays where it
    is, logged), so it never holds the watermark back.

    A shard or group counts as consumed once it is handed out: save `reader.ledger.to_dict()` with the
    checkpoint after training on what was handed out, and pass `Ledger.from_dict(...)` on resume.
    """

    def __init__(
        self,
        root: str,
        run: str,
        *,
        tokenizer: str | None = None,
        envs: Iterable[str] | None = None,
        ledger: Ledger | None = None,
        storage_options: dict[str, Any] | None = None,
        grace_s: float = GRACE_S,
    ) -> None:
        self.url = rollouts_url(root, run)
        self.grace_s = grace_s
        self.tokenizer = tokenizer
        self.envs = None if envs is None else set(envs)
        self.ledger = ledger if ledger is not None else Ledger()
        self.storage_options = storage_options
        self._fs, self._run_path = resolve(run_url(root, run), storage_options)
        self._rollouts_path = join(self._run_path, ROLLOUTS)
        self._indexed = False  # whether shards copied in without entries are indexed (backfill)
        self._unreadable: dict[str, int] = {}  # listed shards whose read found nothing, and how often
        self._pool: ThreadPoolExecutor | None = None  # started on the first read
        self._ahead: dict[str, Future[pa.Table]] = {}  # shard name -> its read-ahead
        # The shard groups() is part-way through, decoded: (name, groups).
        self._in_progress: tuple[str, list[ScoredGroup]] | None = None

    def new_shards(self) -> list[ShardInfo]:
        """Shards passing the filters that are not fully consumed yet, oldest id first."""
        with storage_errors(self.url):
            if not self._indexed:  # once per reader: one HEAD, or one listing of a run copied without its index
                self._indexed = is_complete(self._fs, self._run_path) or backfill(
                    self._fs, self._run_path, self.url, self.storage_options
                )
            listed = list_entries(self._fs, self._run_path, after=self.ledger.watermark)
        entries = [entry for entry in listed if self.envs is None or entry.env in self.envs]
        self.ledger.advance([entry.shard_id for entry in entries], before=id_at(time.time() - self.grace_s))
        shards = []
        for entry in entries:
            name = entry.location.name
            if not self.ledger.is_consumed(name):
                shards.append(ShardInfo(join(self.url, name), join(self._rollouts_path, name), entry.location, None))
        return shards

    def batches(self) -> Iterator[RolloutBatch]:
        """One pass over the new shards: each shard's remaining rows as one batch, then consumed."""
        for batch in self._read_ahead(self.new_shards()):
            shard = batch.shard
            taken = self.ledger.groups_taken(shard.name)
            if taken:
                batch = RolloutBatch(shard, batch.table.slice(group_starts(batch.table)[taken]), batch.tokenizer)
            self.ledger.mark_consumed(shard.name)
            yield batch

    def groups(self) -> Iterator[ScoredGroup]:
        """One pass over the new shards, group by group; the ledger records each group handed out."""
        shards = self.new_shards()
        names = {shard.name for shard in shards}
        if self._in_progress is not None and self._in_progress[0] in names:
            # A trainer that stops mid-shard each step resumes here without reading it again.
            shards = [shard for shard in shards if shard.name != self._in_progress[0]]
            yield from self._take(*self._in_progress)
        for batch in self._read_ahead(shards):
            self._in_progress = (batch.shard.name, batch.groups())
            yield from self._take(*self._in_progress)

    def _take(self, name: str, groups: list[ScoredGroup]) -> Iterator[ScoredGroup]:
        for group in groups[self.ledger.groups_taken(name) :]:
            self.ledger.take_groups(name, 1, len(groups))
            yield group
        self._in_progress = None

    def stream(self, *, poll_s: float = 1.0, idle_timeout_s: float | None = None) -> Iterator[ScoredGroup]:
        """Groups as their shards appear, polling every `poll_s`; ends after `idle_timeout_s` without
        a new group (never when None)."""
        last_group = time.monotonic()
        while True:
            for group in self.groups():
                last_group = time.monotonic()
                yield group
            if idle_timeout_s is not None and time.monotonic() - last_group >= idle_timeout_s:
                return
            time.sleep(poll_s)

    def _read_ahead(self, shards: list[ShardInfo]) -> Iterator[RolloutBatch]:
        """The shards' batches in order, reading (and decoding) the next READ_AHEAD shards in threads
        while the caller works on this one, so storage latency (an S3 GET) hides behind training. A
        read-ahead left over when the caller stopped early is kept for the next pass."""
        wanted = {shard.name for shard in shards}
        for name in [name for name in self._ahead if name not in wanted]:
            self._ahead.pop(name).cancel()
        for index, shard in enumerate(shards):
            reading = self._ahead.pop(shard.name, None) or self._submit(shard)
            for following in shards[index + 1 : index + 1 + READ_AHEAD]:
                if following.name not in self._ahead:
                    self._ahead[following.name] = self._submit(following)
            try:
                batch = self._load(shard, reading)
            except FileNotFoundError:
                if time.time() - id_seconds(shard.location.shard_id) > self.grace_s:
                    # Indexed, never published: its writer died between the entry and the shard.
                    log.warning("shard %s is indexed but was never written (its writer died first); passed", shard.url)
                    self.ledger.mark_consumed(shard.name)
                    continue
                # Indexed but not readable yet: being written, or, on stores whose listings run
                # ahead of reads, not there yet. End the pass so the next one retries it before
                # anything newer, keeping the order; say so louder if it persists.
                self._unreadable[shard.name] = tries = self._unreadable.get(shard.name, 0) + 1
                level = logging.INFO if tries < 3 else logging.WARNING
                log.log(level, "shard %s is listed but not readable (%d tries)", shard.url, tries)
                return
            if batch is not None:
                yield batch

    def _submit(self, shard: ShardInfo) -> Future[pa.Table]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=READ_AHEAD, thread_name_prefix="shard-read-ahead")
        return self._pool.submit(read_shard, self._fs, shard)

    def _load(self, shard: ShardInfo, reading: Future[pa.Table]) -> RolloutBatch | None:
        """The shard's rows, or None when it was corrupt or is a compaction of consumed shards."""
        try:
            table = reading.result()
        except ShardFormatError as error:
            quarantine(self._fs, shard, str(error))  # logged, moved or not
            self.ledger.mark_consumed(shard.name)
            return None
        tokenizer = table.schema.metadata[METADATA_TOKENIZER].decode()
        if self.tokenizer is not None and tokenizer != self.tokenizer:
            raise TokenizerMismatchError(
                f"{shard.url} was tokenized with {tokenizer!r} but this reader expects {self.tokenizer!r}; "
                "point the trainer at the run's tokenizer or write the run again"
            )
        sources = compacted_from(table.schema.metadata)
        if sources:
            consumed = [s for s in sources if self.ledger.is_consumed(s)]
            if len(consumed) == len(sources):
                self.ledger.mark_consumed(shard.name)
                return None
            seen = consumed + [s for s in sources if self.ledger.groups_taken(s)]
            if seen:
                raise RuntimeError(
                    f"{shard.url} merges shards this ledger consumed only in part ({seen}); do not compact "
                    "partitions a trainer is still consuming"
                )
        return RolloutBatch(shard, table, tokenizer)
