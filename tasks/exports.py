"""The export operations of reprocessing (tasks/reprocess.py): a shard's groups as Hugging Face
`datasets` rows, the best completion of each group (export-sft) or its preference pair
(export-dpo, by core.scored_group.preference_pair, as the DPO objective reads pairs)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from core.scored_group import ScoredGroup, preference_pair
from tasks.reprocess import ExportDPOArgs, ExportSFTArgs, completion_start


def _texts(group: ScoredGroup, index: int, decode: Callable[[list[int]], str] | None) -> dict[str, Any]:
    """messages when stored, else prompt/completion text (decoded), and the token ids either way."""
    sequence = group.sequences[index]
    first = completion_start(sequence)
    row: dict[str, Any] = {"prompt_token_ids": sequence.tokens[:first], "completion_token_ids": sequence.tokens[first:]}
    if sequence.messages:
        row["messages"] = json.dumps(sequence.messages)
    if decode is not None:
        row["prompt"], row["completion"] = decode(sequence.tokens[:first]), decode(sequence.tokens[first:])
    return row


def export_sft(
    groups: list[ScoredGroup], args: ExportSFTArgs, decode: Callable[[list[int]], str] | None
) -> list[dict[str, Any]]:
    rows = []
    for group in groups:
        scores = group.scores
        best = scores.index(max(scores))
        if args.min_score is not None and scores[best] < args.min_score:
            continue
        rows.append(
            {
                "env": group.env,
                "item_id": group.item_id,
                "group_id": group.group_id,
                "score": scores[best],
                **_texts(group, best, decode),
            }
        )
    return rows


def export_dpo(
    groups: list[ScoredGroup], args: ExportDPOArgs, decode: Callable[[list[int]], str] | None
) -> list[dict[str, Any]]:
    rows = []
    for group in groups:
        pair = preference_pair(group)
        if pair is None:
            continue
        chosen, rejected = (_texts(group, index, decode) for index in pair)
        rows.append(
            {
                "env": group.env,
                "item_id": group.item_id,
                "group_id": group.group_id,
                "prompt_token_ids": chosen["prompt_token_ids"],
                "chosen_token_ids": chosen["completion_token_ids"],
                "rejected_token_ids": rejected["completion_token_ids"],
                "chosen_score": group.scores[pair[0]],
                "rejected_score": group.scores[pair[1]],
                **(
                    {"chosen_messages": chosen["messages"], "rejected_messages": rejected["messages"]}
                    if "messages" in chosen and "messages" in rejected
                    else {}
                ),
                **(
                    {"prompt": chosen["prompt"], "chosen": chosen["completion"], "rejected": rejected["completion"]}
                    if "prompt" in chosen
                    else {}
                ),
            }
        )
    return rows


EXPORT_FUNCTIONS = {"export-sft": export_sft, "export-dpo": export_dpo}
