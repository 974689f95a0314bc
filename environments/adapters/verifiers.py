"""verifiers v1 environments as clotho environments: a taskset played by a local harness, every
sequence exactly the ids and logprobs vLLM sampled.

A group is group_size episodes of one task, run by verifiers itself (`Env.run_slot`: the taskset's
own Env, else SingleAgentEnv), its model calls answered by the policy server:

    harness program (null: verifiers' chat loop) --chat completion--> verifiers' interception server
    --TrainClient renders the chat (`renderers`), POST {token_ids, sampling_params}--> verifiers_generate's
    /inference/v1/generate on loopback --prompt ids--> the policy server's /v1/completions

and each training sample of an episode is one sequence: a trainable agent's trace, each of its
trainable branches' token_ids, sampled_mask and logprobs (kept per message node as returned),
scored with trace.reward, the weighted sum of the taskset's @vf.reward functions (each in
extras["rewards"], @vf.metric values in extras["metrics"]) or what the Env recorded. An episode of
two trainable agents (self-play) gives two sequences, each naming its agent in extras["agent"]: a
group holds up to group_size x samples_per_episode sequences. A sequence's policy_versions are
those vLLM reported for the completions its sampled turns are, and its sampling those completions were
drawn with (verifiers' answer has no field for them: the route keeps the completions,
verifiers_generate.GenerateServer.completion_of), so one sampled across reloads says so.

    config {"env": {"taskset": {"id": "gsm8k-v1"}}, "group_size": 4}     an installed taskset
    config {"env": {"taskset": {"id": "my_pkg.my_taskset", "num_tasks": 8},
                    "agent": {"max_turns": 4}}}                          a module path, knobs

`env` is verifiers' own [env] block, as `vf-eval --env.*` reads it, changed so that a run stays on
this machine and offline: an agent without a harness of its taskset's own plays the null harness
(a tool-less chat loop; bash would run the model's commands on the host) on the subprocess runtime
(not a hosted sandbox). That harness's program is a PEP 723 script verifiers `uv sync`s on first
use (installing uv from astral.sh if missing); .venv-env-verifiers holds its dependencies, so
`provision_chat_program` puts the script where verifiers looks and registers this interpreter as
its environment: no uv, no download. Only vf-eval's runner pushes traces; a local runtime needs no
tunnel. verifiers 0.4 imports plugins by top-level name only: a module path is registered under its
last name (`plugin_id`).

`reward(item, messages)` is verifiers' offline re-score (what vf-replay does): the conversation is
made a trace again and the task's rewards run on it without a runtime. It agrees with the stored
score unless a reward needs the runtime or the Env records it (Env.run, Env.finalize: a game's
payoff, as upstream kuhn_poker records it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

import verifiers.v1 as vf
from pydantic import Field, TypeAdapter, field_validator
from verifiers.v1.configs.agent import agent_config_fields
from verifiers.v1.dialects.chat import message_to_wire, parse_message
from verifiers.v1.env import RunSlot
from verifiers.v1.runtimes import SubprocessConfig
from verifiers.v1.state import state_cls
from verifiers.v1.trace import AgentInfo, TraceTask

from core.scored_group import ScoredGroup, ScoredSequence, version_range
from environments.adapters.verifiers_generate import generate_server
from environments.adapters.verifiers_setup import local_env_config, provision_chat_program
from environments.base import Environment, EnvironmentConfig, Item, prompt_messages
from environments.chat import Messages
from environments.trajectory import shared_sampling
from inference.client import Completion, record_completions

MESSAGE = TypeAdapter(vf.Message)
# The loopback generate route takes no key (the policy server's key stays in this process); the
# TrainClient reads its key from this variable, which nobody sets, and sends "EMPTY".
NO_KEY_VARIABLE = "CLOTHO_VERIFIERS_UNUSED_KEY"
# Training samples an episode may give when the config does not say (samples_per_episode): an Env
# can fan one episode into several attempts of one agent, which its agents alone do not tell.
SAMPLES_PER_EPISODE = 8


class VerifiersConfig(EnvironmentConfig):
    env: dict[str, Any] = Field(
        description="verifiers' [env] block (EnvConfig) as `vf-eval --env.*` reads it: taskset.id (an installed "
        "taskset id or a module path) and the taskset's own fields, an Env id, each agent's harness, runtime and "
        "limits ('agent' on the single-agent env). Agents default to the null harness on the subprocess runtime."
    )
    samples_per_episode: int | None = Field(
        default=None,
        ge=1,
        description="Training samples one episode may give (its trainable agents' traces x their branches), each "
        "stored as a sequence of the group; None: up to 8, or one per agent the Env declares where it declares "
        "more (an Env that fans an episode into attempts, as code_golf does, or a self-play game's seats fit). "
        "A group holds up to group_size x this many sequences.",
    )
    renderer: dict[str, Any] | None = Field(
        default=None,
        description="The renderers RendererConfig the TrainClient renders chats with (e.g. {'name': 'qwen3'}); "
        "None picks it from the tokenizer's name (unknown models: the tokenizer's chat template).",
    )

    @field_validator("env")
    @classmethod
    def _resolves_in_verifiers(cls, env: dict[str, Any]) -> dict[str, Any]:
        try:
            local_env_config(env)
        except Exception as error:  # noqa: BLE001 - verifiers' own message names the field or the missing package
            raise ValueError(f"{type(error).__name__}: {error}") from None
        return env

    @field_validator("renderer")
    @classmethod
    def _is_a_renderer_config(cls, renderer: dict[str, Any] | None) -> dict[str, Any] | None:
        try:
            vf.TrainClientConfig(renderer=renderer, api_key_var=NO_KEY_VARIABLE)
        except Exception as error:  # noqa: BLE001 - verifiers' own check, whatever it raises, as a field error
            raise ValueError(f"{type(error).__name__}: {error}") from None
        return renderer


def run_sync(coroutine):
    """Runs a coroutine to its end from synchronous code, even inside a running event loop (the
    service calls `reward` from its handler)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def native_message(message: dict[str, Any]) -> vf.Message:
    """A clotho message as verifiers' typed message: its own form when the sequence kept it."""
    if "verifiers_message" in message:
        return MESSAGE.validate_python(message["verifiers_message"])
    return parse_message(message)


class RolloutFailed(RuntimeError):
    """An episode verifiers recorded as failed, or one clotho cannot store as one sequence."""


class Verifiers(Environment):
    """A verifiers v1 taskset (or Env) run by verifiers, its traces stored as scored groups."""

    name = "verifiers"
    config_class = VerifiersConfig

    async def setup(self) -> None:
        self.env_config = local_env_config(self.config.env)
        self.taskset = vf.load_taskset(self.env_config.taskset)
        self.task_type = type(self.taskset).task_type()
        self.samples = self.config.samples_per_episode or max(
            SAMPLES_PER_EPISODE, len(agent_config_fields(self.env_config))
        )
        self.epoch = 0
        self.tasks = self.epoch_tasks()
        provision_chat_program()
        self.generate = generate_server(self.client)

    def epoch_tasks(self):
        """This epoch's tasks: a finite taskset shuffled by seed and epoch, an infinite one in order."""
        return iter(self.taskset.shuffle(self.config.seed + self.epoch) if self.taskset.bounded else self.taskset)

    async def get_item(self) -> Item | None:
        task = next(self.tasks, None)
        if task is None and self.taskset.bounded and self.config.cycle:
            self.epoch += 1
            self.tasks = self.epoch_tasks()
            task = next(self.tasks, None)
        if task is None:
            return None
        data = task.data
        name = data.id if data.id is not None else str(data.idx)
        return Item(
            id=f"{name}@{self.epoch}" if self.epoch else name,
            prompt=task_prompt(data),
            extras={"task": data.model_dump(mode="json"), "task_key": task.key},
        )

    def task_of(self, item: Item) -> vf.Task:
        """The task an item was made from, rebuilt from its wire data (verifiers' own contract)."""
        data = self.task_type.data_type().model_validate(item.extras["task"])
        return self.task_type(data, self.taskset.config.task)

    def gold_completion(self, item: Item) -> str | None:
        """The task data's `answer`, the usual name of a verifiers task's reference, when it has one."""
        answer = item.extras["task"].get("answer")
        return str(answer) if isinstance(answer, str | int | float) and not isinstance(answer, bool) else None

    def model_context(self) -> vf.ModelContext:
        client = vf.TrainClientConfig(
            base_url=f"{self.generate.url}/v1",
            api_key_var=NO_KEY_VARIABLE,
            renderer=self.config.renderer,
            renderer_model_name=getattr(self.tokenizer, "name_or_path", None) or None,
        )
        return vf.ModelContext(model=self.client.model, client=client, sampling=vf.SamplingConfig(**self.sampling()))

    async def collect_trajectories(self, item: Item) -> ScoredGroup:
        task, context = self.task_of(item), self.model_context()
        # An Env per group: its serving() holds one interception server at a time, and groups of
        # one session run concurrently.
        env = vf.load_environment(self.env_config)
        run_errors = self.generate.run_errors

        async def rollout(index: int) -> list[ScoredSequence]:
            return self.sequences(await env.run_slot(RunSlot(task), context), index)

        async with env.serving():
            episodes, errors = await self.gather_sequences([rollout(index) for index in range(self.config.group_size)])
        if errors and self.generate.run_errors > run_errors:
            error = self.generate.last_run_error
            raise type(error)(str(error))
        return self.make_group(item, [sequence for episode in episodes for sequence in episode], errors=errors)

    @property
    def max_group_sequences(self) -> int:
        return self.config.group_size * self.samples

    def group_sequences_expected(self) -> str:
        return f"group_size {self.config.group_size} episodes x samples_per_episode {self.samples}"

    def sequences(self, episode: vf.Episode, index: int = 0) -> list[ScoredSequence]:
        """Every training sample of the episode (each trainable agent's trace, each of its trainable
        branches) as it was sampled, scored with its trace's reward: one sequence each, as a
        self-play game's seats are. A sample in which nothing was sampled (an agent that never
        spoke) trains nothing and is left out."""
        if not episode.ok:
            found = [*episode.errors, *(error for trace in episode.traces for error in trace.errors)]
            described = "; ".join(f"{error.type}: {error.message}" for error in found)
            raise RolloutFailed(described or "verifiers marked the episode failed")
        trainable = [trace for trace in episode.traces if trace.agent.trainable]
        samples = [(trace, branch) for trace in trainable for branch in trace.branches if branch.trainable]
        if len(samples) > self.samples:
            raise RolloutFailed(
                f"the episode gave {len(samples)} training samples (trainable traces x branches), more than "
                f"samples_per_episode {self.samples}; raise samples_per_episode (--set samples_per_episode={len(samples)})"
            )
        sequences = [self.sequence(trace, branch, index) for trace, branch in samples if any(branch.sampled_mask)]
        if not sequences:
            raise RolloutFailed(f"the episode gave no training sample with a sampled token ({len(samples)} samples)")
        return sequences

    def sequence(self, trace, branch, episode: int) -> ScoredSequence:
        """One training sample as it was sampled, scored with its trace's reward and the policy
        versions and sampling of its sampled turns."""
        last_call = branch.calls[-1] if branch.calls else None
        turns = self.branch_completions(branch)
        return ScoredSequence(
            tokens=branch.token_ids,
            mask=branch.sampled_mask,
            logprobs=branch.logprobs,
            score=trace.reward,
            finish_reason="length" if last_call is not None and last_call.finish_reason == "length" else "stop",
            policy_versions=None if None in turns else version_range(turn.policy_versions for turn in turns),
            sampling=shared_sampling(turns),
            messages=self.conversation(branch),
            extras={
                "rewards": {name: r.model_dump() for name, r in trace.rewards.items() if r is not None},
                "metrics": trace.metrics,
                "trace_id": trace.id,
                "stop_condition": trace.stop_condition,
                "turns": trace.num_turns,
                "agent": trace.agent.name,
                "episode": episode,
            },
        )

    def branch_completions(self, branch) -> list[Completion | None]:
        """The completion the generate route returned for each of the branch's sampled turns, None
        for one it did not answer. They also go to the group's record
        (inference.client.record_completions), so that the group is stamped as if the completions
        had been sampled in this process."""
        turns = []
        for node in branch.nodes:
            sampled = [token for token, trained in zip(node.token_ids, node.mask) if trained]
            if sampled:
                turns.append(self.generate.completion_of(sampled, node.logprobs))
        record_completions(turns)
        return turns

    def conversation(self, branch) -> Messages:
        """The branch as chat messages; a sampled turn's content is its sampled tokens decoded (what
        trained), verifiers' parsed message kept beside it when it reads otherwise (reasoning split
        off, tool calls), for `reward` to re-score what the rewards saw."""
        messages = []
        for node in branch.nodes:
            if not node.sampled:
                messages.append(message_to_wire(node.message))
                continue
            sampled = [token for token, trained in zip(node.token_ids, node.mask) if trained]
            message = {"role": "assistant", "content": self.tokenizer.decode(sampled, skip_special_tokens=True)}
            native = node.message.model_dump(mode="json", exclude_none=True)
            # Compared as verifiers reads the decoded text: an empty reply is content None to it.
            if native != parse_message(message).model_dump(mode="json", exclude_none=True):
                message["verifiers_message"] = native
            messages.append(message)
        return messages

    def reward(self, item: Item, messages: Messages) -> float:
        """The task's rewards re-run on the conversation (verifiers' offline re-score, no runtime)."""
        task = self.task_of(item)
        prompt_length = len(prompt_messages(item))
        nodes = [
            vf.MessageNode(
                parent=index - 1 if index else None,
                message=native_message(message),
                sampled=index >= prompt_length and message.get("role") == "assistant",
            )
            for index, message in enumerate(messages)
        ]
        trace = vf.Trace(
            task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
            state=state_cls(type(task))(),
            agent=AgentInfo(config=vf.AgentConfig(runtime=SubprocessConfig())),
            nodes=nodes,
        )
        run_sync(task.score(trace))
        return trace.reward


def task_prompt(data: vf.TaskData) -> Messages:
    """The task's opening messages as chat messages (its system prompt first)."""
    prompt = data.prompt
    messages = (
        [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [message_to_wire(m) for m in prompt or ()]
    )
    return ([{"role": "system", "content": data.system_prompt}] if data.system_prompt else []) + messages
