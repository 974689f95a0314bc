"""The code-execution environment: rewards from running hand-written answers against the hidden
asserts, the traceback lines' tokens given extra negative advantage, and the conformance suite
against the live tiny server."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from environments.bundled.code_exec import CodeExec, CodeItem, token_spans
from environments.bundled.code_tasks import TASKS
from environments.testing import EnvironmentConformance
from inference.client import Completion
from trainer.advantages import sequence_token_advantages
from trainer.config import AdvantageConfig


@pytest.fixture(scope="module")
def env(tiny_model_dir) -> CodeExec:
    env = CodeExec({"seed": 0}, client=None, tokenizer=str(tiny_model_dir))
    asyncio.run(env.setup())
    return env


def answer(code: str) -> str:
    return f"Here is the function:\n```python\n{code}\n```\nDone."


def score(env: CodeExec, item: CodeItem, text: str) -> float:
    return env.reward(item, [{"role": "user", "content": "task"}, {"role": "assistant", "content": text}])


def sampled(env: CodeExec, text: str) -> Completion:
    """The model's words as token ids, as vLLM returns them."""
    ids = env.renderer.encode(text) + [env.renderer.eos_token_id]
    return Completion(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop", text=text)


def test_every_tasks_solution_scores_one_and_wrong_code_scores_its_share(env) -> None:
    items = [CodeItem(id=task["id"], prompt="p", tests=task["tests"], solution=task["solution"]) for task in TASKS]
    with ThreadPoolExecutor(4) as pool:
        scores = list(pool.map(lambda item: score(env, item, env.gold_completion(item)), items))
    assert scores == [1.0] * len(TASKS) and len({item.id for item in items}) == len(TASKS) >= 10
    fizzbuzz = next(item for item in items if item.id == "fizzbuzz")
    no_fizzbuzz = "def fizzbuzz(n):\n    if n % 3 == 0:\n        return 'Fizz'\n    if n % 5 == 0:\n        return 'Buzz'\n    return str(n)"
    assert score(env, fizzbuzz, answer(no_fizzbuzz)) == 0.75  # 3 of its 4 asserts
    assert score(env, fizzbuzz, "fizzbuzz is easy") == 0.0  # no python block


def test_timeouts_exits_and_forged_counts_score_zero_every_time(env) -> None:
    item = CodeItem(id="add", prompt="p", tests=["assert add(1, 2) == 3"], solution="def add(a, b):\n    return a + b")
    env = CodeExec({"limits": {"cpu_seconds": 1}}, client=None, tokenizer=env.tokenizer)
    cheats = [
        "def add(a, b):\n    while True:\n        pass",  # an endless loop is a failure
        "def add(a, b):\n    return a + b\nimport os\nos._exit(0)",  # exits before the count is reported
        "def add(a, b):\n    return a + b\nimport os\nprint('0' * 32, 1, flush=True)\nos._exit(0)",  # forges a count line
    ]
    for code in cheats:
        assert [score(env, item, answer(code)) for _ in range(2)] == [0.0, 0.0], code
    assert score(env, item, answer("def add(a, b):\n    return a + b")) == 1.0


def test_under_a_cpu_hog_a_correct_answer_scores_right_or_fails_as_infra_never_zero(env) -> None:
    """The host leaves the sandbox about a tenth of a core: a correct answer is scored 1 or its
    group fails as `infra` after the sandbox's tries, and is never scored 0. An endless loop still
    scores 0 on a host that gives it its CPU."""
    from clotho.testing.cpu_hog import cpu_hog
    from environments.failures import InfraError, failure_reason

    limits = {"limits": {"wall_seconds": 1.5, "cpu_seconds": 2}}
    loaded = CodeExec(limits, client=None, tokenizer=env.tokenizer)
    items = [CodeItem(id=task["id"], prompt="p", tests=task["tests"], solution=task["solution"]) for task in TASKS[:4]]
    # A correct answer that spends 0.4 s of CPU: 4 s of wall time at a tenth of a core.
    slow = "import time\n_end = time.process_time() + 0.4\nwhile time.process_time() < _end:\n    pass\n"

    def verdict(item: CodeItem) -> float | str:
        try:
            return score(loaded, item, answer(slow + item.solution))
        except InfraError as error:  # every try starved: the group fails as `infra`
            return failure_reason(error)

    with cpu_hog(), ThreadPoolExecutor(len(items)) as pool:
        outcomes = list(pool.map(verdict, items))
    assert all(outcome in (1.0, "infra") for outcome in outcomes), outcomes
    assert "infra" in outcomes, outcomes  # the hog did starve the sandbox
    assert [score(env, item, answer(slow + item.solution)) for item in items] == [1.0] * len(
        items
    )  # a host that gives it a CPU
    endless = CodeExec({"limits": {"cpu_seconds": 1}}, client=None, tokenizer=env.tokenizer)
    add = CodeItem(id="add", prompt="p", tests=["assert add(1, 2) == 3"], solution="def add(a, b):\n    return a + b")
    assert score(endless, add, answer("def add(a, b):\n    while True:\n        pass")) == 0.0


def test_the_lines_a_traceback_names_get_the_extra_negative_advantage(env) -> None:
    item = CodeItem(
        id="mean",
        prompt=[{"role": "user", "content": "Write mean(values)."}],
        tests=["assert mean([1, 2, 3]) == 2", "assert mean([4]) == 4"],
        solution="",
    )
    right = answer("def mean(values):\n    return sum(values) / len(values)")
    failing = answer(
        "def mean(values):\n    total = sum(values)\n    label = 'café: ' + total\n    return total / len(values)"
    )
    prompt_ids = env.renderer.prompt_ids(item.prompt)
    group = asyncio.run(
        env.score_group(item, prompt_ids, [sampled(env, right), sampled(env, failing), sampled(env, "no code")])
    )
    assert group.scores == [1.0, 0.0, 0.0]
    ok, broken, empty = group.sequences
    assert ok.advantages is None and empty.advantages is None  # nothing to point at: the trainer's own
    assert broken.extras["traceback_lines"] == [3]  # the TypeError's line, counted in the code block
    trainer = sequence_token_advantages(group, AdvantageConfig())  # what the trainer computes as base
    base = trainer[2][len(prompt_ids)]  # the other zero-score sequence, which keeps the trainer's advantage
    extra = [a - base if m else 0.0 for a, m in zip(broken.advantages, broken.mask, strict=True)]
    assert set(round(e, 9) for e in extra) == {0.0, -env.config.traceback_penalty}
    assert all(a == 0.0 for a, m in zip(broken.advantages, broken.mask, strict=True) if not m)
    penalized = env.renderer.decode([t for t, e in zip(broken.tokens, extra, strict=True) if e < 0])
    assert "label = 'café: ' + total" in penalized  # the offending line's text, multi-byte character included
    assert "sum(values)" not in penalized and "len(values)" not in penalized and "def mean" not in penalized


def test_a_syntax_error_points_at_its_line_and_spans_cover_the_decoded_text(env) -> None:
    item = CodeItem(id="add", prompt="p", tests=["assert add(1, 2) == 3"], solution="")
    verdict = env.verdict(item, answer("def add(a, b):\n    return a +\n"))
    assert verdict.score == 0.0 and verdict.lines == [2]
    ids = sampled(env, "x = 'naïve ✓'\nprint(x)").token_ids
    spans = token_spans(env.renderer.decode, ids)
    text = env.renderer.decode(ids)
    assert spans[0][0] == 0 and spans[-1][1] == len(text) and all(a <= b for a, b in spans)
    assert all(spans[i][1] <= spans[i + 1][0] or spans[i] == spans[i + 1] for i in range(len(spans) - 1))


@pytest.mark.integration
class TestCodeExecConformance(EnvironmentConformance):
    environment_class = CodeExec
    config = {"group_size": 3, "max_tokens": 24}
