"""The pipeline's configuration (`clotho run CONFIG.yaml`): one run, its policy servers, its phases
(each: environments to sample, trainer steps and settings), bounded staleness and evaluation.
Imports nothing heavy, so a bad file fails in milliseconds with the field named."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from core.overrides import apply_overrides
from core.sampling import Sampling, policy_gradient_problems


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EnvironmentEntry(Strict):
    env: str = Field(description="An installed environment name (clotho env list) or 'module:Class'.")
    weight: float = Field(default=1.0, gt=0.0, description="Share of the phase's items, relative to the others.")
    config: dict[str, Any] = Field(default_factory=dict, description="The environment's config fields.")


# The dtypes the trainer can publish in (TrainerConfig.publish_dtype): the servers' one, when it is one of them.
PUBLISHABLE_DTYPES = ("float32", "bfloat16", "float16")


class ServersConfig(Strict):
    count: int = Field(default=1, ge=0, description="vLLM servers the pipeline starts on the model, each hot-reloaded.")
    urls: list[str] = Field(
        default_factory=list,
        description="Running servers to use as well (started with `clotho serve`); the pipeline reloads them too "
        "unless reload_urls is false.",
    )
    reload_urls: bool = Field(
        default=True,
        description="Reload the servers in urls from the pipeline's watcher. false: each reloads itself (`clotho serve "
        "--run RUN` on its own host), the one way for a server on another host, since a reload hands vLLM a "
        "checkpoint directory on the watcher's disk.",
    )
    dtype: str = Field(default="float32", description="Weights dtype: float32 on CPU, bfloat16 on GPUs.")
    max_model_len: int = Field(default=2048, gt=0)
    startup_timeout_s: float = Field(default=600.0, gt=0)
    reload_poll_s: float = Field(
        default=0.05,
        gt=0,
        description="Seconds between looks for a new checkpoint (one small read each; the servers' health is asked every 2 s). "
        "The loop waits for each reload, so a look's delay is paid every step.",
    )
    reload_step_timeout_s: float = Field(
        default=120.0,
        gt=0,
        description="Seconds each call of a reload (pause, reload_weights, resume, a parity request) may take; a server "
        "that does not answer twice in a row is restored or restarted (inference.reload.reload_bound_s).",
    )
    reload_mode: Literal["in-flight", "drain"] = Field(
        default="in-flight",
        description="in-flight: generation goes on across a reload (requests in flight finish on the new weights, "
        "their tokens' logprobs each the sampling weights'); drain: they finish on the old weights first.",
    )

    @model_validator(mode="after")
    def _some_server(self) -> ServersConfig:
        if self.count == 0 and not self.urls:
            raise ValueError("servers: count is 0 and no urls are given; start one (count: 1) or list running ones")
        return self


def running_means(rewards: list[float], window: int) -> list[float]:
    """The mean of each `window` evaluations in a row, from the first full window on."""
    return [sum(rewards[i - window + 1 : i + 1]) / window for i in range(window - 1, len(rewards))]


class StopRule(Strict):
    """Ends the run before its last phase has used all its steps: once the held-out reward (the
    evaluation curve) has reached `reward` and then stopped rising, i.e. `patience` evaluations in a
    row brought no new best (a new best beats the old by more than `min_delta`). With `window` > 1
    the rule reads the curve's running mean over that many evaluations, so one lucky evaluation on a
    few held-out items neither ends the run early nor one unlucky one keeps it going."""

    reward: float = Field(description="The held-out reward (the evaluation's mean score) to reach.")
    patience: int = Field(
        default=2,
        ge=1,
        description="Evaluations in a row without a new best that end the run, once `reward` is reached.",
    )
    min_delta: float = Field(default=0.0, ge=0.0, description="How much a new best must beat the old one by.")
    window: int = Field(
        default=1, ge=1, description="Evaluations in the running mean the rule reads (1: each evaluation as it is)."
    )

    def smoothed(self, rewards: list[float]) -> list[float]:
        """The running mean over `window` evaluations, from the first full window on."""
        return running_means(rewards, self.window)

    def met(self, rewards: list[float]) -> bool:
        """Whether the run ends after these evaluations (the phase's, oldest first)."""
        best, since_best = None, 0
        for reward in self.smoothed(rewards):
            if best is None or reward > best + self.min_delta + 1e-9:  # a mean's rounding is no new best
                best, since_best = reward, 0
            else:
                since_best += 1
        return best is not None and best >= self.reward and since_best >= self.patience

    def describe(self) -> str:
        measure = "held-out reward" if self.window == 1 else f"held-out reward (mean of {self.window} evaluations)"
        return f"{measure} >= {self.reward:g} reached and no new best in {self.patience} evaluations"


class Phase(Strict):
    name: str = Field(description="Shown in the curve and the logs, e.g. sft, rl.")
    steps: int = Field(gt=0, description="Trainer steps of this phase (its most, with `stop`).")
    environments: list[EnvironmentEntry] = Field(min_length=1)
    trainer: dict[str, Any] = Field(
        default_factory=dict, description="TrainerConfig fields for this phase, on top of the pipeline's `trainer`."
    )
    stop: StopRule | None = Field(
        default=None,
        description="End the run early on the evaluation curve (the last phase only; needs `evaluation`), "
        "e.g. {reward: 0.9, patience: 2}: the run takes its learning time, not a fixed step count.",
    )


class RolloutConfig(Strict):
    flows: int = Field(default=1, ge=1, description="Rollout flow runs per phase, each with its own lanes.")
    max_concurrent_groups: int = Field(default=8, ge=1, description="Lanes per rollout flow.")
    task_run_s: float = Field(default=10.0, ge=0)
    shard_max_age_s: float = Field(default=10.0, ge=0)
    deployment: str | None = Field(
        default=None,
        description="Run the rollout flows as runs of this deployment ('rollout/NAME', see prefect.yaml) on its "
        "work pool, so workers on other machines add capacity; None runs them in the pipeline's process.",
    )
    restarts: int = Field(
        default=3,
        ge=0,
        description="With a deployment: times each rollout flow run is started again after it crashed or was lost with "
        "its host (still Running, its Prefect heartbeats silent for three intervals: it is marked crashed first).",
    )


class TrainerNodesConfig(Strict):
    """The trainer on several hosts: one run of `deployment` (flows/train_node.py) per node, each on a
    work queue that only that node's worker polls, its torchrun agent meeting the others at the
    rendezvous the pipeline serves. Each node keeps its work dir on its own disk; the steps' metrics
    reach the pipeline through storage."""

    work_queues: list[str] = Field(
        min_length=1,
        description="One per node, node 0 first: the work queue of the deployment's pool whose worker runs on that "
        "node (`prefect work-queue create Q --pool POOL`, then `prefect worker start --pool POOL --work-queue Q` there).",
    )
    rendezvous: str = Field(
        description="HOST:PORT of the pipeline's host as every node reaches it: the pipeline serves the nodes' "
        "rendezvous there (torchrun's c10d store), so it outlives any node.",
        pattern=r"^[^:/\s]+:\d+$",
    )
    procs_per_node: int = Field(default=1, ge=1, description="Trainer ranks per node (its GPUs; 1 on CPU).")
    work_dir: str | None = Field(
        default=None,
        description="The trainer's work dir on each node's own disk (metrics.jsonl, TensorBoard, resume state); "
        "None: .clotho/trainer/RUN under the node worker's working directory.",
    )
    deployment: str = Field(
        default="train-node/train-node", description="The deployment of flows/train_node.py:train_node (prefect.yaml)."
    )
    start_timeout_s: float = Field(
        default=600.0, gt=0, description="How long a node's flow run may wait for its worker before the phase fails."
    )
    restarts: int = Field(
        default=3,
        ge=0,
        description="Times torchrun starts every node's ranks again after one failed (torchrun --max-restarts), "
        "and times a node's flow run lost with its host is started again on its queue; each resumes from the "
        "newest resume state in storage (state_in_storage). 0: the phase fails with the node.",
    )


class EvaluationConfig(Strict):
    env: str = Field(description="The environment whose `evaluate` (greedy, held-out items) gives the curve.")
    config: dict[str, Any] = Field(default_factory=dict)
    items: int = Field(default=32, gt=0, description="Held-out items per evaluation, answered all at once.")
    every: int = Field(
        default=5,
        gt=0,
        description="Evaluate the served version once it is this many versions past the last one evaluated "
        "(version 0 first, and the last step).",
    )


class PipelineConfig(Strict):
    run: str = Field(description="Run URL STORAGE_URL/RUN: shards, checkpoints and progress of the run.")
    model: str = Field(
        description="The initial policy: a Hugging Face model directory, a storage URL of one (s3://bucket/models/NAME: "
        "each host's parts fetch their own copy, storage.models) or a hub id where reachable."
    )
    max_lag: int = Field(
        default=1,
        ge=0,
        description="Bounded staleness k: every group is trained at most k policy versions after the one that "
        "sampled it (the trainer skips older groups, the samplers do not start them); 0 is the synchronous loop.",
    )
    phases: list[Phase] = Field(min_length=1)
    trainer: dict[str, Any] = Field(default_factory=dict, description="TrainerConfig fields for every phase.")
    servers: ServersConfig = Field(default_factory=ServersConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    evaluation: EvaluationConfig | None = None
    trainer_nodes: TrainerNodesConfig | None = Field(
        default=None,
        description="Run the trainer across hosts, one node per work queue; None runs it as one process beside the pipeline.",
    )
    data_timeout_s: float = Field(default=600.0, gt=0, description="The trainer gives up after this long without data.")

    @model_validator(mode="after")
    def _trainer_fields(self) -> PipelineConfig:
        owned = {"model", "steps", "max_lag"}
        for where, fields in [("trainer", self.trainer)] + [
            (f"phases.{p.name}.trainer", p.trainer) for p in self.phases
        ]:
            clash = owned & set(fields)
            if clash:
                raise ValueError(
                    f"{where}: {sorted(clash)} are the pipeline's (model, phases[].steps, max_lag); set them there"
                )
        return self

    @model_validator(mode="after")
    def _published_as_served(self) -> PipelineConfig:
        for index, phase in enumerate(self.phases):
            published = self.trainer_fields(phase).get("publish_dtype")
            if published is not None and self.servers.dtype in PUBLISHABLE_DTYPES and published != self.servers.dtype:
                raise ValueError(
                    f"phases.{index} trainer publish_dtype {published!r}: the servers serve {self.servers.dtype!r}, and a "
                    f"server of one dtype reloading weights published in another fails its parity check (the trainer's "
                    f"stored logprobs are of its own weights); drop publish_dtype (it follows servers.dtype)"
                )
        return self

    @model_validator(mode="after")
    def _stop_rule(self) -> PipelineConfig:
        for index, phase in enumerate(self.phases):
            if phase.stop is None:
                continue
            if index != len(self.phases) - 1:
                raise ValueError(
                    f"phases.{index}.stop: only the last phase can end the run early (the steps of a later phase "
                    "are counted from the end of the earlier ones); move the rule to the last phase"
                )
            if self.evaluation is None:
                raise ValueError(
                    f"phases.{index}.stop: the rule reads the evaluation curve; add an `evaluation` section"
                )
        return self

    @model_validator(mode="after")
    def _sampling_the_trainer_scores(self) -> PipelineConfig:
        # The trainer would skip every group of such an environment, one warning each, for as long
        # as the run lasts; say so before it starts.
        for index, phase in enumerate(self.phases):
            if self.trainer_fields(phase).get("objective", "auto") not in ("auto", "rl", "distill"):
                continue
            for number, entry in enumerate(phase.environments):
                drawn = {
                    name: entry.config[name]
                    for name in ("temperature", "top_p", "top_k", "min_p")
                    if name in entry.config
                }
                try:
                    sampling = Sampling(**drawn, logprobs_mode="processed_logprobs")
                except ValueError:
                    continue  # the environment's own config reports a bad value, with its field
                if problems := policy_gradient_problems(sampling):
                    raise ValueError(
                        f"phases.{index}.environments.{number}.config.{problems[0].removeprefix('sampling.')}"
                    )
        return self

    @property
    def total_steps(self) -> int:
        return sum(phase.steps for phase in self.phases)

    def phase_of(self, version: int) -> Phase:
        """The phase whose steps trained policy version `version` (version 0: the first)."""
        end = 0
        for phase in self.phases:
            end += phase.steps
            if version <= end:
                return phase
        return self.phases[-1]

    def trainer_fields(self, phase: Phase) -> dict[str, Any]:
        """One phase's TrainerConfig fields: the weights published in the dtype the servers serve,
        then the pipeline's trainer fields, the phase's, and the run's max_lag."""
        served = {"publish_dtype": self.servers.dtype} if self.servers.dtype in PUBLISHABLE_DTYPES else {}
        return {**served, **self.trainer, **phase.trainer, "max_lag": self.max_lag}

    def trainer_overrides(self, phase: Phase) -> list[str]:
        """The same as `--set` overrides for the phase's `clotho train`."""
        import json

        return [f"{key}={json.dumps(value)}" for key, value in self.trainer_fields(phase).items()]

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> PipelineConfig:
        loaded = yaml.safe_load(Path(path).read_text())
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: top level is {type(loaded).__name__}; write a mapping of fields")
        return cls.model_validate(apply_overrides(loaded, overrides))
