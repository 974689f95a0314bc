"""The dataset environment: rows of local JSONL and Parquet files through a column mapping, a seeded
stream and a held-out split, math-verify equivalences and timeouts (in a worker thread too), clear
errors for bad columns and paths, and the conformance suite against the live tiny server."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import environments.bundled.dataset as dataset_module
from environments.base import Item, prompt_messages
from environments.bundled.dataset import Dataset, last_boxed
from environments.testing import EnvironmentConformance

MATH_PROBLEMS = Path(__file__).parent / "data" / "math_problems"  # train.jsonl, test.jsonl: prompt, answer
ROWS = [
    {"question": f"What is {n} + {n}?", "solution": f"{n} + {n} = \\boxed{{{2 * n}}}", "level": n} for n in range(6)
]


def dataset(tokenizer, **config) -> Dataset:
    env = Dataset(config, client=None, tokenizer=tokenizer)
    asyncio.run(env.setup())
    return env


def answered(env: Dataset, item: Item, answer: str) -> float:
    return env.reward(item, prompt_messages(item) + [{"role": "assistant", "content": answer}])


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from environments.chat import load_tokenizer

    return load_tokenizer(str(tiny_model_dir))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("rows")
    jsonl, parquet = folder / "rows.jsonl", folder / "rows.parquet"
    jsonl.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    pq.write_table(pa.Table.from_pylist(ROWS), parquet)
    return {"jsonl": jsonl, "parquet": parquet}


@pytest.fixture(scope="module")
def math_env(tokenizer) -> Dataset:
    return dataset(tokenizer, source=str(MATH_PROBLEMS))


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_rows_through_the_column_mapping_in_a_seeded_stream(tokenizer, files, kind) -> None:
    config = dict(source=str(files[kind]), prompt_column="question", answer_column="solution", seed=7)
    env = dataset(tokenizer, **config, system_prompt="Be brief.", prompt_template="Q: {prompt}", cycle=False)
    items = [asyncio.run(env.get_item()) for _ in range(len(ROWS))]
    assert asyncio.run(env.get_item()) is None  # one epoch, then no more when cycle is False
    assert sorted(item.id for item in items) == [f"train-{n}" for n in range(len(ROWS))]
    n = int(items[0].id.split("-")[1])
    assert items[0].prompt == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": f"Q: What is {n} + {n}?"},
    ]
    assert items[0].answer == ROWS[n]["solution"] and env.gold_completion(items[0]) == f"\\boxed{{{2 * n}}}"
    again = dataset(tokenizer, **config, cycle=False)
    assert [asyncio.run(again.get_item()).id for _ in range(len(ROWS))] == [item.id for item in items]  # seeded
    other = dataset(tokenizer, **{**config, "seed": 8})
    assert [asyncio.run(other.get_item()).id for _ in range(len(ROWS))] != [item.id for item in items]
    cycling = [asyncio.run(other.get_item()) for _ in range(len(ROWS) + 2)]  # cycle (the default) starts over
    assert all(item is not None for item in cycling)
    assert (
        answered(env, items[0], f"It is \\boxed{{{2 * n}}}.") == 1.0 and answered(env, items[0], "\\boxed{-1}") == 0.0
    )


def test_the_held_out_split_when_the_source_has_one(tokenizer, math_env, files) -> None:
    assert asyncio.run(math_env.get_item()).id.startswith("train-")
    held_out = [asyncio.run(math_env.get_eval_item()).id for _ in range(3)]
    assert sorted(held_out) == ["test-0", "test-1", "test-2"]
    one_file = dataset(tokenizer, source=str(files["jsonl"]), prompt_column="question", answer_column="solution")
    assert asyncio.run(one_file.get_eval_item()).id.startswith("train-")  # no test split: the base default


@pytest.mark.parametrize(
    ("gold", "answer", "score"),
    [
        ("\\frac{1}{2}", "0.5", 1.0),
        ("\\frac{1}{2}", "1/2", 1.0),
        ("0.5", "\\boxed{\\frac{1}{2}}", 1.0),
        ("1/2", "The answer is $\\frac{1}{2}$.", 1.0),
        ("\\frac{1}{2}", "\\boxed{2/4}", 1.0),
        ("\\boxed{3}", "3", 1.0),
        ("3", "\\boxed{3}", 1.0),
        ("3", "First 2, then add 1: so 3", 1.0),  # no box: the last number
        ("3", "\\boxed{3} no, wait: \\boxed{4}", 0.0),  # the last box is the answer
        ("\\frac{1}{2}", "\\boxed{0.51}", 0.0),
        ("3", "\\boxed{-3}", 0.0),
        ("3", "no idea", 0.0),
        ("3", "", 0.0),
        ("6 - 5i", "\\boxed{6-5i}", 1.0),  # a bare gold reads as LaTeX, not as its last number
        ("\\left( 3, \\frac{\\pi}{2} \\right)", "\\boxed{(3, \\pi/2)}", 1.0),
        ("48 / 2 = <<48/2=24>>24 in May, 48 + 24 = <<48+24=72>>72 in all.\n#### 72", "\\boxed{72}", 1.0),
    ],
)
def test_math_verify_equivalences(math_env, gold, answer, score) -> None:
    assert answered(math_env, Item(id="q", prompt="?", answer=gold), answer) == score


def test_gold_completions_are_boxed_and_score_top(math_env) -> None:
    for gold, boxed in [
        ("0.5", "\\boxed{\\frac{1}{2}}"),
        ("So \\boxed{7}.", "\\boxed{7}"),
        ("a\n#### 72", "\\boxed{72}"),
    ]:
        item = Item(id="q", prompt="?", answer=gold)
        assert math_env.gold_completion(item) == boxed and answered(math_env, item, boxed) == 1.0
    assert last_boxed("x \\boxed{\\frac{1}{2}} y") == "\\frac{1}{2}" and last_boxed("\\boxed{1") is None


def test_text_answers_match_ignoring_case_and_spacing(tokenizer, files) -> None:
    env = dataset(
        tokenizer, source=str(files["jsonl"]), prompt_column="question", answer_column="level", answer_format="text"
    )
    item = Item(id="q", prompt="?", answer="New  York")
    assert answered(env, item, "It is \\boxed{new york}") == 1.0 and answered(env, item, "new york") == 1.0
    assert answered(env, item, "\\boxed{York}") == 0.0 and env.gold_completion(item) == "\\boxed{New  York}"


def test_reward_in_a_worker_thread_and_a_runaway_answer_times_out(math_env) -> None:
    item = Item(id="q", prompt="?", answer="3")
    scores: dict[str, float] = {}

    def score_in_thread() -> None:  # as a Prefect worker thread does, where SIGALRM cannot be set
        for answer in ("\\boxed{3}", "\\boxed{4}", "\\boxed{9^{9^{9^{9}}}}"):
            scores[answer] = answered(math_env, item, answer)

    started = time.monotonic()
    thread = threading.Thread(target=score_in_thread)
    thread.start()
    thread.join(timeout=60)
    assert scores == {"\\boxed{3}": 1.0, "\\boxed{4}": 0.0, "\\boxed{9^{9^{9^{9}}}}": 0.0}
    assert time.monotonic() - started < 20  # math-verify's alarm in the child stopped the runaway power

    async def in_tasks() -> list[float]:
        return await asyncio.gather(
            *(asyncio.to_thread(answered, math_env, item, f"\\boxed{{{n}}}") for n in (3, 3.0, 5))
        )

    assert asyncio.run(in_tasks()) == [1.0, 1.0, 0.0]


def test_a_child_past_its_deadline_is_replaced(math_env, monkeypatch) -> None:
    item = Item(id="q", prompt="?", answer="3")
    monkeypatch.setattr(dataset_module, "VERIFY_SECONDS", 0.5)  # under math-verify's own 2 s alarm
    stuck = dataset_module.math_child.process
    assert answered(math_env, item, "\\boxed{9^{9^{9^{9}}}}") == 0.0 and stuck.poll() is not None  # killed
    monkeypatch.setattr(dataset_module, "VERIFY_SECONDS", 30.0)
    assert answered(math_env, item, "\\boxed{3}") == 1.0 and dataset_module.math_child.process is not stuck


def test_bad_columns_splits_and_paths_are_named(tokenizer, files, tmp_path) -> None:
    with pytest.raises(
        ValueError, match=r"prompt_column: .* has no column 'prompt' \(columns: \['question', 'solution', 'level'\]\)"
    ):
        dataset(tokenizer, source=str(files["parquet"]), answer_column="solution")
    with pytest.raises(ValueError, match=r"answer_column: .* split train has no column 'final'"):
        dataset(tokenizer, source=str(MATH_PROBLEMS), answer_column="final")
    with pytest.raises(ValueError, match=r"split: .* has no split 'validation' \(splits: \['test', 'train'\]\)"):
        dataset(tokenizer, source=str(MATH_PROBLEMS), split="validation")
    with pytest.raises(FileNotFoundError, match=r"source: no file or directory '.*missing.jsonl'"):
        dataset(tokenizer, source=str(tmp_path / "missing.jsonl"))
    (tmp_path / "rows.txt").write_text("hello")
    with pytest.raises(ValueError, match=r"source: .*rows.txt' is not a .jsonl/.json/.parquet/.csv file"):
        dataset(tokenizer, source=str(tmp_path / "rows.txt"))
    with pytest.raises(ValueError, match=r"prompt_template has no \{prompt\}"):
        Dataset({"source": "x", "prompt_template": "Q:"}, client=None, tokenizer=tokenizer)


@pytest.mark.integration
class TestDatasetConformance(EnvironmentConformance):
    environment_class = Dataset
    config = {"source": str(MATH_PROBLEMS), "group_size": 3, "max_tokens": 8}
