"""The trainer's input: the next whole groups of the shard stream, stale ones skipped and counted,
and the objective each group is trained with."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from core.polling import poll_delay
from core.scored_group import ScoredGroup, objective_problems
from storage.reader import ShardReader, TokenizerMismatchError

log = logging.getLogger(__name__)


class DataTimeoutError(TimeoutError):
    """No new groups arrived in time for a step."""


# Objectives whose groups are samples of the policy, so staleness applies; a demonstration or a
# stored preference pair is data of its own and never stale.
ON_POLICY_OBJECTIVES = ("rl", "distill")


def group_objective(group: ScoredGroup, default: str = "auto") -> str:
    """The objective a group trains with: its own `objective`, else `default`
    (TrainerConfig.objective), where "auto" means distill when every sequence carries teacher
    logprobs, sft for one sequence without per-token advantages (a demonstration: its group
    advantage is 0, so the policy loss would learn nothing from it), and rl for anything else.
    A preference pair is dpo only when it says so (or objective=dpo): two samples are also GRPO's."""
    if group.objective is not None:
        return group.objective
    if default != "auto":
        return default
    if all(sequence.teacher_logprobs is not None for sequence in group.sequences):
        return "distill"
    if len(group.sequences) == 1 and group.sequences[0].advantages is None:
        return "sft"
    return "rl"


def objective_problem(group: ScoredGroup, objective: str) -> str | None:
    """Why `group` cannot be trained with `objective` (its group_objective), or None. The trainer
    skips such a group (consumed, logged, counted as rejected) rather than failing the step."""
    for index, sequence in enumerate(group.sequences):
        if not any(sequence.mask[1:]):
            return (
                f"sequences[{index}].mask: no trained token after the first (nothing predicts a "
                "sequence's first token); put the prompt before the trained completion"
            )
    problems = objective_problems(group, objective)
    return problems[0] if problems else None


def is_stale(group_policy_version: int, *, policy_version: int, max_lag: int) -> bool:
    """The one staleness rule, the trainer's and the samplers' admission's (flows.admission.admits):
    a group whose oldest sampling version (ScoredGroup.policy_version: a sequence sampled across a
    reload counts from its first version) is more than `max_lag` versions older than
    `policy_version`, the weights about to be updated, is not trained on. It applies to on-policy
    objectives only (ON_POLICY_OBJECTIVES): a demonstration is never stale."""
    return policy_version - group_policy_version > max_lag


def next_step_groups(
    reader: ShardReader,
    count: int,
    *,
    policy_version: int,
    max_lag: int,
    timeout_s: float,
    objective: str = "auto",
    poll_s: float = 0.5,
    on_wait: Callable[[list[ScoredGroup]], None] | None = None,
    on_reject: Callable[[ScoredGroup, str], None] | None = None,
) -> tuple[list[ScoredGroup], list[ScoredGroup]]:
    """The next `count` fresh groups in shard order, and the stale ones skipped on the way.

    A stale on-policy group (`is_stale`; `objective` is the trainer's default) is consumed, so the ledger records it, but not returned. Waits,
    looking again on core.polling's schedule (every 0.05 s for the first seconds of a wait, in a
    loop the groups come a fraction of a second after the step asks, then every `poll_s`), until
    enough groups exist; raises DataTimeoutError after `timeout_s`
    seconds without a new group. The ledger then already holds the groups taken, so do not save
    it: resume from the last state. Before a wait that follows new stale (or rejected) groups,
    `on_wait` hears the stale groups consumed so far: the samplers must see them consumed, or they would wait for a
    trainer that waits for them. A group its objective cannot train (`objective_problem`) is
    consumed and skipped too; `on_reject` hears it with the reason (else it is logged).
    """
    fresh: list[ScoredGroup] = []
    stale: list[ScoredGroup] = []
    rejected = 0
    skipped_told = 0
    last_group = time.monotonic()
    wait_logged = False
    while True:
        for group in reader.groups():
            last_group = time.monotonic()
            wait_logged = False
            version = group.policy_version
            trained_as = group_objective(group, objective)
            problem = objective_problem(group, trained_as)
            if problem is not None:
                if on_reject is not None:
                    on_reject(group, problem)
                else:
                    log.warning("skipping group %s (env %s): %s", group.group_id, group.env, problem)
                rejected += 1
                continue
            if trained_as in ON_POLICY_OBJECTIVES and is_stale(version, policy_version=policy_version, max_lag=max_lag):
                stale.append(group)
                continue
            fresh.append(group)
            if len(fresh) == count:
                return fresh, stale
        waited = time.monotonic() - last_group
        if waited >= timeout_s:
            raise DataTimeoutError(
                f"{reader.url}: {len(fresh)} of {count} groups for the next step after "
                f"{waited:.0f}s without a new group ({len(stale)} stale ones skipped); are rollouts "
                "being written to this run? Raise --data-timeout to wait longer"
            )
        if not wait_logged:
            log.info("waiting for groups in %s (%d of %d so far)", reader.url, len(fresh), count)
            wait_logged = True
        if on_wait is not None and len(stale) + rejected != skipped_told:
            on_wait(stale)  # rejected groups are consumed too: the caller counts them (on_reject)
            skipped_told = len(stale) + rejected
        time.sleep(poll_delay(waited, poll_s))


@functools.lru_cache(maxsize=16)
def tokenizer_fingerprint(name: str) -> str | None:
    """A digest of a tokenizer's vocabulary and special tokens (what its ids mean), or None when
    `name` does not load here (a path on another machine, a hub id not downloaded)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=True)
    except Exception:  # noqa: BLE001 - whatever keeps it from loading, it cannot be compared
        return None
    identity = [sorted(tokenizer.get_vocab().items()), sorted(map(str, tokenizer.all_special_tokens))]
    return hashlib.sha256(json.dumps(identity).encode()).hexdigest()


def tokenizer_problem(shard_tokenizer: str, model: str) -> str | None:
    """Why ids from `shard_tokenizer` (a shard's footer) do not mean to `model` what they meant
    when sampled, or None. The same name, or two tokenizers with the same vocabulary and special
    tokens (a model directory and its copy), agree; one that does not load here cannot be checked
    and is let through (logged)."""
    if shard_tokenizer == model:
        return None
    shard_print, model_print = tokenizer_fingerprint(shard_tokenizer), tokenizer_fingerprint(model)
    if shard_print is None or model_print is None:
        log.warning(
            "cannot compare the shards' tokenizer %r with the model's %r here; trusting it", shard_tokenizer, model
        )
        return None
    if shard_print == model_print:
        return None
    return (
        f"tokenized with {shard_tokenizer!r}, whose vocabulary differs from the tokenizer of the model {model!r}; "
        "train the model the run was sampled with (--model), or sample a new run with this one"
    )


def check_run_tokenizer(
    storage: str, run: str, model: str, *, storage_options: dict[str, Any] | None = None, sample: int = 4
) -> None:
    """Refuses, with TokenizerMismatchError, a run whose shards were tokenized by another tokenizer
    than `model`'s: their token ids would train the wrong tokens. Reads the footers of the run's
    first and last `sample` shards (one listing of the run, no rows); a run without shards passes."""
    from storage.layout import rollouts_url
    from storage.schema import METADATA_TOKENIZER, ShardFormatError
    from storage.shard_file import find_shards, read_footer

    fs, shards = find_shards(rollouts_url(storage, run), storage_options=storage_options)
    checked: set[str] = set()
    for shard in shards[:sample] + shards[-sample:]:
        try:
            metadata = read_footer(fs, shard).metadata or {}
        except (ShardFormatError, FileNotFoundError):  # the reader quarantines or passes it later
            continue
        tokenizer = metadata.get(METADATA_TOKENIZER, b"").decode()
        if not tokenizer or tokenizer in checked:
            continue
        checked.add(tokenizer)
        problem = tokenizer_problem(tokenizer, model)
        if problem is not None:
            raise TokenizerMismatchError(f"{shard.url} was {problem}")
