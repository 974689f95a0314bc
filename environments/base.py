"""The Environment base class: items in, scored groups of token-exact rollouts out."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import random
import traceback
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, ClassVar

from core.scored_group import InvalidGroupError, Objective, ScoredGroup, ScoredSequence
from environments.chat import ChatRenderer, ChatSession, Messages, load_tokenizer
from environments.config import EnvironmentConfig, Item
from environments.failures import (
    FAILURE_REASONS,
    DroppedByEnvironment,
    GroupTimeoutError,
    InfraError,
    RolloutFailure,
    failure_reason,
)
from environments.items import ItemStream, Rows, as_item
from environments.trajectory import complete_record, version_stamp
from inference.client import (
    Completion,
    PolicyClient,
    PolicyServerAuthError,
    PolicyServerUnreachable,
    recording_completions,
)

log = logging.getLogger(__name__)

# Errors that say the run is broken, not the rollout: the caller stops or retries, never records
# them as one bad group.
RUN_ERRORS = (asyncio.CancelledError, PolicyServerUnreachable, PolicyServerAuthError)


class EnvironmentLoadError(ValueError):
    """An environment cannot be found, imported or configured; the message says the fix."""


def prompt_messages(item: Item) -> Messages:
    """The item's prompt as messages (a text prompt is one user message)."""
    if isinstance(item.prompt, str):
        return [{"role": "user", "content": item.prompt}]
    return [dict(message) for message in item.prompt]


def evaluation_report(
    scores: list[float], failures: dict[str, int] | None = None, versions: list[tuple[int, int]] | None = None
) -> dict[str, float]:
    """What `evaluate` reports: items answered, failures (in all and `failures/REASON` by reason,
    environments.failures.FAILURE_REASONS), mean score, share of scores above 0, and, given the
    answers' (first, last) policy versions, the oldest and newest that sampled them: equal when
    one version answered every item."""
    failures = failures or {}
    report = {
        "items": float(len(scores)),
        "failures": float(sum(failures.values())),
        **{f"failures/{reason}": float(count) for reason, count in sorted(failures.items())},
        "mean_score": sum(scores) / len(scores) if scores else 0.0,
        "success_rate": sum(s > 0 for s in scores) / len(scores) if scores else 0.0,
    }
    if versions:
        report["policy_version_first"] = float(min(first for first, _ in versions))
        report["policy_version_last"] = float(max(last for _, last in versions))
    return report


def final_answer(messages: Messages) -> str:
    """The content of the last assistant message ('' when the model never answered)."""
    for message in reversed(messages):
        if message.get("role") == "assistant":
            return str(message.get("content") or "")
    return ""


class Environment(ABC):
    """Subclass this: set `name` and `config_class`; write reward, and either items (a list or a
    datasets.Dataset: the base class hands them out) or new_item (items made as they are asked
    for; get_item only where they are another environment's or a remote queue's); play for a
    multi-turn conversation (the default collect_trajectories plays group_size of them), and
    collect_trajectories only when a group is not group_size conversations scored one by one (a game
    of several trained agents, a demonstration).

    The base class owns the rest: the tokenizer and chat rendering, token bookkeeping, group
    assembly and validation, the policy version every group is stamped with, and turning failures
    into recorded data.
    """

    name: ClassVar[str]
    config_class: ClassVar[type[EnvironmentConfig]] = EnvironmentConfig
    # The Item subclass get_item returns, when it has fields of its own: reprocessing rebuilds the
    # item a group was made from (stored in its extras["item"]) to re-run `reward` on it.
    item_class: ClassVar[type[Item]] = Item
    # An environment may bring its own chat template (a Jinja string) and name it for the trainer.
    chat_template: ClassVar[str | None] = None
    chat_template_name: ClassVar[str | None] = None

    def __init__(
        self,
        config: EnvironmentConfig | dict[str, Any] | None = None,
        *,
        client: PolicyClient,
        tokenizer: Any,
    ):
        self.config = config if isinstance(config, self.config_class) else self.config_class(**(config or {}))
        self.client = client
        self.tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        self.vocab_size = len(self.tokenizer)
        self._renderer: ChatRenderer | None = None
        self._item_streams: dict[str, ItemStream | None] = {}
        self._made = 0  # items new_item made
        self._twin: Environment | None = None  # evaluate's (_evaluation_twin)
        self._twin_rng_state: Any = None

    # ---- what an environment author writes -------------------------------------------------
    async def setup(self) -> None:  # noqa: B027 - optional: most environments load nothing
        """Loads data once (offline)."""

    def items(self, split: str) -> Rows | None:
        """The environment's items, when it has them as a list or a datasets.Dataset (loaded in
        setup, if need be): split "train" is what get_item hands out, in an order drawn from
        config.seed for each pass, starting over when config.cycle; "eval" is what evaluate
        scores, in order (None: evaluate draws from the train split, seeded by eval_seed). Rows are
        Items or mappings of item_class's fields; a missing id becomes "{split}-{index}".
        None (the default): the environment writes new_item (or get_item) instead."""
        return None

    def new_item(self, rng: random.Random, index: int) -> Item | dict[str, Any] | Awaitable[Item | dict[str, Any]]:
        """A new item, for an environment whose items are made rather than listed (a generator of
        problems): drawn with `rng`, the instance's random.Random seeded from config.seed (also
        `self.rng`, for a fixed pool drawn in setup), `index` counting the items made from 0. An
        Item or a mapping of item_class's fields; a missing id becomes "{seed}-{index + 1}". May be
        a coroutine (a search run off the event loop). Not written: items (or get_item) instead."""
        raise NotImplementedError

    async def get_item(self) -> Item | None:
        """The next item, or None when finite data ran out and config.cycle is False.
        Default: the next of items("train") (see items), else a new_item."""
        if (stream := self._item_stream("train")) is not None:
            return stream.next()
        if type(self).new_item is Environment.new_item:
            raise NotImplementedError(
                f"{type(self).__name__} has no items: return them from items(split) (a list of Items or a "
                "datasets.Dataset), make them in new_item(rng, index), or write get_item"
            )
        index, self._made = self._made, self._made + 1
        made = self.new_item(self.rng, index)
        made = await made if inspect.isawaitable(made) else made
        return as_item(made, self.item_class, f"{self.config.seed}-{index + 1}", f"{type(self).__name__}.new_item")

    @functools.cached_property
    def rng(self) -> random.Random:
        """The instance's random.Random, seeded from config.seed: what new_item draws with."""
        return random.Random(self.config.seed)

    def _item_stream(self, split: str) -> ItemStream | None:
        if split not in self._item_streams:  # items(split) is asked once per instance
            rows = self.items(split)
            train = split == "train"
            self._item_streams[split] = (
                None
                if rows is None
                else ItemStream(
                    rows,
                    self.item_class,
                    split=split,
                    seed=self.config.seed,
                    cycle=self.config.cycle and train,
                    shuffle=train,
                )
            )
        return self._item_streams[split]

    @abstractmethod
    def reward(self, item: Item, messages: Messages) -> float:
        """The reward of one finished conversation: the item's prompt, then every turn, the last
        assistant message being the model's final answer (`final_answer(messages)`).

        The one reward path: the default collect_trajectories and rollout_group score with it,
        the conformance suite checks every stored score against it, and reprocessing re-runs it on
        stored conversations. Deterministic for a fixed conversation.
        """

    async def play(self, item: Item) -> ChatSession:
        """One multi-turn conversation on the item, returned as the session it was played in: start
        it with `self.chat(prompt_messages(item))`, sample the policy's turns with
        `await session.sample(self.client, **self.sampling())` and add the environment's with
        `session.add_messages(...)` (masked out of training). The default collect_trajectories plays
        group_size of them concurrently and scores each with `reward` on its messages. Not written:
        the environment is single-turn."""
        raise NotImplementedError

    async def collect_trajectories(self, item: Item) -> ScoredGroup:
        """Inference and scoring together: any number of completions, one scored group.

        Default: `play`, group_size times concurrently (rollout_group), where the environment writes
        it; else single turn, group_size samples of the item's prompt in one request. Each scored by
        `reward`.
        """
        if type(self).play is not Environment.play:
            return await self.rollout_group(item, self.play)
        prompt_ids, completions = await self.sample_chat(prompt_messages(item))
        return self.make_group(item, [self.scored_completion(item, prompt_ids, c) for c in completions])

    def gold_completion(self, item: Item) -> str | None:
        """A final answer that must score top (for the conformance suite); None if there is none."""
        return None

    async def observe(self, group: ScoredGroup) -> None:  # noqa: B027 - optional: a curriculum's hook
        """Called by the rollout flow on the instance that handed out the group's item, once the
        group is stored, whichever server or worker sampled it: where a curriculum learns."""

    def metrics(self) -> dict[str, float]:
        """Numbers the rollout flow's stats artifact shows per environment, read after each group
        (e.g. a curriculum's level); their names become columns beside the flow's own stats."""
        return {}

    async def get_eval_item(self) -> Item | None:
        """A held-out item for `evaluate`. Called on the evaluation twin (see `evaluate`), whose
        item stream is seeded with config.eval_seed. Default: the next of items("eval") when the
        environment has that split, else get_item; or override it with a test split of its own."""
        stream = self._item_stream("eval")
        return stream.next() if stream is not None else await self.get_item()

    @property
    def max_group_sequences(self) -> int:
        """The most sequences one group may hold: group_size, one per rollout. An environment whose
        rollout (an episode of several trained agents) gives several sequences says how many."""
        return self.config.group_size

    def group_sequences_expected(self) -> str:
        """How max_group_sequences follows from the config, for the error that a group exceeds it."""
        return f"group_size {self.config.group_size}"

    # ---- what the framework calls ----------------------------------------------------------
    async def sample_group(
        self, item: Item, trajectories: Callable[[Item], Awaitable[ScoredGroup]] | None = None
    ) -> ScoredGroup | RolloutFailure:
        """collect_trajectories (or `trajectories`), stamped with the policy versions and the sampling parameters that
        drew it (environments.trajectory.complete_record), failures returned as data.

        The server tags every token with the version of the weights that sampled it (vLLM's weight
        version spans, inference.client): a sequence that spans a reload (in-flight, the default, lets
        a request go on across the swap, its tokens after it sampled by the newer weights with their
        own logprobs) or whose turns were sampled by different versions has both in its
        `policy_versions`. A sequence the environment built without them (from raw token lists) gets
        the range of every completion the group sampled, which holds its own. The group's
        `policy_version` is the oldest of them, the one bounded staleness counts from. From a server
        that reports no versions, the stamp is the version it announced as sampling started (read in
        parallel with it; a read before would hold every group back by a round-trip), never newer
        than the weights that sampled it.

        An unreachable or key-refusing server is not a bad rollout but a broken run: it is raised,
        so the caller (a Prefect task with retries) waits for the server or stops. A group past
        config.group_timeout_s is cut (its requests cancelled) and, like a group over
        config.max_group_tokens or one that breaks the contract, returned as a RolloutFailure
        whose `reason` says which.
        """
        version = asyncio.ensure_future(self.client.weight_version())
        limit = self.config.group_timeout_s
        try:
            async with asyncio.timeout(limit) as deadline:
                with recording_completions() as sampled:
                    group = await (trajectories or self.collect_trajectories)(item)
            if not isinstance(group, ScoredGroup):
                raise InvalidGroupError(
                    f"collect_trajectories returned {type(group).__name__}; return self.make_group(item, sequences)"
                )
            complete_record(group, sampled)
            group.check_limits(
                vocab_size=self.vocab_size,
                max_group_size=self.max_group_sequences,
                max_tokens=self.config.max_group_tokens,
                expected=self.group_sequences_expected(),
            )
        except RUN_ERRORS:
            version.cancel()
            raise
        except Exception as error:  # noqa: BLE001 - a bad rollout is data, not a crash
            version.cancel()
            if isinstance(error, TimeoutError) and deadline.expired():
                error = GroupTimeoutError(
                    f"env {self.name} item {item.id}: still running after group_timeout_s={limit:g}s, cut; make the "
                    "environment finish sooner or raise group_timeout_s (--set group_timeout_s=SECONDS)"
                )
            failure = RolloutFailure.of(self.name, item.id, error, traceback=traceback.format_exc(limit=8))
            log.warning("env %s item %s failed (%s): %s", self.name, item.id, failure.reason, failure.error)
            return failure
        group.env = self.name
        announced = await version  # errors keep their type (an unreachable server is retried)
        group.policy_version = version_stamp(group, sampled, announced)
        return group

    async def evaluate(self, num_items: int = 16) -> dict[str, float]:
        """Greedy answers (temperature 0, one per item) on up to num_items held-out items, all
        asked at once: the server batches them, so 64 items take about as long as the longest answer.

        Runs on a twin of this environment (built and set up once, at the first evaluation) whose
        item stream is seeded with config.eval_seed, so the training stream is left where it was;
        every evaluation starts that stream over, so each scores the same items. Reports what it
        saw: items answered, failures, mean score, the share of items whose answer scored above 0,
        and the policy versions that sampled the answers (evaluation_report).
        """
        twin = await self._evaluation_twin()
        items: list[Item] = []
        while len(items) < num_items and (item := await twin.get_eval_item()) is not None:
            items.append(item)
        answering = [asyncio.ensure_future(twin.sample_group(item, twin.answer_for_evaluation)) for item in items]
        try:
            results = await asyncio.gather(*answering)
        except BaseException:  # a broken run (RUN_ERRORS): the other answers are not waited for
            for task in answering:
                task.cancel()
            await asyncio.gather(*answering, return_exceptions=True)
            raise
        scores: list[float] = []
        failures: dict[str, int] = {}
        versions: list[tuple[int, int]] = []
        for result in results:
            if isinstance(result, RolloutFailure):
                failures[result.reason] = failures.get(result.reason, 0) + 1
            else:
                scores.append(result.sequences[0].score)
                versions.append(result.policy_versions or (result.policy_version, result.policy_version))
        return evaluation_report(scores, failures, versions)

    async def answer_for_evaluation(self, item: Item) -> ScoredGroup:
        """How evaluate has the policy answer an item (on the twin: greedy, one sample). Default:
        collect_trajectories. An environment whose groups are not the policy's own answers (a
        demonstration) answers with Environment.collect_trajectories, one sampled turn."""
        return await self.collect_trajectories(item)

    async def _evaluation_twin(self) -> Environment:
        if self._twin is None:
            config = self.config.model_copy(
                update={"temperature": 0.0, "group_size": 1, "seed": self.config.eval_seed, "cycle": False}
            )
            twin = type(self)(config, client=self.client, tokenizer=self.tokenizer)
            await twin.setup()
            self._twin, self._twin_rng_state = twin, twin.rng.getstate()
        twin = self._twin
        for stream in twin._item_streams.values():
            if stream is not None:
                stream.restart()
        twin._made = 0
        twin.rng.setstate(self._twin_rng_state)  # as set up: new_item draws the same items again
        return twin

    # ---- helpers the base class owns -------------------------------------------------------
    @property
    def renderer(self) -> ChatRenderer:
        if self._renderer is None:
            self._renderer = ChatRenderer(self.tokenizer, self.chat_template, self.chat_template_name)
        return self._renderer

    def sampling(self) -> dict[str, Any]:
        config = self.config
        sampling = dict(max_tokens=config.max_tokens, temperature=config.temperature, top_p=config.top_p)
        if config.min_tokens:
            sampling["min_tokens"] = min(config.min_tokens, config.max_tokens)
        return sampling

    def chat(self, messages: Messages) -> ChatSession:
        """A new multi-turn session whose prompt is rendered with the environment's template."""
        return ChatSession(self.renderer, messages)

    async def sample_chat(self, messages: Messages, n: int | None = None) -> tuple[list[int], list[Completion]]:
        """Single-turn chat: one rendered prompt, n samples from it in one request."""
        prompt_ids = self.renderer.prompt_ids(messages)
        completions = await self.client.complete(prompt_ids, n=n or self.config.group_size, **self.sampling())
        return prompt_ids, completions

    async def complete_text(self, prompt: str, n: int | None = None) -> tuple[list[int], list[Completion]]:
        """Base-model mode: plain completion of text, no chat template."""
        prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        completions = await self.client.complete(prompt_ids, n=n or self.config.group_size, **self.sampling())
        return prompt_ids, completions

    def scored_completion(self, item: Item, prompt_ids: list[int], completion: Completion) -> ScoredSequence:
        """One single-turn sample as a sequence: its exact ids and logprobs, the conversation,
        and `reward` of that conversation."""
        messages = prompt_messages(item) + [
            {"role": "assistant", "content": self.renderer.decode(completion.token_ids)}
        ]
        return ScoredSequence.from_completion(
            prompt_ids, completion, score=self.reward(item, messages), messages=messages
        )

    async def rollout_group(self, item: Item, play: Callable[[Item], Awaitable[ChatSession]]) -> ScoredGroup:
        """group_size conversations played concurrently by `play(item)`, each scored by `reward`
        on its messages; a failing one is recorded in the group's extras, not raised."""

        async def one() -> ScoredSequence:
            session = await play(item)
            return session.to_sequence(self.reward(item, session.messages), extras={"turns": session.trajectory.turns})

        sequences, errors = await self.gather_sequences([one() for _ in range(self.config.group_size)])
        return self.make_group(item, sequences, errors=errors)

    async def gather_sequences(
        self, rollouts: list[Coroutine[Any, Any, ScoredSequence]]
    ) -> tuple[list[ScoredSequence], list[str]]:
        """Runs rollouts concurrently; a failed one is recorded as an error string, not raised (a
        broken run, RUN_ERRORS, is raised; so is InfraError, which fails the whole group as `infra`:
        a group missing the rollouts the machinery failed on would be biased)."""
        results = await asyncio.gather(*rollouts, return_exceptions=True)
        sequences, errors = [], []
        for result in results:
            if isinstance(result, (*RUN_ERRORS, InfraError)):
                raise result
            if isinstance(result, BaseException):
                errors.append(f"{type(result).__name__}: {result}")
            else:
                sequences.append(result)
        return sequences, errors

    def make_group(
        self,
        item: Item,
        sequences: list[ScoredSequence],
        *,
        extras: dict[str, Any] | None = None,
        errors: list[str] | None = None,
        objective: Objective | None = None,
    ) -> ScoredGroup:
        """Assembles a group (ScoredGroup validates it on creation); `objective` says how the
        trainer learns from it when not by its shape (ScoredGroup.objective). The checks against
        the run's vocabulary and group size, and the policy version, are the framework's
        (sample_group), for every group however it was made."""
        if not sequences and not errors:
            raise InvalidGroupError(
                f"env {self.name} item {item.id}: no sequences; a group needs at least one sequence", reason="empty"
            )
        if not sequences:
            raise RuntimeError(f"env {self.name} item {item.id}: every rollout failed; first error: {errors[0]}")
        group_extras = dict(extras or {})
        if errors:
            group_extras["rollout_errors"] = errors
        # The item itself, so `clotho reprocess ... rescore` can score the stored conversations again.
        group_extras.setdefault("item", item.model_dump(mode="json"))
        return ScoredGroup(
            env=self.name,
            item_id=item.id,
            sequences=sequences,
            chat_template=self.renderer.template_name if self.chat_template else None,
            extras=group_extras,
            objective=objective,
        )


__all__ = [
    "FAILURE_REASONS",
    "DroppedByEnvironment",
    "Environment",
    "EnvironmentConfig",
    "GroupTimeoutError",
    "InvalidGroupError",
    "Item",
    "RolloutFailure",
    "evaluation_report",
    "failure_reason",
    "final_answer",
    "prompt_messages",
]
