"""Each reprocessing operation on small hand-made shards, with exact expected outputs, and the
operation grammar's errors (tasks/reprocess.py)."""

from __future__ import annotations

import asyncio

import pytest

from core.scored_group import ScoredGroup, ScoredSequence
from environments.base import prompt_messages
from environments.bundled.compare import Compare
from storage.schema import groups_to_table, table_to_groups
from tasks.exports import export_dpo, export_sft
from tasks.reprocess import (
    Context,
    ReprocessError,
    apply,
    check_operations,
    duplicate_rows,
    make_operation,
    make_rescorer,
    parse_operation,
)


def sequence(completion: list[int], score: float, finish_reason: str = "stop", **fields) -> ScoredSequence:
    return ScoredSequence.from_prompt(
        [1, 2], completion, [-0.5] * len(completion), score=score, finish_reason=finish_reason, **fields
    )


def group(item_id: str, *sequences: ScoredSequence, env: str = "a", policy_version: int = 0) -> ScoredGroup:
    return ScoredGroup(env=env, item_id=item_id, sequences=list(sequences), policy_version=policy_version)


def table(*groups: ScoredGroup):
    return groups_to_table(list(groups), "tok")


def run(operations: list[str], source, context: Context | None = None) -> list[ScoredGroup]:
    ops = check_operations([parse_operation(text) for text in operations])
    return table_to_groups(apply(source, ops, context or Context()))


def test_filter_keeps_matching_rows_and_renumbers_their_groups() -> None:
    source = table(
        group("x", sequence([3], 1.0), sequence([4, 5], 0.0), sequence([6], 0.75, "length")),
        group("y", sequence([7], 0.0), sequence([8], 0.25), env="b", policy_version=2),
        group("z", sequence([9], 0.5), sequence([9, 9], 0.5)),
    )
    kept = run(["filter:score_min=0.5"], source)
    assert [(g.item_id, g.scores) for g in kept] == [("x", [1.0, 0.75]), ("z", [0.5, 0.5])]
    again = table_to_groups(groups_to_table(kept, "tok"))  # renumbered: a valid shard again
    assert [len(g.sequences) for g in again] == [2, 2]
    assert [g.item_id for g in run(["filter:drop_equal_scores=true"], source)] == ["x", "y"]
    assert [(g.item_id, g.scores) for g in run(["filter:env=[b],policy_version_min=1"], source)] == [("y", [0.0, 0.25])]
    assert [g.scores for g in run(["filter:finish_reason=[stop],length_max=3"], source)] == [[1.0], [0.0, 0.25], [0.5]]
    where = run(["filter:where=\"len(tokens) = 4 AND env IN ('a', 'b')\""], source)
    assert [(g.item_id, g.scores) for g in where] == [("x", [0.0]), ("z", [0.5])]
    assert run(["filter:score_min=5"], source) == []


def test_filter_with_an_unknown_column_names_the_columns() -> None:
    with pytest.raises(ReprocessError, match=r"where 'no_such > 1'.*no_such.*\(columns: env, policy_version"):
        run(["filter:where=no_such > 1"], table(group("x", sequence([3], 1.0))))


def test_advantages_from_scores_on_the_trained_tokens() -> None:
    source = table(
        group("x", sequence([3, 4], 3.0), sequence([5], 1.0), sequence([6], 2.0)), group("y", sequence([7], 1.0))
    )
    x, y = run(["advantages:mode=leave_one_out"], source)
    assert [s.advantages for s in x.sequences] == [[0.0, 0.0, 1.5, 1.5], [0.0, 0.0, -1.5], [0.0, 0.0, 0.0]]
    assert y.sequences[0].advantages == [0.0, 0.0, 0.0]  # a group of one: no signal
    x, _ = run(["advantages:mode=mean_only"], source)
    assert [s.advantages[-1] for s in x.sequences] == [1.0, -1.0, 0.0]


def test_dedupe_drops_later_copies_of_a_completion_of_the_same_item() -> None:
    first = table(group("x", sequence([3], 1.0), sequence([3], 0.0), sequence([4], 1.0)))
    second = table(group("x", sequence([4], 0.5), sequence([5], 0.5)), group("y", sequence([3], 1.0)))
    seen: set[bytes] = set()
    duplicates = [duplicate_rows(first, seen), duplicate_rows(second, seen)]
    assert duplicates == [{1}, {0}]  # same item, same completion tokens; item y's [3] is another item's
    kept = [run(["dedupe"], t, Context(duplicates=d)) for t, d in zip((first, second), duplicates, strict=True)]
    assert [[(g.item_id, [s.tokens[-1] for s in g.sequences]) for g in gs] for gs in kept] == [
        [("x", [3, 4])],
        [("x", [5]), ("y", [3])],
    ]


def test_rescore_reruns_the_environments_reward_and_keeps_the_old_score(tiny_model_dir) -> None:
    env = Compare({"max_value": 9, "seed": 1}, client=None, tokenizer=str(tiny_model_dir))
    asyncio.run(env.setup())
    item = asyncio.run(env.get_item())
    prompt = env.renderer.prompt_ids(prompt_messages(item))
    right, wrong = (env.renderer.encode(str(answer)) for answer in (item.answer, item.answer + 1))
    stored = env.make_group(
        item,
        [  # scored the wrong way round: rescore puts it right
            ScoredSequence.from_prompt(prompt, right, [-0.5] * len(right), score=0.0),
            ScoredSequence.from_prompt(prompt, wrong, [-0.5] * len(wrong), score=1.0),
        ],
    )
    source = groups_to_table([stored], str(tiny_model_dir))
    operation = make_operation("rescore", {"env": "compare", "env_config": {"max_value": 9}})
    context = Context(rescore=make_rescorer(operation.args, str(tiny_model_dir)))
    [rescored] = table_to_groups(apply(source, [operation], context))
    assert rescored.scores == [1.0, 0.0] and [s.previous_score for s in rescored.sequences] == [0.0, 1.0]
    [twice] = table_to_groups(apply(groups_to_table([rescored], str(tiny_model_dir)), [operation], context))
    assert [s.previous_score for s in twice.sequences] == [0.0, 1.0]  # the first score stays
    with pytest.raises(ReprocessError, match="tokenizer 'other' is not the shards'"):
        make_rescorer(make_operation("rescore", {"env": "compare", "tokenizer": "other"}).args, str(tiny_model_dir))
    without_item = stored.model_copy(update={"extras": {}})
    with pytest.raises(ReprocessError, match="stores no item"):
        apply(groups_to_table([without_item], str(tiny_model_dir)), [operation], context)


def test_exports_take_the_best_completion_and_the_preference_pair() -> None:
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    groups = [
        group("x", sequence([3], 0.0), sequence([4, 5], 1.0, messages=messages), sequence([6], 0.5)),
        group("tie", sequence([7], 1.0), sequence([8], 1.0)),
    ]
    sft = export_sft(groups, make_operation("export-sft", {}).args, decode=lambda ids: " ".join(map(str, ids)))
    assert [(r["item_id"], r["completion_token_ids"], r["score"], r["completion"]) for r in sft] == [
        ("x", [4, 5], 1.0, "4 5"),
        ("tie", [7], 1.0, "7"),
    ]
    assert sft[0]["prompt_token_ids"] == [1, 2] and "messages" in sft[0] and "messages" not in sft[1]
    assert export_sft(groups, make_operation("export-sft", {"min_score": 2}).args, decode=None) == []
    [pair] = export_dpo(groups, make_operation("export-dpo", {}).args, decode=None)  # the tie has no pair
    assert (pair["chosen_token_ids"], pair["rejected_token_ids"], pair["chosen_score"], pair["rejected_score"]) == (
        [4, 5],
        [3],
        1.0,
        0.0,
    )


@pytest.mark.parametrize(
    ("operations", "message"),
    [
        (["shuffle"], "operation 'shuffle': unknown; use one of filter, advantages"),
        (["filter"], "give at least one criterion"),
        (["filter:score_minimum=1"], "score_minimum: unknown field; check the spelling"),
        (["advantages:mode=ppo"], "operation advantages: mode: Input should be 'grpo', 'mean_only' or 'leave_one_out'"),
        (["filter:score_min"], "'score_min' is not key=value"),
        (["filter:score_min=1", "dedupe"], "operation dedupe: put it first"),
        (["export-sft", "filter:score_min=1"], "one export at most, and it comes last"),
        ([], "no operations"),
    ],
)
def test_bad_operations_are_named_with_the_fix(operations, message) -> None:
    with pytest.raises(ReprocessError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_operations([parse_operation(text) for text in operations])
