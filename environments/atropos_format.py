"""Conversion between ScoredGroup and Atropos's ScoredDataGroup dict, so Atropos environments port.

Runs without atroposlib: the adapter (environments/adapters/atropos.py) converts with it inside its
own virtual environment, and anything else can read or write Atropos's format with it.
"""

from __future__ import annotations

import base64
import json
import math
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from core.scored_group import ScoredGroup, ScoredSequence, version_range

if TYPE_CHECKING:
    from environments.chat import Messages
    from inference.client import Completion

# Atropos marks untrained positions with -100 in `masks` and 1.0 in `inference_logprobs`
# (a logprob can never be positive, so 1.0 is unambiguous).
IGNORE_INDEX = -100
UNSAMPLED_LOGPROB = 1.0


def to_atropos(group: ScoredGroup) -> dict[str, Any]:
    """ScoredGroup -> Atropos ScoredDataGroup (tokens, masks, scores, advantages, inference_logprobs)."""
    sequences = group.sequences
    has_advantages = any(s.advantages is not None for s in sequences)
    has_messages = all(s.messages is not None for s in sequences)
    return {
        "tokens": [list(s.tokens) for s in sequences],
        "masks": [[t if m else IGNORE_INDEX for t, m in zip(s.tokens, s.mask)] for s in sequences],
        "scores": [s.score for s in sequences],
        "advantages": [s.advantages for s in sequences] if has_advantages else None,
        "ref_logprobs": None,
        "messages": [s.messages for s in sequences] if has_messages else None,
        "inference_logprobs": [
            [lp if m else UNSAMPLED_LOGPROB for lp, m in zip(s.logprobs, s.mask)] for s in sequences
        ],
        "group_overrides": dict(group.extras) or None,
        "overrides": [dict(s.extras) for s in sequences] if any(s.extras for s in sequences) else None,
    }


def _per_sequence(data: dict[str, Any], field: str, n: int) -> list[Any]:
    """A per-sequence field of a ScoredDataGroup, [None] * n when absent or empty (Atropos's own
    collect_trajectories leaves [] where no sequence set it)."""
    values = data.get(field) or [None] * n
    if len(values) != n:
        raise ValueError(
            f"Atropos group: {field} has {len(values)} entries for {n} sequences; give one per sequence or none"
        )
    return values


def from_atropos(
    data: dict[str, Any],
    *,
    env: str,
    item_id: str,
    policy_version: int = 0,
    finish_reasons: list[str] | None = None,
) -> ScoredGroup:
    """Atropos ScoredDataGroup -> ScoredGroup. Missing inference_logprobs become 0.0 (unknown);
    ref_logprobs keep their trained positions; `finish_reasons` (not part of Atropos's format) are
    the sequences' own when the caller knows them."""
    for required in ("tokens", "masks", "scores"):
        if required not in data:
            raise KeyError(f"Atropos group lacks {required!r}; a ScoredDataGroup has tokens, masks, scores")
    n = len(data["tokens"])
    logprobs = _per_sequence(data, "inference_logprobs", n)
    advantages = _per_sequence(data, "advantages", n)
    ref_logprobs = _per_sequence(data, "ref_logprobs", n)
    messages = _per_sequence(data, "messages", n)
    overrides = _per_sequence(data, "overrides", n)
    sequences = []
    for i in range(n):
        mask = [m != IGNORE_INDEX for m in data["masks"][i]]

        def trained_only(values: list[float] | None, mask: list[bool] = mask) -> list[float] | None:
            return None if values is None else [lp if m else 0.0 for lp, m in zip(values, mask)]

        sequences.append(
            ScoredSequence(
                tokens=list(data["tokens"][i]),
                mask=mask,
                logprobs=trained_only(logprobs[i]) or [0.0] * len(mask),
                score=float(data["scores"][i]),
                advantages=list(advantages[i]) if advantages[i] is not None else None,
                ref_logprobs=trained_only(ref_logprobs[i]),
                finish_reason=finish_reasons[i] if finish_reasons else "stop",
                messages=None if messages[i] is None else [dict(message) for message in messages[i]],
                extras=dict(overrides[i] or {}),
            )
        )
    return ScoredGroup(
        env=env,
        item_id=item_id,
        sequences=sequences,
        policy_version=policy_version,
        extras=dict(data.get("group_overrides") or {}),
    )


# ---- Atropos items as JSON ----------------------------------------------------------------------
# An Atropos item is whatever get_next_item returns: a dataset row, or often a tuple of frozensets
# of message items and the answer. These tags keep such values exact through JSON; a value of any
# other type is kept as {"__repr__": ...}, which reads back only as an error.
_TAGS = ("__tuple__", "__frozenset__", "__set__", "__bytes__", "__dict__", "__repr__")


def to_json_safe(value: Any) -> Any:
    """`value` as plain JSON values, tuples, sets, bytes and dicts with non-string keys tagged so
    that from_json_safe gives the same value back; sets in a stable order."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):  # numpy's integers and floats too
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, list):
        return [to_json_safe(v) for v in value]
    if isinstance(value, tuple):
        return {"__tuple__": [to_json_safe(v) for v in value]}
    if isinstance(value, (set, frozenset)):
        members = sorted((to_json_safe(v) for v in value), key=lambda v: json.dumps(v, sort_keys=True))
        return {"__frozenset__" if isinstance(value, frozenset) else "__set__": members}
    if isinstance(value, (bytes, bytearray)):
        return {"__bytes__": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not (len(value) == 1 and next(iter(value)) in _TAGS):
            return {k: to_json_safe(v) for k, v in value.items()}
        return {"__dict__": [[to_json_safe(k), to_json_safe(v)] for k, v in value.items()]}
    return {"__repr__": f"{type(value).__module__}.{type(value).__qualname__}: {value!r}"[:2000]}


def is_exact_json(value: Any) -> bool:
    """Whether from_json_safe gives back the value to_json_safe was given (no `__repr__`)."""
    if isinstance(value, list):
        return all(is_exact_json(v) for v in value)
    if isinstance(value, dict):
        return "__repr__" not in value and all(is_exact_json(v) for v in value.values())
    return True


def from_json_safe(value: Any) -> Any:
    """The value to_json_safe encoded; ValueError for one it could only describe (`__repr__`)."""
    if isinstance(value, list):
        return [from_json_safe(v) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        tag, inner = next(iter(value.items()))
        if tag == "__tuple__":
            return tuple(from_json_safe(v) for v in inner)
        if tag == "__frozenset__":
            return frozenset(from_json_safe(v) for v in inner)
        if tag == "__set__":
            return {from_json_safe(v) for v in inner}
        if tag == "__bytes__":
            return base64.b64decode(inner)
        if tag == "__dict__":
            return {from_json_safe(k): from_json_safe(v) for k, v in inner}
        if tag == "__repr__":
            raise ValueError(
                f"the value {inner[:200]} was stored as its description only (not a JSON, tuple, set or bytes "
                "value); only the process that handed it out holds it"
            )
    return {k: from_json_safe(v) for k, v in value.items()}


# Checking an Atropos environment's sequences against what the backend sampled (the adapter,
# environments/adapters/atropos.py, runs these on every group it converts).


def trained_runs(mask: list[int]) -> list[tuple[int, int]]:
    runs, start = [], None
    for i, token in enumerate([*mask, IGNORE_INDEX]):
        if token != IGNORE_INDEX and start is None:
            start = i
        elif token == IGNORE_INDEX and start is not None:
            runs.append((start, i))
            start = None
    return runs


def sampled_cover(
    tokens: list[int], runs: list[tuple[int, int]], sampled: dict[tuple[int, ...], list[Completion]]
) -> list[tuple[int, Completion]] | None:
    """The completions that make up every trained run, each where it starts, each sampled from
    exactly the ids before it; None when a run is anything else (re-tokenized text)."""
    cover = []
    for start, end in runs:
        position = start
        while position < end:
            fits = [
                c
                for c in sampled.get(tuple(tokens[:position]), ())
                if c.token_ids
                and tokens[position : position + len(c.token_ids)] == c.token_ids
                and position + len(c.token_ids) <= end
            ]
            if not fits:
                return None
            completion = max(fits, key=lambda c: len(c.token_ids))
            cover.append((position, completion))
            position += len(completion.token_ids)
    return cover


@dataclass
class SequenceCheck:
    """One sequence against what the backend sampled for its group."""

    exact: bool
    source: str  # where its logprobs come from: "environment", "sampler" or "rescored"
    logprobs: list[float] | None  # Atropos's convention (1.0 where untrained); None: rescore
    finish_reason: str
    policy_versions: tuple[int, int] | None = None  # of the completions that cover it, when they say


def check_sequence(
    tokens: list[int], masks: list[int], given: list[float] | None, sampled: dict[tuple[int, ...], list[Completion]]
) -> SequenceCheck:
    """Exact when every trained run is sampled completions (sampled_cover) and the environment's
    logprobs, if it gave them, are theirs. Logprobs of 1.0 on trained tokens (managed_server's
    filler where one was unknown) are no sampler's: they count as not given."""
    runs = trained_runs(masks)
    cover = sampled_cover(tokens, runs, sampled)
    trained = [j for start, end in runs for j in range(start, end)]
    if given is not None and (len(given) != len(tokens) or any(given[j] > 0 for j in trained)):
        given = None
    finish_reason = cover[-1][1].finish_reason if cover else "stop"
    ranges = [completion.policy_versions for _, completion in cover or ()]
    versions = version_range(ranges) if None not in ranges else None  # a part of unknown version: unknown
    if cover is None:
        if given is None:
            return SequenceCheck(False, "rescored", None, finish_reason)
        return SequenceCheck(False, "environment", list(given), finish_reason)
    from_sampler = [UNSAMPLED_LOGPROB] * len(tokens)
    for position, completion in cover:
        from_sampler[position : position + len(completion.token_ids)] = completion.logprobs
    if given is None:
        return SequenceCheck(True, "sampler", from_sampler, finish_reason, versions)
    exact = all(math.isclose(given[j], from_sampler[j], abs_tol=1e-6) for j in trained)
    return SequenceCheck(exact, "environment", list(given), finish_reason, versions)


def decoded_messages(tokenizer, tokens: list[int], runs: list[tuple[int, int]]) -> Messages:
    """A conversation read off the tokens: untrained runs as user turns, trained ones as assistant turns."""
    messages, position = [], 0
    for start, end in [*runs, (len(tokens), len(tokens))]:
        if start > position:
            messages.append(
                {"role": "user", "content": tokenizer.decode(tokens[position:start], skip_special_tokens=True)}
            )
        if end > start:
            messages.append(
                {"role": "assistant", "content": tokenizer.decode(tokens[start:end], skip_special_tokens=True)}
            )
        position = end
    return messages
