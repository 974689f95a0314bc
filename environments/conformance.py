"""The conformance checks every environment passes, against a live policy server.

Plain async functions, no test framework: `clotho env check` runs them and prints a table, and
`environments.testing.EnvironmentConformance` turns each into a pytest test. Shipped with clotho
so that an environment in a package of its own runs the same suite as the bundled ones.
"""

from __future__ import annotations

import math
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from core.scored_group import ScoredGroup, ScoredSequence
from environments.base import Environment, Item, RolloutFailure, final_answer, prompt_messages
from environments.loading import load_config
from inference.client import PolicyClient

# Answers no environment's gold answer may score below.
WRONG_ANSWERS = ("", "no idea", "-99999")

CHECKS = (
    "items load",
    "group validates",
    "policy version is stamped",
    "tokens match messages",
    "scores are the reward",
    "parquet round trip",
    "gold answer scores top",
    "evaluate is greedy",
)


@dataclass
class CheckResult:
    name: str
    status: str  # "passed", "failed" or "skipped"
    detail: str = ""
    seconds: float = 0.0


class CheckFailed(AssertionError):
    """One conformance property does not hold; the message says which and where."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def trained_segments(sequence: ScoredSequence) -> list[tuple[int, int]]:
    """[start, end) of every run of trained tokens: one per assistant turn."""
    segments, start = [], None
    for i, trained in enumerate([*sequence.mask, False]):
        if trained and start is None:
            start = i
        elif not trained and start is not None:
            segments.append((start, i))
            start = None
    return segments


class Conformance:
    """One environment instance under test and the group it sampled, shared by the checks."""

    def __init__(self, env: Environment):
        self.env = env
        self.item: Item | None = None
        self.group: ScoredGroup | None = None

    async def sampled(self) -> tuple[Item, ScoredGroup]:
        if self.group is None:
            self.item = await self.env.get_item()
            require(self.item is not None, "get_item returned None before any item")
            result = await self.env.sample_group(self.item)
            if isinstance(result, RolloutFailure):
                raise CheckFailed(
                    f"collect_trajectories failed on item {result.item_id}: {result.error}\n{result.traceback}"
                )
            self.group = result
        return self.item, self.group

    async def items_load(self) -> str:
        items = [await self.env.get_item() for _ in range(4)]
        require(
            all(isinstance(item, Item) for item in items),
            f"get_item returned {[type(i).__name__ for i in items]}; return Item objects",
        )
        require(
            len({item.id for item in items}) == 4,
            f"item ids {[item.id for item in items]} repeat; give every item a unique id",
        )
        return f"ids {items[0].id} .. {items[-1].id}"

    async def group_validates(self) -> str:
        _, group = await self.sampled()
        env = self.env
        require(group.env == env.name, f"group.env {group.env!r} != environment name {env.name!r}")
        most = env.max_group_sequences
        require(
            1 <= len(group.sequences) <= most,
            f"{len(group.sequences)} sequences; return 1..{most} ({env.group_sequences_expected()})",
        )
        group.check_limits(vocab_size=env.vocab_size, max_group_size=most, expected=env.group_sequences_expected())
        for index, sequence in enumerate(group.sequences):
            where = f"sequences[{index}]"
            require(not sequence.mask[0], f"{where}: the first token is trained; the prompt is context (mask False)")
            require(
                all(lp == 0.0 for lp, m in zip(sequence.logprobs, sequence.mask) if not m),
                f"{where}: logprobs on untrained tokens must be 0.0",
            )
            require(
                all(lp <= 0.0 for lp, m in zip(sequence.logprobs, sequence.mask) if m),
                f"{where}: a trained token's logprob is > 0; pass the sampler's logprobs",
            )
        return f"{len(group.sequences)} sequences, {group.num_tokens} tokens"

    async def policy_version_is_stamped(self) -> str:
        _, group = await self.sampled()
        served = await self.env.client.weight_version()
        require(
            group.policy_version == served,
            f"group stamped with version {group.policy_version}, the server serves {served}",
        )
        return f"version {served}"

    async def tokens_match_messages(self) -> str:
        _, group = await self.sampled()
        checked = 0
        for index, sequence in enumerate(group.sequences):
            where = f"sequences[{index}]"
            require(
                sequence.messages is not None,
                f"{where}: no messages; keep the conversation so rewards can be re-run on it",
            )
            turns = [m for m in sequence.messages if m.get("role") == "assistant"]
            segments = trained_segments(sequence)
            checked += len(segments)
            require(
                len(segments) == len(turns),
                f"{where}: {len(segments)} trained segments but {len(turns)} assistant messages",
            )
            for turn, (start, end) in enumerate(segments):
                decoded = self.env.tokenizer.decode(sequence.tokens[start:end], skip_special_tokens=True)
                require(
                    decoded == turns[turn].get("content"),
                    f"{where}: assistant turn {turn} reads {turns[turn].get('content')!r} but its tokens decode to "
                    f"{decoded!r}; store the decoded sampled tokens, never re-tokenized text",
                )
        return f"{checked} turns"

    async def scores_are_the_reward(self) -> str:
        item, group = await self.sampled()
        for index, sequence in enumerate(group.sequences):
            again = self.env.reward(item, sequence.messages or [])
            require(
                math.isclose(again, sequence.score, rel_tol=1e-9, abs_tol=1e-12),
                f"sequences[{index}]: score {sequence.score} but reward() of its messages gives {again}; score "
                "every sequence with reward(item, messages) (deterministic, nothing but the conversation)",
            )
        return f"scores {group.scores}"

    async def parquet_round_trip(self) -> str:
        import numpy as np

        from storage.schema import groups_to_table, table_to_groups
        from storage.shard_file import decode, encode

        _, group = await self.sampled()  # as a shard stores it: storage's own encoding and checks
        [restored] = table_to_groups(decode(encode(groups_to_table([group], tokenizer="conformance")), "conformance"))

        def float32(values):  # the shard schema stores logprobs and advantages as float32
            return None if values is None else np.asarray(values, np.float32).tolist()

        expected = group.model_copy(deep=True)
        for sequence in expected.sequences:
            for name in ("logprobs", "advantages", "ref_logprobs", "teacher_logprobs"):
                setattr(sequence, name, float32(getattr(sequence, name)))
        require(restored == expected, "the group read back from Parquet differs; keep extras JSON-serializable")
        return "identical"

    async def gold_answer_scores_top(self) -> str:
        item = await self.env.get_item()
        gold = self.env.gold_completion(item)
        if gold is None:
            return "skipped: no gold_completion"

        def score(answer: str) -> float:
            return self.env.reward(item, prompt_messages(item) + [{"role": "assistant", "content": answer}])

        best_wrong = max(score(wrong) for wrong in WRONG_ANSWERS)
        require(score(gold) >= best_wrong, f"gold answer {gold!r} scores {score(gold)} < {best_wrong} of a wrong one")
        require(score(gold) > score(""), f"gold answer {gold!r} scores no more than an empty answer ({score('')})")
        require(
            final_answer([{"role": "assistant", "content": gold}]) == gold,
            "final_answer must return the last assistant message",
        )
        return f"gold {score(gold)} > empty {score('')}"

    async def evaluate_is_greedy(self) -> str:
        first = await self.env.evaluate(num_items=2)
        second = await self.env.evaluate(num_items=2)
        require(first["failures"] == 0, f"evaluate recorded {first['failures']:.0f} failures")
        require(first["items"] >= 1, "evaluate saw no item: get_eval_item returned None at once")
        require(first == second, f"two greedy evaluations differ: {first} vs {second}")
        return f"{first['items']:.0f} items, mean score {first['mean_score']:.3g}"


def _method(name: str) -> str:
    return name.replace(" ", "_")


async def run_checks(
    env_class: type[Environment],
    config: dict[str, Any] | None,
    *,
    server_url: str,
    tokenizer: Any,
    api_key: str | None = None,
    only: tuple[str, ...] = CHECKS,
    on_result: Callable[[CheckResult], Awaitable[None] | None] | None = None,
) -> list[CheckResult]:
    """Runs every check in CHECKS (or `only`) on one instance; a check that raises fails with its
    message, the others still run."""
    results = []
    async with PolicyClient(server_url, api_key=api_key) as client:
        env = env_class(load_config(env_class, config), client=client, tokenizer=tokenizer)
        await env.setup()
        suite = Conformance(env)
        for name in only:
            started = time.monotonic()
            try:
                detail = await getattr(suite, _method(name))()
                status = "skipped" if detail.startswith("skipped") else "passed"
            except Exception as error:  # noqa: BLE001 - every failure is reported, not raised
                status = "failed"
                detail = (
                    str(error)
                    if isinstance(error, CheckFailed)
                    else f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=6)}"
                )
            result = CheckResult(name, status, detail, time.monotonic() - started)
            results.append(result)
            if on_result is not None:
                maybe = on_result(result)
                if maybe is not None:
                    await maybe
    return results
