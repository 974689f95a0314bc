"""The trainer's input: the next whole groups of the shard stream, stale ones skipped and counted."""

from __future__ import annotations

import logging
import time

from environments.scored_group import ScoredGroup
from storage.reader import ShardReader

log = logging.getLogger(__name__)


class DataTimeoutError(TimeoutError):
    """No new groups arrived in time for a step."""


def next_step_groups(
    reader: ShardReader,
    count: int,
    *,
    policy_version: int,
    max_staleness: int,
    timeout_s: float,
    poll_s: float = 1.0,
) -> tuple[list[ScoredGroup], int]:
    """The next `count` fresh groups in shard order, and how many stale ones were skipped.

    A group is stale when sampled more than `max_staleness` versions before `policy_version`;
    it is consumed (the ledger records it) but not trained on. Waits, polling every `poll_s`, until
    enough groups exist; raises DataTimeoutError after `timeout_s` seconds without a new group.
    The ledger then already holds the groups taken, so do not save it: resume from the last state.
    """
    fresh: list[ScoredGroup] = []
    stale = 0
    last_group = time.monotonic()
    wait_logged = False
    while True:
        for group in reader.groups():
            last_group = time.monotonic()
            wait_logged = False
            if policy_version - group.policy_version > max_staleness:
                stale += 1
                continue
            fresh.append(group)
            if len(fresh) == count:
                return fresh, stale
        waited = time.monotonic() - last_group
        if waited >= timeout_s:
            raise DataTimeoutError(
                f"{reader.url}: {len(fresh)} of {count} groups for the next step after "
                f"{waited:.0f}s without a new group ({stale} stale ones skipped); are rollouts "
                "being written to this run? Raise --data-timeout to wait longer"
            )
        if not wait_logged:
            log.info("waiting for groups in %s (%d of %d so far)", reader.url, len(fresh), count)
            wait_logged = True
        time.sleep(poll_s)
