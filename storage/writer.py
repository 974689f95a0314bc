"""ShardWriter: buffer finished groups and publish them as Parquet shards, losing none on exit."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

from core.scored_group import ScoredGroup
from storage.filesystem import StorageUnavailableError, is_local, resolve, retrying, storage_errors
from storage.index import GRACE_S, add_entry, check_clock, id_seconds, remove_entries
from storage.layout import (
    ROLLOUTS,
    TEMPORARY,
    ShardLocation,
    check_env_name,
    check_policy_version,
    join,
    new_shard_id,
    run_url,
)
from storage.schema import check_serializable, groups_to_table
from storage.shard_file import write_shard

log = logging.getLogger(__name__)

# Rough in-memory bytes of a sequence: int32 token + bool mask + float32 logprob per token, plus row
# overhead. Only used to decide when to flush, so an estimate is enough.
_BYTES_PER_TOKEN = 9
_BYTES_PER_SEQUENCE = 256


def estimated_bytes(group: ScoredGroup) -> int:
    tokens = sum(len(s.tokens) + (len(s.advantages) if s.advantages is not None else 0) for s in group.sequences)
    return tokens * _BYTES_PER_TOKEN + len(group.sequences) * _BYTES_PER_SEQUENCE


class ShardWriter:
    """Buffers groups and writes one shard per (env, policy_version) in the buffer when it is due
    (several where one would exceed `max_groups`).

    A flush is due when the buffer holds `max_groups` groups, about `max_bytes` bytes, or its oldest
    group is `max_age_s` old (checked on `add` and `flush_if_due`). Use it as a context manager, sync
    or async: leaving it flushes, also on an exception, Ctrl-C or task cancellation, because every
    buffered group is finished work (not on a StorageUnavailableError: the store just failed for a
    whole retry budget, so the loss is logged in one line instead). A flush that fails keeps its
    groups buffered; the next flush first settles whether the failed write landed after all.
    Methods are thread-safe; from asyncio code call them through `asyncio.to_thread`, since a flush
    blocks on storage.
    """

    def __init__(
        self,
        root: str,
        run: str,
        *,
        tokenizer: str,
        max_groups: int = 256,
        max_bytes: int = 64 * 2**20,
        max_age_s: float = 60.0,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        if not tokenizer:
            raise ValueError("tokenizer is empty; pass the tokenizer's name or path (it goes into every shard)")
        for name, value in (
            ("max_groups", max_groups),
            ("max_bytes", max_bytes),
            ("max_age_s", max_age_s),
        ):
            if value <= 0:
                raise ValueError(f"{name} is {value}; it must be > 0")
        self.url = run_url(root, run)
        self.tokenizer = tokenizer
        self.max_groups = max_groups
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self._fs, self._run_path = resolve(self.url, storage_options)
        self._rollouts_path = join(self._run_path, ROLLOUTS)
        self._temp_path = join(self._run_path, TEMPORARY)
        with storage_errors(self.url):
            check_clock(self._fs, self._temp_path)  # shard ids carry this machine's time
        self._buffer: list[ScoredGroup] = []
        self._buffered_bytes = 0
        self._oldest: float | None = None
        self._lock = threading.Lock()
        self._closed = False
        self.written: list[str] = []  # URLs of every shard this writer published, in order
        # Writes to an object store that failed without telling whether the shard landed.
        self._unsettled: list[tuple[ShardLocation, list[ScoredGroup]]] = []

    @property
    def pending_groups(self) -> int:
        return len(self._buffer)

    def add(self, group: ScoredGroup) -> list[str]:
        """Buffer one group; returns the URLs of the shards written if this made a flush due."""
        return self.add_many([group])

    def add_many(self, groups: Iterable[ScoredGroup]) -> list[str]:
        groups = list(groups)
        for group in groups:
            if not isinstance(group, ScoredGroup):
                raise TypeError(f"expected a ScoredGroup, got {type(group).__name__}")
            check_env_name(group.env)
            check_policy_version(group.policy_version)
            check_serializable(group)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"ShardWriter for {self.url} is closed; create a new one to write more groups")
            if groups and self._oldest is None:
                self._oldest = time.monotonic()
            self._buffer.extend(groups)
            self._buffered_bytes += sum(estimated_bytes(group) for group in groups)
            return self._flush_locked() if self.due() else []

    def flush_if_due(self) -> list[str]:
        """Flush if the buffer is full or old enough; call it from a timer when groups arrive slowly."""
        with self._lock:
            return self._flush_locked() if self.due() else []

    def flush(self) -> list[str]:
        """Write every buffered group now; returns the shard URLs written (one per partition)."""
        with self._lock:
            return self._flush_locked()

    def close(self) -> list[str]:
        """Flush and refuse further groups. Idempotent."""
        with self._lock:
            written = self._flush_locked()
            self._closed = True
            return written

    def due(self) -> bool:
        """Whether a flush is due: exact under the lock; without it a hint (a flush in another
        thread may be under way) that lets an event loop skip a thread hop to flush_if_due."""
        if not self._buffer:
            return False
        aged = self._oldest is not None and time.monotonic() - self._oldest >= self.max_age_s
        return len(self._buffer) >= self.max_groups or self._buffered_bytes >= self.max_bytes or aged

    def _flush_locked(self) -> list[str]:
        written = self._settle_locked()
        partitions: dict[tuple[str, int], list[ScoredGroup]] = {}
        for group in self._buffer:
            partitions.setdefault((group.env, group.policy_version), []).append(group)
        # A shard holds at most max_groups groups, also when one add_many overshoots the limit.
        chunks = [
            (env, policy_version, groups[start : start + self.max_groups])
            for (env, policy_version), groups in partitions.items()
            for start in range(0, len(groups), self.max_groups)
        ]
        for env, policy_version, groups in chunks:
            location = ShardLocation(env, policy_version, new_shard_id())
            url = join(self.url, ROLLOUTS, location.name)
            with storage_errors(url):
                try:
                    write_shard(
                        self._fs,
                        join(self._rollouts_path, location.name),
                        groups_to_table(groups, self.tokenizer),
                        self._temp_path,
                        # The entry comes first (see storage.index), once the bytes are staged: a
                        # writer killed while it encodes or syncs leaves no entry without its
                        # shard, which every reader of the run would wait on for GRACE_S.
                        before=functools.partial(add_entry, self._fs, self._run_path, location),
                    )
                except FileExistsError:
                    raise
                except Exception:
                    if is_local(self._fs):  # a failed local publish linked nothing in (a full disk)
                        with contextlib.suppress(OSError):
                            remove_entries(self._fs, self._run_path, [location])
                    else:  # a failed PUT may still have landed: the next flush looks first
                        self._unsettled.append((location, groups))
                    raise
            if (late := time.time() - id_seconds(location.shard_id)) > GRACE_S / 2:
                log.warning("%s took %.0f s to publish; readers pass shards %.0f s after their id", url, late, GRACE_S)
            self._stored(url, groups)
            written.append(url)
        self._buffered_bytes = sum(estimated_bytes(group) for group in self._buffer)
        self._oldest = time.monotonic() if self._buffer else None
        return written

    def _settle_locked(self) -> list[str]:
        """Settle the writes that failed on an object store, before writing their groups again: a
        shard that landed after all (its answer was lost) counts as written, so its groups are not
        written twice; for one that did not, its index entry goes, so that readers do not hold at
        it for the grace period. Raises, settling nothing more, while the store is still down."""
        written = []
        while self._unsettled:
            location, groups = self._unsettled[0]
            url = join(self.url, ROLLOUTS, location.name)
            path = join(self._rollouts_path, location.name)
            with storage_errors(url):
                landed = retrying(self._fs, path, self._fs.exists, path)
                if not landed:
                    retrying(self._fs, path, remove_entries, self._fs, self._run_path, [location])
            self._unsettled.pop(0)
            if landed:
                log.info("%s landed although its write failed; its %d groups are not written again", url, len(groups))
                self._stored(url, groups)
                written.append(url)
        return written

    def _stored(self, url: str, groups: list[ScoredGroup]) -> None:
        """Drop `groups` from the buffer: they are in the shard at `url`. Only what is stored is
        dropped, so a failed partition stays buffered for the next flush."""
        stored_ids = {id(group) for group in groups}
        self._buffer = [group for group in self._buffer if id(group) not in stored_ids]
        log.debug("wrote %d groups to %s", len(groups), url)
        self.written.append(url)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if exc is None:
            self.close()
            return
        pending = self.pending_groups
        if isinstance(exc, StorageUnavailableError) and pending:
            # The store just failed for a whole retry budget: a second budget would only delay exit.
            with self._lock:
                self._closed = True
            log.error("lost %d buffered groups for %s: %s", pending, self.url, exc)
            return
        try:
            self.close()
        except Exception as error:  # noqa: BLE001 - keep the original exception; this line is the record of the loss
            log.error(
                "lost %d buffered groups for %s while exiting on %s: %s",
                pending,
                self.url,
                exc_type.__name__ if exc_type else "exit",
                error,
            )

    async def __aenter__(self) -> ShardWriter:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        # Shielded: a second cancellation while flushing must not abandon the write halfway.
        await asyncio.shield(asyncio.to_thread(self.__exit__, exc_type, exc, tb))
