"""Atropos environments (atroposlib BaseEnv subclasses) run unchanged as one clotho environment.

    config {"env": "my_package.gsm8k_server:GSM8kEnv", "env_config": {"max_token_length": 512}, "group_size": 8}

The adapter builds the BaseEnv as Atropos's own CLI would (its config_init() defaults, then
`env_config`, then group_size, the policy's tokenizer and use_wandb=False), with one backend in
its ServerManager: ClothoServer (environments.adapters.atropos_server), an APIServer whose chat,
completion and tokens-and-logprobs calls go to clotho's policy server in token ids through the
environment's PolicyClient. The prompt ids
are the environment's own (its tokenizer and chat template, or managed_server's ids), the answer is
what vLLM sampled: its ids, logprobs and finish reasons, so managed_server keeps them exactly.

    get_item             -> BaseEnv.get_next_item (its backlog first, as Atropos does), the item kept
                            as JSON in AtroposItem.atropos (environments.atropos_format.to_json_safe)
    collect_trajectories -> BaseEnv.collect_trajectories(item) + postprocess_histories ->
                            ScoredDataGroup -> ScoredGroup (environments.atropos_format.from_atropos)

Token-exactness is checked, not assumed. The backend records every completion it returns for the
group being collected; a sequence is token-exact when each of its trained runs is, token for
token, one or more of those completions in the very context they were sampled from, with the
environment's inference_logprobs (if any) equal to the sampled ones. managed_server groups pass;
groups re-tokenized from text (chat_completion then tokenize_for_trainer) do not. Each sequence's
extras say {"token_exact": ..., "logprobs_from": "environment" | "sampler" | "rescored"}, the
group's {"token_exact": all of them}, and metrics() counts the groups that are not
({"non_token_exact_groups": n}, a column of the rollout flow's stats). Logprobs the environment
did not give are the sampler's where the run is exact, else the policy server's prompt logprobs of
the stored ids ("rescored": the served weights' logprobs of tokens nobody sampled).

Rewards: Atropos scores a whole group inside collect_trajectories (length penalties, shuffles and
filters included), so there is no per-conversation function to call again. The score Atropos gave
a sequence is kept in its conversation, in the last message's "reward" (Atropos's Message field),
and `reward` reads it back: the stored score is recoverable from the stored conversation, and a
rescore of stored data keeps it. A sequence without messages gets them decoded from its tokens
(untrained runs as user turns, trained runs as assistant turns; extras {"messages_from": "tokens"}).

What differs from running under Atropos: groups are not dropped for equal scores or length
(handle_send_to_api's filters; clotho stores every group, the trainer weighs them); a group the
environment returns None for is a recorded failure; its evaluate() is not called (clotho's
`evaluate` runs greedy groups on a fresh instance's first items). Of clotho's sampling fields,
max_tokens is the default for a request that names none and, when the config sets it, the most a
request may ask for (a turn's length, as everywhere in clotho), and temperature 0.0 makes every request
greedy (the evaluation twin); otherwise the environment's own sampling arguments apply. A reply
keeps the stop string that ended it (the ids are the sampled ones), and the environment's
tokenizer returns lists of ids from apply_chat_template as under transformers 4 (ids_as_lists).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import logging
from typing import Any

from atroposlib.envs.base import BaseEnv
from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from pydantic import Field, model_validator

from core.imports import load_attribute
from core.scored_group import InvalidGroupError, ScoredGroup
from environments.adapters.atropos_server import SAMPLED, ClothoServer
from environments.atropos_format import (
    IGNORE_INDEX,
    UNSAMPLED_LOGPROB,
    check_sequence,
    decoded_messages,
    from_atropos,
    from_json_safe,
    is_exact_json,
    to_json_safe,
    trained_runs,
)
from environments.base import DroppedByEnvironment, Environment, EnvironmentConfig, Item
from environments.chat import Messages
from inference.client import Completion, PolicyClient

# The latest items handed out, kept as the objects the environment made (the rest read back from JSON).
HELD_ITEMS = 4096

log = logging.getLogger(__name__)


class AtroposConfig(EnvironmentConfig):
    env: str = Field(
        description="The Atropos environment: 'module.path:ClassName' or 'path/to/file.py:ClassName' of an atroposlib BaseEnv subclass."
    )
    env_config: dict[str, Any] = Field(
        default_factory=dict,
        description="Fields of the environment's own config (its env_config_cls), over its config_init() defaults.",
    )

    @model_validator(mode="after")
    def _check_env(self) -> AtroposConfig:
        env_class = atropos_class(self.env)
        fields = env_class.env_config_cls.model_fields
        unknown = sorted(set(self.env_config) - set(fields))
        if unknown:
            raise ValueError(
                f"env_config: {unknown} are not fields of {env_class.env_config_cls.__name__} ({', '.join(fields)})"
            )
        return self


class AtroposItem(Item):
    atropos: Any = Field(
        default=None, description="The Atropos item as JSON (environments.atropos_format.to_json_safe)."
    )


def atropos_class(path: str) -> type[BaseEnv]:
    """The Atropos environment class at 'module.path:ClassName' or 'path/to/file.py:ClassName' (a
    file from an Atropos repository as it is, its sibling modules importable)."""
    env_class = load_attribute(path, "env")
    if not (isinstance(env_class, type) and issubclass(env_class, BaseEnv)):
        raise ValueError(f"env: {path!r} is not a subclass of atroposlib.envs.base.BaseEnv")
    return env_class


def ids_as_lists(tokenizer):
    """The tokenizer, its apply_chat_template(tokenize=True) returning a list of ids as in
    transformers 4: transformers 5 returns a BatchEncoding by default, which atroposlib 0.4.0's
    tokenize_for_trainer (and environments written for it) read as a list."""
    apply = tokenizer.apply_chat_template

    def apply_chat_template(conversation, *args, return_dict: bool = False, **kwargs):
        return apply(conversation, *args, return_dict=return_dict, **kwargs)

    tokenizer.apply_chat_template = apply_chat_template
    return tokenizer


def readable(item: Any) -> str:
    """The item for people (the UI, logs): JSON with tuples and sets as lists, cut at 500 characters."""
    return json.dumps(
        item, ensure_ascii=False, default=lambda v: list(v) if isinstance(v, (set, frozenset)) else repr(v)
    )[:500]


class Atropos(Environment):
    """Any Atropos BaseEnv, sampling from clotho's policy server; see the module docstring."""

    name = "atropos"
    config_class = AtroposConfig
    item_class = AtroposItem

    def __init__(self, config=None, *, client: PolicyClient, tokenizer: Any):
        super().__init__(config, client=client, tokenizer=tokenizer)
        env_class = atropos_class(self.config.env)
        tokenizer_path = tokenizer if isinstance(tokenizer, str) else self.tokenizer.name_or_path
        defaults, _ = env_class.config_init()  # the environment's own defaults; its servers are replaced
        env_config = type(defaults).model_validate(
            {
                **defaults.model_dump(),
                **self.config.env_config,
                "group_size": self.config.group_size,
                "tokenizer_name": tokenizer_path,
                "use_wandb": False,
            }
        )
        server = APIServerConfig(
            model_name=client.model,
            base_url=client.base_url,
            api_key=client.api_key or "",
            tokenizer_name=tokenizer_path,
            health_check=False,
        )
        served = type(
            env_class.__name__, (env_class,), {"server_cls": ClothoServer, "__module__": env_class.__module__}
        )
        self.atropos: BaseEnv = served(env_config, [server], slurm=False, testing=False)
        ids_as_lists(self.atropos.tokenizer)
        for backend in self.atropos.server.servers:
            backend.bind(
                client,
                self.atropos.tokenizer,
                default_max_tokens=self.config.max_tokens,
                greedy=self.config.temperature == 0.0,
                cap="max_tokens" in self.config.model_fields_set,
            )
        self._held: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self.context: int | None = None  # the served model's max_model_len (setup asks)
        self._handed_out = 0
        self._non_exact_groups = 0

    async def setup(self) -> None:
        await self.fit_context()
        await self.atropos.setup()

    async def fit_context(self) -> None:
        """The served model's context, asked once, for the backends' requests and the rescoring.
        An Atropos environment keeps its conversations within config.max_token_length, set for
        the model it was written for (8192 and up). Unless env_config sets it, it becomes the
        served model's context when that is shorter, as an Atropos user sets it for their model."""
        self.context = await self.client.max_model_len()
        for backend in self.atropos.server.servers:
            backend.context = self.context
        config = self.atropos.config
        if "max_token_length" not in self.config.env_config and self.context and self.context < config.max_token_length:
            log.info(
                "max_token_length %d of %s is more than the served model's context: %d",
                config.max_token_length,
                self.config.env,
                self.context,
            )
            config.max_token_length = self.context

    async def get_item(self) -> AtroposItem | None:
        backlog = self.atropos.backlog
        item = backlog.pop() if backlog else await self.atropos.get_next_item()
        if item is None:
            return None
        encoded = to_json_safe(item)
        text = json.dumps(encoded, sort_keys=True, ensure_ascii=False)
        self._handed_out += 1
        item_id = f"{hashlib.sha256(text.encode()).hexdigest()[:12]}-{self._handed_out}"
        self._held[item_id] = item
        while len(self._held) > HELD_ITEMS:
            self._held.popitem(last=False)
        return AtroposItem(id=item_id, prompt=item if isinstance(item, str) else readable(item), atropos=encoded)

    def original_item(self, item: Item) -> Any:
        if item.id in self._held:  # kept (not popped): a retried group needs it again
            return self._held[item.id]
        encoded = getattr(item, "atropos", None)
        if encoded is None or not is_exact_json(encoded):
            raise ValueError(
                f"item {item.id}: not handed out by this instance, and its Atropos item was not stored exactly"
            )
        return from_json_safe(encoded)

    async def collect_trajectories(self, item: Item) -> ScoredGroup:
        sampled: list[tuple[tuple[int, ...], Completion]] = []
        token = SAMPLED.set(sampled)
        try:
            data, backlog = await self.atropos.collect_trajectories(self.original_item(item))
            if data:
                data = await self.atropos.postprocess_histories(data)
        finally:
            SAMPLED.reset(token)
        self.atropos.backlog.extend(backlog or [])
        if isinstance(data, list):
            groups = [group for group in data if group]
            if len(groups) > 1:
                raise ValueError(
                    f"the Atropos environment returned {len(groups)} groups for one item; the adapter takes one group per item"
                )
            data = groups[0] if groups else None
        if not data:
            raise DroppedByEnvironment(
                "the Atropos environment returned no group for this item: its own filters dropped it (Atropos "
                "drops a group whose scores are all equal, for one)"
            )
        group = await self.to_group(item, dict(data), sampled)
        self._non_exact_groups += not group.extras["token_exact"]
        return group

    async def to_group(
        self, item: Item, data: dict[str, Any], sampled: list[tuple[tuple[int, ...], Completion]]
    ) -> ScoredGroup:
        """The ScoredDataGroup as a ScoredGroup, each sequence checked against what was sampled."""
        by_prompt: dict[tuple[int, ...], list[Completion]] = collections.defaultdict(list)
        for prompt_ids, completion in sampled:
            by_prompt[prompt_ids].append(completion)
        n = len(data["tokens"])
        given = data.get("inference_logprobs") or [None] * n
        env_messages = data.get("messages") or [None] * n
        overrides = data.get("overrides") or [{}] * n
        checks = [
            check_sequence(list(data["tokens"][i]), list(data["masks"][i]), given[i], by_prompt) for i in range(n)
        ]
        rescore = [i for i, check in enumerate(checks) if check.logprobs is None]
        for i in rescore:  # scored by the served model: it must fit its context, as training must
            if self.context and len(data["tokens"][i]) >= self.context:  # prompt_logprobs samples one token after it
                raise InvalidGroupError(
                    f"sequence {i}: {len(data['tokens'][i])} tokens, not less than the served model's context ({self.context}); "
                    "the environment re-tokenized its text into more tokens than were sampled: keep its conversations "
                    "shorter (env_config max_token_length) or serve a model with a longer context",
                    reason="too-large",
                )
        rescored = await asyncio.gather(*(self.client.prompt_logprobs(list(data["tokens"][i])) for i in rescore))
        for i, values in zip(rescore, rescored):
            checks[i].logprobs = [
                lp if m != IGNORE_INDEX else UNSAMPLED_LOGPROB for lp, m in zip(values, data["masks"][i])
            ]
        messages, extras = [], []
        for i, check in enumerate(checks):
            extra = {**(overrides[i] or {}), "token_exact": check.exact, "logprobs_from": check.source}
            conversation = env_messages[i]
            if conversation is None:
                runs = trained_runs(data["masks"][i])
                conversation, extra["messages_from"] = (
                    decoded_messages(self.atropos.tokenizer, data["tokens"][i], runs),
                    "tokens",
                )
            conversation = [to_json_safe(dict(message)) for message in conversation]
            conversation[-1]["reward"] = float(data["scores"][i])  # where `reward` reads the score back
            messages.append(conversation)
            extras.append(to_json_safe(extra))
        data.update(
            inference_logprobs=[check.logprobs for check in checks],
            messages=messages,
            overrides=extras,
            group_overrides=to_json_safe(dict(data.get("group_overrides") or {})),
        )
        converted = from_atropos(
            data, env=self.name, item_id=item.id, finish_reasons=[check.finish_reason for check in checks]
        )
        for sequence, check in zip(converted.sequences, checks, strict=True):
            sequence.policy_versions = check.policy_versions  # None (not covered): sample_group gives the group's range
        extras = {
            **converted.extras,
            "token_exact": all(check.exact for check in checks),
            "atropos_env": self.config.env,
        }
        return self.make_group(item, converted.sequences, extras=extras)

    def reward(self, item: Item, messages: Messages) -> float:
        recorded = messages[-1].get("reward") if messages else None
        if recorded is None:
            raise ValueError(
                "Atropos scores whole groups inside collect_trajectories; this conversation carries no score "
                "(the adapter keeps the one Atropos gave in the last message's 'reward')"
            )
        return float(recorded)

    def metrics(self) -> dict[str, float]:
        return {"non_token_exact_groups": float(self._non_exact_groups)}
