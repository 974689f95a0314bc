"""How clotho tries again, one policy for every caller (tenacity): after a transient failure, wait
`first_s`, then twice as long each time up to `max_s`, each wait drawn from the upper half of its
span (callers that failed together do not come back together), until a number of tries or a time
budget is spent. The policy client, storage and remote environments loop with it; the reload
watcher, which tries a server that is down again at a later poll instead of in a loop, takes its
waits from `backoff_ceiling`."""

from __future__ import annotations

import functools
import logging
import operator
import random
from collections.abc import Callable
from typing import Any

import tenacity

log = logging.getLogger(__name__)


def backoff_ceiling(attempt: int, first_s: float, max_s: float) -> float:
    """The longest wait after failed try number `attempt` (1, 2, ...): first_s doubling, capped."""
    return min(max_s, first_s * 2 ** (attempt - 1))


class Backoff(tenacity.wait.wait_base):
    """Waits backoff_ceiling(attempt) at most and half of it at least."""

    def __init__(self, first_s: float, max_s: float):
        self.first_s, self.max_s = first_s, max_s

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        ceiling = backoff_ceiling(retry_state.attempt_number, self.first_s, self.max_s)
        return random.uniform(ceiling / 2, ceiling)


def policy(
    *,
    retry_on: Callable[[BaseException], bool],
    first_s: float,
    max_s: float,
    what: str,
    tries: int | None = None,
    budget_s: float | None = None,
    on_give_up: Callable[[tenacity.RetryCallState], Any] | None = None,
    logger: logging.Logger = log,
) -> dict[str, Any]:
    """tenacity's arguments for the policy: errors `retry_on` accepts are tried again, up to
    `tries` tries and while the next wait still ends within `budget_s` of the first try; other
    errors, and the last one, are raised as they are (or handed to `on_give_up`, which raises
    the caller's own error). Each retry is one warning line on the caller's `logger`, naming
    `what` failed, the error, the try and the wait."""
    stops: list[tenacity.stop.stop_base] = [tenacity.stop_after_attempt(tries)] if tries is not None else []
    stops += [tenacity.stop_before_delay(budget_s)] if budget_s is not None else []
    return {
        "retry": tenacity.retry_if_exception(retry_on),
        "wait": Backoff(first_s, max_s),
        "stop": functools.reduce(operator.or_, stops) if stops else tenacity.stop_never,
        "reraise": True,
        "retry_error_callback": on_give_up,
        "before_sleep": functools.partial(_say_retry, logger, what),
    }


def _say_retry(logger: logging.Logger, what: str, state: tenacity.RetryCallState) -> None:
    error = state.outcome.exception() if state.outcome else None
    text = " ".join(str(error).split())[:300]
    logger.warning(
        "%s: %s: %s; try %d failed, next in %.2f s",
        what,
        type(error).__name__,
        text,
        state.attempt_number,
        state.next_action.sleep if state.next_action else 0.0,
    )


def attempts(**kwargs: Any) -> tenacity.Retrying:
    """`for attempt in attempts(...): with attempt: ...` under the policy (see `policy`)."""
    return tenacity.Retrying(**policy(**kwargs))


def async_attempts(**kwargs: Any) -> tenacity.AsyncRetrying:
    """`async for attempt in async_attempts(...): with attempt: ...` under the policy."""
    return tenacity.AsyncRetrying(**policy(**kwargs))
