"""Failed rollouts as data: what kind of failure, and the record the rollout flow keeps of it."""

from __future__ import annotations

import re

from pydantic import BaseModel, Field, ValidationError

from core.retrying import async_attempts, attempts
from core.scored_group import CONTRACT_REASONS, InvalidGroupError
from inference.client import PolicyServerUnreachable


class GroupTimeoutError(TimeoutError):
    """A group ran past its environment's group_timeout_s and was cut."""


class DroppedByEnvironment(Exception):
    """The environment itself chose to give no group for an item (its own filters: Atropos drops a
    group whose scores are all equal, say): no error, recorded under its own reason so that the
    failures by reason say whose decision it was."""


class InfraError(RuntimeError):
    """The machinery failed, not the candidate: a sandbox starved of CPU on a loaded host, a judge or
    scoring service that timed out or answered nonsense. Never a score: raised by the reward where
    it happens, tried again there (INFRA_TRIES, with backoff: infra_attempts), and when the tries run
    out the group fails with reason `infra`, counted in the env stats card."""


INFRA_TRIES = 3  # a reward's machinery is tried this many times before its group fails as `infra`
INFRA_FIRST_WAIT_S = 1.0  # then twice as long each time (core.retrying)


def _retry_infra(what: str) -> dict:
    return dict(
        retry_on=lambda error: isinstance(error, InfraError),
        first_s=INFRA_FIRST_WAIT_S,
        max_s=8 * INFRA_FIRST_WAIT_S,
        what=what,
        tries=INFRA_TRIES,
    )


def infra_attempts(what: str):
    """`for attempt in infra_attempts(...): with attempt: ...`: InfraError tried again with backoff,
    the last one raised (core.retrying.attempts)."""
    return attempts(**_retry_infra(what))


def async_infra_attempts(what: str):
    """infra_attempts for a coroutine: `async for attempt in async_infra_attempts(...)`."""
    return async_attempts(**_retry_infra(what))


# Kinds of failure beside the contract breaks (CONTRACT_REASONS), what RolloutFailure.reason holds.
FAILURE_REASONS = CONTRACT_REASONS + ("timeout", "unreachable", "infra", "dropped-by-environment", "exception")

# A failure keeps this much of its error and traceback: an exception may carry megabytes of text.
MAX_ERROR_CHARS = 2000
MAX_TRACEBACK_CHARS = 8000


def failure_reason(error: BaseException) -> str:
    """The kind of a failure (FAILURE_REASONS), what the rollout flow counts failures by."""
    if isinstance(error, InvalidGroupError):
        return error.reason
    if isinstance(error, GroupTimeoutError):
        return "timeout"
    if isinstance(error, PolicyServerUnreachable):
        return "unreachable"
    if isinstance(error, InfraError):
        return "infra"
    if isinstance(error, DroppedByEnvironment):
        return "dropped-by-environment"
    if isinstance(error, ValidationError):  # a ScoredSequence or ScoredGroup field of the wrong type
        return "invalid"
    return "exception"


class RolloutFailure(BaseModel):
    """A rollout or group that failed: recorded as data, never allowed to crash its siblings."""

    env: str
    item_id: str
    error: str
    traceback: str = ""
    reason: str = Field(default="exception", description=f"The kind of failure, one of {FAILURE_REASONS}.")

    @classmethod
    def of(cls, env: str, item_id: str, error: BaseException, traceback: str = "") -> RolloutFailure:
        message = f"{type(error).__name__}: {error}"
        if len(message) > MAX_ERROR_CHARS:
            message = message[:MAX_ERROR_CHARS] + f"... ({len(message):,} characters)"
        return cls(
            env=env,
            item_id=item_id,
            error=message,
            traceback=traceback[-MAX_TRACEBACK_CHARS:],
            reason=failure_reason(error),
        )


_NLTK_RESOURCE = re.compile(r"Resource '?([\w/.-]+?)'? not found")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # older NLTK colours the resource's name
_DOWNLOAD_ERRORS = {
    "URLError",
    "ConnectionError",
    "ConnectError",
    "gaierror",
    "OfflineModeIsEnabled",
    "LocalEntryNotFoundError",
}


def run_time_fetch(error: BaseException) -> str | None:
    """What an environment tried to download while it was being set up, when `error` (or an error
    it was raised from) says the download failed: a machine without the network, as many training
    clusters are. None for any other error."""
    seen: list[BaseException] = []
    while error is not None and error not in seen:
        seen.append(error)
        if isinstance(error, LookupError) and (match := _NLTK_RESOURCE.search(_ANSI.sub("", str(error)))):
            resource = match.group(1)
            return (
                f"NLTK's {resource!r} data (fetch it where the environment runs: python -m nltk.downloader {resource})"
            )
        if type(error).__name__ in _DOWNLOAD_ERRORS:
            return f"a download ({type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else 'no message'})"
        error = error.__cause__ or error.__context__
    return None


def fetch_failed(what: str, error: BaseException) -> str | None:
    """The message for `what` (an environment and its step) failing on a run-time download; None
    when `error` is not one."""
    fetch = run_time_fetch(error)
    if fetch is None:
        return None
    return (
        f"{what}: it downloads data at run time and could not: it tried to fetch {fetch}; provide it beforehand or "
        "give the environment the network"
    )
