"""core.retrying: the one retry policy (tenacity) the client, storage and remote environments share."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from core.retrying import async_attempts, attempts, backoff_ceiling


class Flaky:
    """Fails `failures` times with `error`, then returns "ok"."""

    def __init__(self, failures: int, error: Exception):
        self.failures, self.error, self.calls = failures, error, 0

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return "ok"


def run(flaky: Flaky, **policy) -> str:
    for attempt in attempts(
        retry_on=lambda e: isinstance(e, ConnectionError), first_s=0.01, max_s=0.04, what="thing", **policy
    ):
        with attempt:
            return flaky()
    raise AssertionError("the policy returns or raises")


def test_transient_errors_are_tried_again_with_doubling_waits_from_the_upper_half(caplog):
    caplog.set_level(logging.WARNING)
    flaky = Flaky(4, ConnectionError("down"))
    assert run(flaky, tries=5) == "ok" and flaky.calls == 5
    waits = [float(r.getMessage().rsplit("next in ", 1)[1].split()[0]) for r in caplog.records]
    assert len(waits) == 4 and all("thing: ConnectionError: down; try" in r.getMessage() for r in caplog.records)
    for attempt, wait in enumerate(waits, start=1):
        ceiling = backoff_ceiling(attempt, 0.01, 0.04)
        assert ceiling / 2 - 0.005 <= wait <= ceiling + 0.005
    assert [backoff_ceiling(n, 1.0, 60.0) for n in (1, 2, 7, 8)] == [1.0, 2.0, 60.0, 60.0]


def test_the_last_error_is_raised_after_the_tries_and_others_at_once():
    with pytest.raises(ConnectionError, match="down"):
        run(Flaky(9, ConnectionError("down")), tries=3)
    refused = Flaky(9, PermissionError("no"))
    with pytest.raises(PermissionError):
        run(refused, tries=3)
    assert refused.calls == 1


def test_a_budget_stops_before_a_wait_that_would_pass_it_and_give_up_raises_the_caller_s_error():
    def give_up(state):
        raise TimeoutError(f"gave up after {state.attempt_number} tries")

    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"gave up after \d+ tries"):
        run(Flaky(10_000, ConnectionError("down")), budget_s=0.2, on_give_up=give_up)
    assert time.monotonic() - started < 0.3


def test_the_async_form_is_the_same_policy():
    async def main() -> str:
        flaky = Flaky(2, ConnectionError("down"))
        async for attempt in async_attempts(
            retry_on=lambda e: isinstance(e, ConnectionError), first_s=0.01, max_s=0.02, tries=3, what="x"
        ):
            with attempt:
                return flaky()
        raise AssertionError("the policy returns or raises")

    assert asyncio.run(main()) == "ok"
