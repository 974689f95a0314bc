"""Failed rollouts as data: what kind of failure, and the record the rollout flow keeps of it."""

from __future__ import annotations

from pydantic import BaseModel, Field, ValidationError

from core.scored_group import CONTRACT_REASONS, InvalidGroupError
from inference.client import PolicyServerUnreachable


class GroupTimeoutError(TimeoutError):
    """A group ran past its environment's group_timeout_s and was cut."""


# Kinds of failure beside the contract breaks (CONTRACT_REASONS), what RolloutFailure.reason holds.
FAILURE_REASONS = CONTRACT_REASONS + ("timeout", "unreachable", "exception")

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
            env=env, item_id=item_id, error=message, traceback=traceback[-MAX_TRACEBACK_CHARS:],
            reason=failure_reason(error),
        )  # fmt: skip
