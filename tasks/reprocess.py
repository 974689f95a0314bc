"""Reprocessing operations over stored shards: pure functions from one shard's Arrow table to the
next, composed in the order given, each one readable on its own.

    filter       keep the rows matching every criterion given (env, policy_version, score, length,
                 finish_reason, groups whose scores differ, a SQL WHERE over the shard columns);
                 groups keep their remaining rows, renumbered; emptied groups go
    advantages   per-token advantages from the group's scores (grpo, mean_only, leave_one_out:
                 core.advantages.group_advantages), on the trained tokens
    dedupe       drop sequences whose (item_id, completion tokens) an earlier row already had
                 (in shard order over the whole input: a pass before the others, so it comes first)
    rescore      re-run an environment's `reward` on the stored conversations (decoded from the
                 stored tokens); the old score is kept in `previous_score`
    compact      merge the outputs of a partition's small shards into shards of about target_mb
    export-sft   the best completion of each group as a Hugging Face `datasets` Parquet row
    export-dpo   each group's (chosen, rejected) pair, by core.scored_group.preference_pair
                 (the exports: tasks/exports.py)

An operation is written as `NAME` or `NAME:key=value,key=value` (values are YAML: numbers, lists
`[a, b]`, strings; a value holding commas goes in quotes). Bad names, arguments or columns raise
ReprocessError naming the field and the fix before anything is written.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from core.advantages import group_advantages
from core.scored_group import ScoredGroup, ScoredSequence
from core.validation import describe_validation_error
from storage.reader import group_starts
from storage.schema import METADATA_NUM_GROUPS, table_to_groups
from trainer.config import AdvantageConfig


class ReprocessError(ValueError):
    """Bad reprocessing input (an operation, an argument, a column): says which and the fix."""


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FilterArgs(_Args):
    env: list[str] | None = Field(default=None, description="Keep these environments.")
    policy_version_min: int | None = None
    policy_version_max: int | None = None
    score_min: float | None = None
    score_max: float | None = None
    length_min: int | None = Field(default=None, description="Tokens of the sequence (prompt and completion).")
    length_max: int | None = None
    finish_reason: list[str] | None = Field(default=None, description="Keep these finish reasons, e.g. [stop].")
    drop_equal_scores: bool = Field(
        default=False, description="Drop groups whose scores are all equal (no GRPO signal)."
    )
    where: str | None = Field(
        default=None, description="A SQL WHERE over the shard columns (DuckDB), e.g. 'score > 0.5'."
    )


class AdvantagesArgs(_Args):
    mode: Literal["grpo", "mean_only", "leave_one_out"] = "grpo"
    eps: float = Field(default=1e-6, gt=0)


class DedupeArgs(_Args):
    pass


class RescoreArgs(_Args):
    env: str = Field(description="The environment whose reward scores: an installed name or module:Class.")
    env_config: dict[str, Any] = Field(default_factory=dict)
    tokenizer: str | None = Field(default=None, description="Decode with this tokenizer; must be the shards'.")


class CompactArgs(_Args):
    target_mb: float = Field(default=128.0, gt=0)


class ExportSFTArgs(_Args):
    min_score: float | None = Field(default=None, description="Skip groups whose best score is below this.")
    tokenizer: str | None = Field(default=None, description="For prompt/completion text when no messages are stored.")


class ExportDPOArgs(_Args):
    tokenizer: str | None = None


@dataclass(frozen=True)
class Operation:
    name: str
    args: _Args

    def describe(self) -> dict[str, Any]:
        return {"op": self.name, **self.args.model_dump(exclude_defaults=True)}


ARGS: dict[str, type[_Args]] = {
    "filter": FilterArgs,
    "advantages": AdvantagesArgs,
    "dedupe": DedupeArgs,
    "rescore": RescoreArgs,
    "compact": CompactArgs,
    "export-sft": ExportSFTArgs,
    "export-dpo": ExportDPOArgs,
}
EXPORTS = ("export-sft", "export-dpo")


def parse_operation(text: str) -> Operation:
    """`NAME` or `NAME:key=value,key=value` -> an Operation with checked arguments."""
    name, _, rest = text.partition(":")
    name = name.strip()
    if name not in ARGS:
        raise ReprocessError(f"operation {name!r}: unknown; use one of {', '.join(ARGS)}")
    raw: dict[str, Any] = {}
    for pair in _split_top_level(rest):
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ReprocessError(f"operation {name}: {pair!r} is not key=value (e.g. {name}:score_min=0.5)")
        raw[key.strip()] = yaml.safe_load(value) if value.strip() else None
    return make_operation(name, raw)


def make_operation(name: str, raw: dict[str, Any]) -> Operation:
    if name not in ARGS:
        raise ReprocessError(f"operation {name!r}: unknown; use one of {', '.join(ARGS)}")
    try:
        args = ARGS[name](**raw)
    except ValidationError as error:
        problems = describe_validation_error(error)
        known = ", ".join(ARGS[name].model_fields) or "none"
        raise ReprocessError(f"operation {name}: {problems} (its arguments: {known})") from None
    if name == "filter" and not args.model_dump(exclude_defaults=True):
        raise ReprocessError("operation filter: give at least one criterion, e.g. filter:score_min=0.5")
    return Operation(name, args)


def check_operations(operations: list[Operation]) -> list[Operation]:
    """The order rules: dedupe first (it sees the whole input), an export last, at most one export."""
    if not operations:
        raise ReprocessError("no operations: give at least one, e.g. filter:score_min=0.5 or export-sft")
    names = [op.name for op in operations]
    if "dedupe" in names and names.index("dedupe") != 0:
        raise ReprocessError("operation dedupe: put it first (it keeps the first occurrence in the input)")
    exports = [i for i, name in enumerate(names) if name in EXPORTS]
    if len(exports) > 1 or (exports and exports[0] != len(names) - 1):
        raise ReprocessError(f"operations {names}: one export at most, and it comes last")
    if exports and "compact" in names:
        raise ReprocessError("operations: compact merges shards and an export writes a dataset; use one of them")
    return operations


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside quotes, brackets and parentheses."""
    parts, depth, quote, current = [], 0, "", []
    for char in text:
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append("".join(current))
            current = []
            continue
        current.append(char)
    if "".join(current).strip():
        parts.append("".join(current))
    return [part for part in parts if part.strip()]


def completion_start(sequence: ScoredSequence) -> int:
    """Index of a sequence's first trained token: its prompt is the tokens before it."""
    return sequence.mask.index(True) if True in sequence.mask else len(sequence.tokens)


# --- the operations, table to table ------------------------------------------------------------


@dataclass
class Context:
    """What an operation may need beyond the table: rows to drop as duplicates, the rescorer."""

    duplicates: set[int] = field(default_factory=set)  # row indices of this shard
    rescore: Callable[[list[ScoredGroup]], list[list[float]]] | None = None


def take_rows(table: pa.Table, keep: np.ndarray) -> pa.Table:
    """The rows where `keep` is True, each group renumbered (sequence_index, group_size) and the
    shard's group count updated; groups left without a row are gone."""
    table = table.filter(pa.array(keep, pa.bool_()))
    if table.num_rows == 0:
        return table
    starts = group_starts(table)
    sizes = np.diff(np.append(starts, table.num_rows))
    index = np.arange(table.num_rows) - np.repeat(starts, sizes)
    table = table.set_column(
        table.schema.get_field_index("sequence_index"), "sequence_index", pa.array(index, pa.int32())
    )
    table = table.set_column(
        table.schema.get_field_index("group_size"), "group_size", pa.array(np.repeat(sizes, sizes), pa.int32())
    )
    metadata = {**table.schema.metadata, METADATA_NUM_GROUPS: str(len(starts)).encode()}
    return table.replace_schema_metadata(metadata)


def filter_rows(table: pa.Table, args: FilterArgs, context: Context) -> pa.Table:
    keep = np.ones(table.num_rows, dtype=bool)

    def within(values: np.ndarray, low, high) -> np.ndarray:
        result = np.ones(len(values), dtype=bool)
        if low is not None:
            result &= values >= low
        if high is not None:
            result &= values <= high
        return result

    if args.env is not None:
        keep &= pc.is_in(table.column("env"), pa.array(args.env)).to_numpy(zero_copy_only=False)
    keep &= within(table.column("policy_version").to_numpy(), args.policy_version_min, args.policy_version_max)
    keep &= within(table.column("score").to_numpy(), args.score_min, args.score_max)
    keep &= within(
        pc.list_value_length(table.column("tokens")).to_numpy(zero_copy_only=False), args.length_min, args.length_max
    )
    if args.finish_reason is not None:
        keep &= pc.is_in(table.column("finish_reason"), pa.array(args.finish_reason)).to_numpy(zero_copy_only=False)
    if args.drop_equal_scores:
        starts = group_starts(table)
        scores = table.column("score").to_numpy()
        differ = (
            np.maximum.reduceat(scores, starts) != np.minimum.reduceat(scores, starts)
            if len(starts)
            else np.array([], bool)
        )
        keep &= np.repeat(differ, np.diff(np.append(starts, table.num_rows)))
    if args.where is not None:
        keep &= where_rows(table, args.where)
    return take_rows(table, keep)


def where_rows(table: pa.Table, where: str) -> np.ndarray:
    """Rows matching a SQL WHERE clause (DuckDB over the Arrow table, no copy)."""
    import duckdb

    shard = table.append_column("__row", pa.array(np.arange(table.num_rows)))  # noqa: F841 - read by DuckDB
    try:
        rows = duckdb.sql(f"SELECT __row FROM shard WHERE {where}").fetchnumpy()["__row"]
    except duckdb.Error as error:
        columns = ", ".join(name for name in table.column_names)
        raise ReprocessError(
            f"operation filter: where {where!r}: {str(error).splitlines()[0]} (columns: {columns})"
        ) from None
    keep = np.zeros(table.num_rows, dtype=bool)
    keep[np.asarray(rows, dtype=np.int64)] = True
    return keep


def recompute_advantages(table: pa.Table, args: AdvantagesArgs, context: Context) -> pa.Table:
    """Every sequence's advantage from its group's scores, on each trained token (0 elsewhere)."""
    config = AdvantageConfig(mode=args.mode, eps=args.eps)
    starts = group_starts(table)
    ends = np.append(starts[1:], table.num_rows)
    scores = table.column("score").to_numpy()
    per_sequence = (
        np.concatenate(
            [group_advantages(scores[a:b].tolist(), config.mode, config.eps) for a, b in zip(starts, ends, strict=True)]
        )
        if len(starts)
        else np.zeros(0)
    )
    mask = table.column("mask").combine_chunks()
    trained = mask.values.to_numpy(zero_copy_only=False)
    owner = pc.list_parent_indices(mask).to_numpy()
    values = np.where(trained, per_sequence[owner], 0.0).astype(np.float32)
    advantages = pa.ListArray.from_arrays(mask.offsets, pa.array(values, pa.float32()))
    return table.set_column(table.schema.get_field_index("advantages"), "advantages", advantages)


def completion_key(item_id: str, tokens: np.ndarray, mask: np.ndarray) -> bytes:
    """What dedupe compares: the item and the tokens from the first trained one on."""
    first = int(np.argmax(mask)) if mask.any() else len(tokens)
    return hashlib.blake2b(
        item_id.encode() + b"\0" + tokens[first:].astype(np.int32).tobytes(), digest_size=16
    ).digest()


def duplicate_rows(table: pa.Table, seen: set[bytes]) -> set[int]:
    """Rows of `table` whose key is in `seen` or earlier in the table; adds the new keys to `seen`."""
    tokens, mask = table.column("tokens").combine_chunks(), table.column("mask").combine_chunks()
    token_values, mask_values = tokens.values.to_numpy(), mask.values.to_numpy(zero_copy_only=False)
    offsets = tokens.offsets.to_numpy()
    items = table.column("item_id").to_pylist()
    duplicates = set()
    for row in range(table.num_rows):
        a, b = offsets[row], offsets[row + 1]
        key = completion_key(items[row], token_values[a:b], mask_values[a:b])
        if key in seen:
            duplicates.add(row)
        else:
            seen.add(key)
    return duplicates


def dedupe(table: pa.Table, args: DedupeArgs, context: Context) -> pa.Table:
    keep = np.ones(table.num_rows, dtype=bool)
    keep[list(context.duplicates)] = False
    return take_rows(table, keep)


def rescore(table: pa.Table, args: RescoreArgs, context: Context) -> pa.Table:
    if context.rescore is None:
        raise ReprocessError("operation rescore: no environment to score with was set up")
    groups = table_to_groups(table, validated=True)
    scores = [score for group_scores in context.rescore(groups) for score in group_scores]
    previous = table.column("score")
    table = table.set_column(table.schema.get_field_index("score"), "score", pa.array(scores, pa.float64()))
    kept = table.column("previous_score")
    # A rescored shard rescored again keeps the first score it had.
    first = pc.if_else(pc.is_null(kept), previous, kept)
    return table.set_column(table.schema.get_field_index("previous_score"), "previous_score", first)


def make_rescorer(args: RescoreArgs, shard_tokenizer: str) -> Callable[[list[ScoredGroup]], list[list[float]]]:
    """A function from groups to their new scores: the environment's `reward` of each stored
    conversation, single-turn ones rebuilt from the item and the decoded completion tokens."""
    from environments.base import prompt_messages
    from environments.loading import EnvironmentLoadError, load_config, load_environment_class

    if args.tokenizer is not None and args.tokenizer != shard_tokenizer:
        raise ReprocessError(
            f"operation rescore: tokenizer {args.tokenizer!r} is not the shards' ({shard_tokenizer!r}); their "
            "token ids only decode with that one: leave tokenizer out or reprocess shards of that tokenizer"
        )
    try:
        env_class = load_environment_class(args.env)
        env = env_class(load_config(env_class, args.env_config), client=None, tokenizer=shard_tokenizer)
    except (EnvironmentLoadError, ValueError, OSError) as error:
        raise ReprocessError(f"operation rescore: env {args.env!r}: {error}") from None

    def conversation(group: ScoredGroup, item: Any, index: int) -> list[dict[str, Any]]:
        sequence = group.sequences[index]
        first = completion_start(sequence)
        single_turn = all(sequence.mask[first:])
        if single_turn:
            return prompt_messages(item) + [
                {"role": "assistant", "content": env.renderer.decode(sequence.tokens[first:])}
            ]
        if sequence.messages:
            return sequence.messages  # multi-turn: tool outputs between the turns are not the model's
        raise ReprocessError(
            f"group {group.group_id}: sequences[{index}] is multi-turn and stores no messages to rescore"
        )

    def scores(groups: list[ScoredGroup]) -> list[list[float]]:
        result = []
        for group in groups:
            stored = group.extras.get("item")
            if stored is None:
                raise ReprocessError(
                    f"operation rescore: group {group.group_id} (env {group.env}) stores no item (written before "
                    "clotho kept items in group extras); rescore shards written since"
                )
            item = env.item_class.model_validate(stored)
            result.append([float(env.reward(item, conversation(group, item, i))) for i in range(len(group.sequences))])
        return result

    return scores


TABLE_OPERATIONS: dict[str, Callable[[pa.Table, Any, Context], pa.Table]] = {
    "filter": filter_rows,
    "advantages": recompute_advantages,
    "dedupe": dedupe,
    "rescore": rescore,
    "compact": lambda table, args, context: table,  # merging is the flow's, over several shards
}


def apply(table: pa.Table, operations: list[Operation], context: Context) -> pa.Table:
    """The table after every non-export operation, in order."""
    for operation in operations:
        if operation.name in TABLE_OPERATIONS and table.num_rows:
            table = TABLE_OPERATIONS[operation.name](table, operation.args, context)
    return table
