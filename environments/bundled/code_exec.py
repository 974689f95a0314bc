"""Function writing, scored by running the model's code against hidden asserts in the sandbox.

The model sees a function's signature and docstring (environments.bundled.code_tasks) and answers with the
function in a ```python block. Reward: the fraction of the item's asserts that hold. The code and
the asserts' calls of its functions run in environments.sandbox, which prints the calls' values;
the asserts themselves are evaluated outside, over those values read back as literals, so code
that reads the harness's memory or returns an object equal to everything cannot pass one. No
block, a run out of its CPU time or memory, a kill for what it did, a run that sleeps past the
wall-clock limit or never reports scores 0. A run killed at the wall-clock limit because the host
gave it no CPU (environments.sandbox: starved) is the machine's failure, not the answer's: it is
run again (environments.failures.infra_attempts), and if it starves every time the group fails
with reason `infra`, never scored. Asserts are deterministic, so the reward is.

On a failure, token-level advantages: the tokens of the candidate's lines named in its tracebacks
(each frame in candidate.py, a SyntaxError's line, the stack faulthandler dumps shortly before the
time limit) get `traceback_penalty` less than the sequence's other tokens, which keep the group's
ordinary advantage. ScoredSequence.advantages replaces the trainer's for that sequence only, so
the base is computed as the trainer computes it: set advantage_mode to its advantages.mode.
"""

from __future__ import annotations

import ast
import asyncio
import builtins
import contextlib
import json
import re
import secrets
from dataclasses import dataclass

from pydantic import Field

from core.advantages import AdvantageMode, group_advantages
from core.scored_group import ScoredGroup, ScoredSequence
from environments.base import Environment, EnvironmentConfig, Item, final_answer, prompt_messages
from environments.bundled.code_tasks import TASKS
from environments.failures import InfraError, infra_attempts
from environments.sandbox import Limits, run_python
from inference.client import Completion

_CODE_BLOCK = re.compile(r"```(?:python|py)[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)  # unclosed: cut off by max_tokens
_CANDIDATE_LINE = re.compile(r'File "candidate\.py", line (\d+)')
# The program the sandbox runs: the candidate, then each assert's calls of its functions, printed
# as reprs after a nonce. It never sees what the calls should return: the asserts are evaluated
# here, over the reprs read back as literals, so a candidate that reads the harness's memory (the
# nonce is in its caller's frame) can print values but not a pass, and an object that equals
# everything is no literal. It deletes itself first so the calls are not on disk either.
_HARNESS = """import faulthandler, json, os, traceback
os.unlink(__file__)
def main(nonce, source, calls, dump_after):
    faulthandler.dump_traceback_later(dump_after)
    namespace, values = {{"__name__": "candidate"}}, []
    try:
        exec(compile(source, "candidate.py", "exec"), namespace)
    except BaseException:
        traceback.print_exc()
    else:
        for index, test in enumerate(calls):
            try:
                values.append([repr(eval(compile(call, f"test_{{index}}.py", "eval"), dict(namespace))) for call in test])
            except BaseException:
                traceback.print_exc()
                values.append(None)
    faulthandler.cancel_dump_traceback_later()
    print(f"\\n{{nonce}} {{json.dumps(values)}}", flush=True)
main({nonce!r}, {source!r}, {calls!r}, {dump_after!r})
"""


class _CandidateCalls(ast.NodeTransformer):
    """Replaces each call of a function that is not a builtin by a name _value_N; `calls` holds
    their source in order (`sorted(f(x)) == [1]` -> `sorted(_value_0) == [1]`, calls ['f(x)'])."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def visit_Call(self, node: ast.Call) -> ast.AST:
        if isinstance(node.func, ast.Name) and not hasattr(builtins, node.func.id):
            self.calls.append(ast.unparse(node))
            return ast.Name(f"_value_{len(self.calls) - 1}", ast.Load())
        return self.generic_visit(node)


def split_assert(test: str) -> tuple[ast.Expression, list[str]]:
    """`assert EXPR` -> EXPR with the candidate's calls replaced, and those calls' source."""
    statement = ast.parse(test).body[0]
    if not isinstance(statement, ast.Assert):
        raise ValueError(f"test {test!r}: write each test as one `assert` statement")
    calls = _CandidateCalls()
    return ast.fix_missing_locations(ast.Expression(calls.visit(statement.test))), calls.calls


def assert_holds(expression: ast.Expression, values: list[str] | None) -> bool:
    """The assert over the candidate's values (reprs, read back only as literals)."""
    if values is None:
        return False
    try:
        names = {f"_value_{index}": ast.literal_eval(value) for index, value in enumerate(values)}
        return bool(eval(compile(expression, "<test>", "eval"), {"__builtins__": builtins}, names))
    except Exception:  # noqa: BLE001 - not a literal, or the assert's own expression fails on it
        return False


class CodeExecConfig(EnvironmentConfig):
    max_tokens: int = Field(default=256, ge=1, description="Most tokens sampled per answer.")
    traceback_penalty: float = Field(
        default=0.5, ge=0.0, description="Advantage taken off each token of a line a failed run's traceback names."
    )
    advantage_mode: AdvantageMode = Field(
        default="grpo", description="The trainer's advantages.mode: the base of the per-token advantages set here."
    )
    limits: Limits = Field(default_factory=Limits, description="What one scoring run may use (environments.sandbox).")


class CodeItem(Item):
    tests: list[str]
    solution: str


@dataclass(frozen=True)
class Verdict:
    score: float
    passed: int
    spans: list[tuple[int, int]]  # [start, end) in the answer's text of each line a traceback names
    lines: list[int]


def token_spans(decode, token_ids: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each token in decode(token_ids), from decoding growing prefixes of the sampled
    ids (never re-tokenizing); a token ending inside a character shares the completing token's span."""
    text, spans, start, pending = decode(token_ids), [(0, 0)] * len(token_ids), 0, []
    for index in range(len(token_ids)):
        pending.append(index)
        prefix = decode(token_ids[: index + 1])
        if text.startswith(prefix):
            for waiting in pending:
                spans[waiting] = (start, len(prefix))
            start, pending = len(prefix), []
    for waiting in pending:
        spans[waiting] = (start, len(text))
    return spans


PROMPT = (
    "Write this Python function. Answer with the whole function in one ```python code block.\n\n```python\n{stub}\n```"
)


class CodeExec(Environment):
    """A Python function task -> the share of its hidden tests the sandboxed answer passes."""

    name = "code_exec"
    config_class = CodeExecConfig
    item_class = CodeItem

    def items(self, split: str) -> list[CodeItem] | None:
        """Every task, under its own id ("train"; evaluate draws from it too, seeded by eval_seed)."""
        if split != "train":
            return None
        return [
            CodeItem(
                id=task["id"],
                prompt=[{"role": "user", "content": PROMPT.format(stub=task["stub"])}],
                tests=task["tests"],
                solution=task["solution"],
            )
            for task in TASKS
        ]

    def gold_completion(self, item: CodeItem) -> str:
        return f"```python\n{item.solution}\n```"

    def verdict(self, item: CodeItem, answer: str) -> Verdict:
        """Runs the answer's first python block with the item's asserts in the sandbox."""
        block = _CODE_BLOCK.search(answer)
        if block is None:
            return Verdict(0.0, 0, [], [])
        source, nonce, limits = block.group(1), secrets.token_hex(16), self.config.limits
        dump_after = 0.9 * min(limits.cpu_seconds, limits.wall_seconds)
        expressions, calls = zip(*map(split_assert, item.tests), strict=True)
        program = _HARNESS.format(nonce=nonce, source=source, calls=list(calls), dump_after=dump_after)
        for attempt in infra_attempts(f"code_exec item {item.id}: the sandbox"):
            with attempt:
                result = run_python(program, limits)
                if result.infra:
                    raise InfraError(
                        f"the sandbox killed the program at the wall-clock limit ({limits.wall_seconds:g} s) after "
                        f"{result.cpu_seconds:.2f} s of CPU of its {limits.cpu_seconds} s, {result.waited_seconds:.2f} s "
                        "of it waiting for a CPU: the host is loaded, not the answer wrong"
                    )
        marker, _, reported = result.stdout.rstrip("\n").rpartition("\n")[2].partition(" ")
        values = None
        if not (result.timed_out or result.killed) and marker == nonce:
            with contextlib.suppress(ValueError):
                values = json.loads(reported)
        if not isinstance(values, list) or len(values) != len(item.tests):
            values = [None] * len(item.tests)
        passed = sum(assert_holds(expression, value) for expression, value in zip(expressions, values, strict=True))
        starts, offset = [], block.start(1)
        for line in source.split("\n"):
            starts.append((offset, offset + len(line)))
            offset += len(line) + 1
        lines = sorted({n for n in map(int, _CANDIDATE_LINE.findall(result.stderr)) if 1 <= n <= len(starts)})
        return Verdict(passed / len(item.tests), passed, [starts[n - 1] for n in lines], lines)

    def reward(self, item: CodeItem, messages: list[dict]) -> float:
        return self.verdict(item, final_answer(messages)).score

    async def collect_trajectories(self, item: CodeItem) -> ScoredGroup:
        prompt_ids, completions = await self.sample_chat(prompt_messages(item))
        return await self.score_group(item, prompt_ids, completions)

    async def score_group(self, item: CodeItem, prompt_ids: list[int], completions: list[Completion]) -> ScoredGroup:
        """The group of these samples: each run in the sandbox (concurrently, in threads), and the
        tokens of a failed one's traceback lines given the extra negative advantage."""
        answers = [self.renderer.decode(completion.token_ids) for completion in completions]
        verdicts = await asyncio.gather(*(asyncio.to_thread(self.verdict, item, answer) for answer in answers))
        bases = group_advantages([v.score for v in verdicts], self.config.advantage_mode)
        sequences = []
        for completion, answer, verdict, base in zip(completions, answers, verdicts, bases, strict=True):
            advantages = None
            if verdict.score < 1.0 and verdict.spans:
                spans = token_spans(self.renderer.decode, completion.token_ids)
                flagged = [any(s < end and start < e for start, end in verdict.spans) for s, e in spans]
                advantages = [0.0] * len(prompt_ids) + [base - self.config.traceback_penalty * f for f in flagged]
            sequences.append(
                ScoredSequence.from_completion(
                    prompt_ids,
                    completion,
                    score=verdict.score,
                    messages=prompt_messages(item) + [{"role": "assistant", "content": answer}],
                    advantages=advantages,
                    extras={"tests_passed": verdict.passed, "traceback_lines": verdict.lines},
                )
            )
        return self.make_group(item, sequences)
