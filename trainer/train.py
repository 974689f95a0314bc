"""The trainer loop: shards -> packed micro-batches -> DeepSpeed updates -> published checkpoints.

Reads top to bottom: setup (process group, engine, resume state, shard reader), then one optimizer
step per iteration (read groups, pack, forward/backward every micro-batch, step), a checkpoint and
resume state every `state_every` steps and at the last, then cleanup. `train` is a generator of each
step's metrics so the CLI, the Prefect flow and tests all drive the same loop.

Data parallel: rank 0 reads the step's groups and broadcasts them; every rank packs them the same
way and trains its share of the micro-batches. Losses divide by the step's global counts over the
world size, since DeepSpeed averages the ranks' gradients.
"""

from __future__ import annotations

import logging
import resource
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from storage.checkpoints import apply_retention
from storage.filesystem import is_local, resolve
from storage.layout import run_url
from storage.ledger import Ledger
from storage.progress import TrainerPosition, write_step_metrics, write_trainer_position
from storage.reader import ShardReader
from trainer.config import TrainerConfig
from trainer.data import next_step_groups
from trainer.distributed import broadcast_object, build_engine, gather_objects, init_distributed
from trainer.metrics import MetricsLog, merge_objective_metrics
from trainer.model import (
    activation_bytes,
    enable_gradient_checkpointing,
    gradient_norm,
    load_policy,
    micro_batch_loss,
    rank_micro_batches,
    wants_gradient_checkpointing,
)
from trainer.publishing import DeltaPublisher, clear_staging, publish_step
from trainer.resume_state import commit_resume_state, load_resume_state, rng_state, save_resume_state
from trainer.state_store import StateStore, StateUpload
from trainer.step import StepBatch, build_step
from trainer.stopping import StopRequested, step_in_progress, stop_if_asked
from trainer.trackers import open_trackers

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)


def default_work_dir(storage: str, run: str) -> Path:
    """Where resume state and metrics go: `{root}/{run}/trainer` when the root is a local path,
    else `.clotho/trainer/{run}` in the working directory, as an absolute path (DeepSpeed saves to
    local disks; share it between nodes)."""
    fs, path = resolve(run_url(storage, run))
    return Path(path) / "trainer" if is_local(fs) else Path.cwd() / ".clotho" / "trainer" / run


def train(
    config: TrainerConfig,
    storage: str,
    run: str,
    *,
    work_dir: Path | None = None,
    data_timeout_s: float = 600.0,
    storage_options: dict[str, Any] | None = None,
) -> Iterator[dict[str, float]]:
    """Train `config.steps` optimizer steps in total on `{storage}/{run}/rollouts`, resuming from
    `work_dir`'s state when there is one; yields each step's metrics with its "step" (on every
    rank). Closing the generator early runs the cleanup."""
    trainer = TrainingRun.start(config, storage, run, work_dir=work_dir, storage_options=storage_options)
    try:
        while trainer.step < config.steps:
            stop_if_asked()  # one asked during the last step, whose metrics went out with it
            trainer.step += 1
            waited_from = time.monotonic()
            groups, stale, rejected = trainer.read_groups(data_timeout_s)
            # From here the step is taken: a stop asked now waits for its metrics row (trainer.stopping).
            with step_in_progress():
                metrics = trainer.update(groups, stale, rejected, waited_s=time.monotonic() - waited_from)
                if trainer.step % config.save_every == 0 or trainer.step == config.steps:
                    metrics |= trainer.save()
                metrics |= trainer.settle_state(wait=False)
                trainer.record(metrics)
            yield {"step": trainer.step, **metrics}
        trainer.settle_state(wait=True)  # the last state counts before the trainer ends
    except StopRequested:
        trainer.settle_state(wait=True)  # one on its way to storage too (asked again, it stops at once)
        raise
    finally:
        trainer.close()  # the process group stays up: it belongs to the process (see trainer.cli)


class TrainingRun:
    """What one training run holds between steps, and its steps in order: read the step's groups,
    update, save (publish the weights, the resume state every state_every), record the metrics."""

    def __init__(
        self, config: TrainerConfig, storage: str, run: str, work_dir: Path, storage_options: dict[str, Any] | None
    ):
        self.config, self.storage, self.run, self.storage_options = config, storage, run, storage_options
        self.rank, self.world_size = init_distributed()
        self.work_dir, self.state_dir = work_dir, work_dir / "state"
        self.staging_dir = work_dir / "staging"  # checkpoints on their way to storage (see publish_step)
        # Since the run began: every group read (trained or skipped as stale) and every one trained,
        # in sequences too, and the seconds spent waiting for data and training.
        self.totals: dict[str, Any] = dict(
            groups_consumed=0,
            groups_trained=0,
            sequences_consumed=0,
            sequences_trained=0,
            wait_s=0.0,
            busy_s=0.0,
        )
        self.reader: ShardReader | None = None
        self.metrics_log: MetricsLog | None = None
        self.reference: torch.nn.Module | None = None
        self.state_saved_at = time.monotonic()  # state_every_minutes counts from the start or the last state
        # A fresh trainer's first publish is full.
        self.deltas = DeltaPublisher(config.publish_full_every, self.staging_dir)
        self.upload: StateUpload | None = None  # the newest resume state, on its way to the run's storage
        # Set by start(): the policy, its DeepSpeed engine, the resume state's store, the last step taken.
        self.model: PreTrainedModel
        self.engine: Any
        self.state_store: StateStore | None  # None: the resume state stays on local disk
        self.step: int

    @classmethod
    def start(
        cls,
        config: TrainerConfig,
        storage: str,
        run: str,
        *,
        work_dir: Path | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> TrainingRun:
        """Setup: the process group, the engine, the resume state, the shard reader (rank 0)."""
        self = cls(
            config,
            storage,
            run,
            Path(work_dir) if work_dir is not None else default_work_dir(storage, run),
            storage_options,
        )
        torch.manual_seed(config.seed)
        # from_pretrained returns the model in eval mode and it stays there: with dropout off, the
        # trainer's logprobs of a sequence are the sampler's whenever the weights are the same.
        self.model = load_policy(config.model, config.dtype)
        checkpointing = config.gradient_checkpointing
        if checkpointing is None:
            checkpointing = wants_gradient_checkpointing(self.model.config, config.micro_batch_tokens)
            log.info(
                "gradient checkpointing %s: a micro-batch of %d tokens keeps about %.1f GiB of activations without it",
                "on" if checkpointing else "off",
                config.micro_batch_tokens,
                activation_bytes(self.model.config, config.micro_batch_tokens) / 2**30,
            )
        if checkpointing:
            enable_gradient_checkpointing(self.model)
        self.engine = build_engine(self.model, config, self.world_size)
        if config.loss.kl_coef > 0:
            self.reference = load_policy(config.model, config.dtype).to(self.engine.device).requires_grad_(False)
        self.state_store = StateStore.for_run(storage, run, config.state_in_storage, storage_options)
        saved = load_resume_state(self.engine, self.state_dir, config.lr, self.state_store)
        self.step = saved["step"] if saved else 0
        self.policy_version = saved["policy_version"] if saved else 0  # the newest published step
        self.totals |= (saved or {}).get("totals", {})
        if self.rank == 0:
            clear_staging(self.staging_dir)
            ledger = Ledger.from_dict(saved["ledger"]) if saved else Ledger()
            self.reader = ShardReader(storage, run, ledger=ledger, storage_options=storage_options)
            trackers = open_trackers(
                config.report_to, run=run, config=config.model_dump(mode="json"), directory=self.work_dir
            )
            self.metrics_log = MetricsLog(self.work_dir, trackers)
            self.publish_position(self.step)
            log.info(
                "training %s on %s, %s from step %d to %d on %d rank(s); state in %s",
                config.model,
                self.reader.url,
                "resuming" if saved else "starting",
                self.step,
                config.steps,
                self.world_size,
                self.state_dir,
            )
        return self

    def publish_position(self, step: int, consumed_extra: int = 0) -> None:
        """Where the trainer is, for the samplers' admission (flows.admission): written after each
        read and each publish, so they can tell a pending group from a consumed one at every step."""
        position = TrainerPosition(
            steps=step,
            groups_consumed=int(self.totals["groups_consumed"] + consumed_extra),
            policy_version=self.policy_version,
            groups_per_step=self.config.groups_per_step,
            save_every=self.config.save_every,
            max_lag=self.config.max_lag,
            end_step=self.config.steps,
        )
        write_trainer_position(self.storage, self.run, position, storage_options=self.storage_options)

    def read_groups(self, data_timeout_s: float) -> tuple[list | None, list, list]:
        """Data: the next step's fresh groups, read on rank 0 (None elsewhere), with the stale and
        rejected ones consumed on the way."""
        if self.reader is None:
            return None, [], []
        rejected: list = []

        def reject(group, reason: str) -> None:
            log.warning("rejected group %s (env %s): %s", group.group_id, group.env, reason)
            rejected.append(group)

        groups, stale = next_step_groups(
            self.reader,
            self.config.groups_per_step,
            policy_version=self.policy_version,
            max_lag=self.config.max_lag,
            timeout_s=data_timeout_s,
            objective=self.config.objective,
            # Stale groups are consumed the moment they are skipped: tell the samplers.
            on_wait=lambda stale_groups: self.publish_position(self.step - 1, len(stale_groups) + len(rejected)),
            on_reject=reject,
        )
        return groups, stale, rejected

    def update(self, groups: list | None, stale: list, rejected: list, *, waited_s: float) -> dict[str, float]:
        """Every rank gets the step's groups, packs them and trains its micro-batches; one DeepSpeed
        step. Returns the step's metrics."""
        config, totals = self.config, self.totals
        skipped = stale + rejected
        skipped_counts = (len(stale), len(rejected), sum(len(g.sequences) for g in skipped))
        groups, (stale_count, rejected_count, skipped_sequences) = broadcast_object(
            (groups, skipped_counts), self.world_size
        )
        trained_sequences = sum(len(g.sequences) for g in groups)
        totals["groups_consumed"] += len(groups) + stale_count + rejected_count
        totals["groups_trained"] += len(groups)
        totals["sequences_consumed"] += trained_sequences + skipped_sequences
        totals["sequences_trained"] += trained_sequences
        if self.rank == 0:
            self.publish_position(self.step)  # at once: the samplers admit the next step's groups on it
        # Update: every micro-batch's loss is its share of the step's, gradients add up.
        started = time.monotonic()
        batch = build_step(
            groups,
            policy_version=self.policy_version,
            token_budget=config.micro_batch_tokens,
            advantage_config=config.advantages,
            default_objective=config.objective,
            token_work=6 * self.model.config.hidden_size,  # rows' length by their cost (packing.choose_row_length)
            share_prompts=config.share_prompts,
        )
        if self.reference is None and batch.needs_reference(kl=config.loss.kl_coef > 0):
            # dpo pairs without stored reference logprobs: the initial model is the reference.
            self.reference = load_policy(config.model, config.dtype).to(self.engine.device).requires_grad_(False)
        micro_metrics, grad_norm = optimizer_step(
            self.engine, batch, config, rank=self.rank, world_size=self.world_size, reference=self.reference
        )
        totals["wait_s"] += waited_s
        totals["busy_s"] += time.monotonic() - started
        metrics = step_metrics(
            batch,
            stale_count,
            gather_objects(micro_metrics, self.world_size),
            self.engine,
            grad_norm=grad_norm,
            policy_version=self.policy_version,
            step_time_s=time.monotonic() - started,
            data_wait_s=waited_s,
        )
        metrics["rejected_groups"] = float(rejected_count)
        return metrics | run_metrics(totals)

    def save(self) -> dict[str, float]:
        """Publish the weights as policy version `step`, then (when TrainerConfig.state_due says) the
        state to resume from, and apply retention. Returns what it cost."""
        config, step = self.config, self.step
        ledger_state = self.reader.ledger.to_dict() if self.reader is not None else None
        publish_started = time.monotonic()
        url = publish_step(
            self.engine,
            zero_stage=config.zero_stage,
            base_model=config.model,
            storage=self.storage,
            run=self.run,
            step=step,
            storage_options=self.storage_options,
            staging_dir=self.staging_dir,
            dtype=config.publish_dtype,
            deltas=self.deltas,
            extra={"ledger": ledger_state, "trainer_config": config.model_dump()},
        )
        costs = {"publish_s": time.monotonic() - publish_started}  # what a step pays beside its update
        self.policy_version = step
        if self.rank == 0:
            self.publish_position(step)
        due = config.state_due(step, (time.monotonic() - self.state_saved_at) / 60)
        if config.state_every_minutes is not None:  # clocks differ: rank 0's decides for every rank
            due = broadcast_object(due, self.world_size)
        if due:
            trainer_state = {"step": step, "policy_version": step, "ledger": ledger_state, "totals": self.totals}
            state_started = time.monotonic()
            costs |= self.settle_state(wait=True)  # one upload at a time
            self.upload = save_resume_state(
                self.engine,
                self.state_dir,
                step,
                trainer_state,
                gather_objects(rng_state(), self.world_size),
                self.state_store,
            )
            costs["save_state_s"] = time.monotonic() - state_started
            self.state_saved_at = time.monotonic()
        if url is not None:
            log.info("step %d: published %s", step, url)
            if config.keep_last is not None:
                apply_retention(
                    self.storage,
                    self.run,
                    keep_last=config.keep_last,
                    keep_every=config.keep_every,
                    storage_options=self.storage_options,
                )
        return costs

    def settle_state(self, wait: bool) -> dict[str, float]:
        """Commit the resume state on its way to the run's storage once every rank's copy is up
        (call on every rank at the same point); with `wait`, wait for it. Returns its upload's
        seconds when it was committed now."""
        if self.upload is None or not commit_resume_state(self.upload, wait):
            return {}
        upload, self.upload = self.upload, None
        log.info(
            "resume state of step %d in %s (%.1f s beside the steps)", upload.step, upload.store.url, upload.seconds
        )
        return {"state_upload_s": upload.seconds}

    def record(self, metrics: dict[str, float]) -> None:
        if self.metrics_log is not None:
            row = self.metrics_log.write(self.step, metrics)
            # For whoever follows the run from another host (clotho run's progress, its Prefect UI cards).
            write_step_metrics(self.storage, self.run, row, storage_options=self.storage_options)
            log.info("step %d: %s", self.step, format_metrics(metrics))

    def close(self) -> None:
        if self.metrics_log is not None:
            self.metrics_log.close()
        self.engine.destroy()


def optimizer_step(
    engine,
    batch: StepBatch,
    config: TrainerConfig,
    *,
    rank: int,
    world_size: int,
    reference: torch.nn.Module | None = None,
) -> tuple[list[dict[str, dict[str, float]]], float | None]:
    """Forward and backward this rank's micro-batches of the step, then one DeepSpeed step.

    Returns the micro-batches' loss metrics and the gradient norm before clipping (None when
    unknown). Every micro-batch loss is its share of the step's: gradients just add up.
    """
    micro_metrics = []
    for micro_batch in rank_micro_batches(batch.micro_batches, rank, world_size):
        loss, metrics = micro_batch_loss(
            engine,
            micro_batch,
            config.loss,
            objectives=batch.objectives,
            world_size=world_size,
            reference=reference,
            device=engine.device,
        )
        engine.backward(loss, scale_wrt_gas=False)
        micro_metrics.append(metrics)
    # DeepSpeed reports the gradient norm under ZeRO and bf16 only; without ZeRO one rank holds
    # the whole gradient before the step, so measure it there.
    local_norm = gradient_norm(engine.module) if world_size == 1 else None
    engine.step()
    grad_norm = engine.get_global_grad_norm()
    return micro_metrics, grad_norm if grad_norm is not None else local_norm


def step_metrics(
    batch: StepBatch,
    stale: int,
    rank_micro_metrics: Sequence[list[dict[str, dict[str, float]]]],
    engine,
    *,
    grad_norm: float | None,
    policy_version: int,
    step_time_s: float,
    data_wait_s: float,
) -> dict[str, float]:
    """One step's metrics: data stats of the whole step, loss metrics merged over every rank's
    micro-batches, optimizer state and speed. grad_norm (before clipping) is left out when unknown:
    without ZeRO on several ranks."""
    weights = {objective: share.weight for objective, share in batch.objectives.items()}
    merged = merge_objective_metrics((m for metrics in rank_micro_metrics for m in metrics), weights)
    # Each rank's loss divides by the global counts over the world size: their sum is
    # world_size times the step's loss.
    for key in [key for key in merged if key == "loss" or key.endswith("/loss")]:
        merged[key] /= len(rank_micro_metrics)
    metrics = {
        **batch.stats,
        **merged,
        "stale_groups_skipped": float(stale),
        "policy_version": float(policy_version),
        "lr": float(engine.get_lr()[0]),
        "step_time_s": step_time_s,
        "data_wait_s": data_wait_s,
        "tokens_per_s": batch.stats["tokens"] / step_time_s if step_time_s > 0 else 0.0,
        # Groups trained per second of the step's wall time, the wait for them included.
        "groups_per_s": batch.stats["groups"] / (step_time_s + data_wait_s) if step_time_s + data_wait_s > 0 else 0.0,
    }
    if grad_norm is not None:
        metrics["grad_norm"] = float(grad_norm)
    # This rank's peak resident memory so far (rank 0's in the log), what sizes micro_batch_tokens.
    metrics["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return metrics


def run_metrics(totals: dict[str, float]) -> dict[str, float]:
    """Since the run began: the share of consumed sequences trained (the rest were stale) and the
    share of the trainer's time spent waiting for data."""
    busy = totals["wait_s"] + totals["busy_s"]
    return {
        "utilization": totals["sequences_trained"] / max(totals["sequences_consumed"], 1),
        "idle_fraction": totals["wait_s"] / busy if busy > 0 else 0.0,
        "groups_consumed": float(totals["groups_consumed"]),
        "groups_trained": float(totals["groups_trained"]),
    }


def format_metrics(metrics: dict[str, float]) -> str:
    shown = (
        "loss",
        "score_mean",
        "sft/nll",
        "clip_fraction",
        "importance_weight_mean",
        "grad_norm",
        "stale_groups_skipped",
        "padding_waste",
        "tokens_per_s",
    )
    return " ".join(f"{name}={metrics[name]:.4g}" for name in shown if name in metrics)
