"""The pipeline flow (`clotho run CONFIG.yaml`): the whole asynchronous RL loop for one run.

    policy servers (vLLM) <- reload watcher <- checkpoints <- trainer <- shards <- rollout flows
           |                                                                         ^
           +-------------------- sampling (bounded staleness: flows.admission) ------+

Reads top to bottom: start the servers and the reload watcher (and the evaluator, when the config
has one); then each phase: its trainer (a process that resumes the run's state, or one flow run per
node on other hosts: flows.train_node), its rollout flows (subflows here, or runs of a deployment on
a work pool), watched until the trainer reaches the
phase's last step; then the rollouts stop (keeping every finished group) and the next phase starts
on the same run and servers. A cancel or Ctrl-C at any point stops everything the same way: no
process is left, no committed group is lost, the servers are stopped by the pipeline that started
them. The trainer's metrics and the curve reach the Prefect UI as artifacts while it runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import acreate_markdown_artifact

from core.processes import stop_process, tethered
from flows.evaluate import VersionMoved, evaluate_version, evaluated_environment
from flows.followed_runs import FollowedRun, follow
from flows.live_view import RunView
from flows.pipeline_config import Phase, PipelineConfig
from flows.pipeline_report import Curve, PipelineLog, StepLog, report_markdown
from flows.rollout import rollout
from flows.train_node import TRAINER_STOP_S, NodeRuns, trainer_arguments
from inference.client import PolicyClient
from inference.parity_guard import ParityGuard
from inference.reload import ServedPolicy
from inference.server import PolicyServer
from inference.watcher import ReloadWatcher
from storage.checkpoints import checkpoint_url, mark_best, pin_steps, read_best
from storage.footprint import run_footprint
from storage.layout import split_run_url
from storage.models import local_model
from storage.progress import clear_run_end, groups_committed, read_trainer_position, write_run_end
from tasks.api_key import resolve_api_key
from tasks.rollout import EnvSpec
from trainer.train import default_work_dir

REPO = Path(__file__).resolve().parents[1]


@flow(name="pipeline")
async def pipeline(
    config_path: str | None = None, overrides: list[str] | None = None, config: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Runs every phase of a PipelineConfig: the YAML at `config_path` (relative to the working
    directory, e.g. runs/demo.yaml) with `--set`-style `overrides`, or `config` as a dict."""
    if (config_path is None) == (config is None):
        raise ValueError("pipeline: pass config_path (a YAML file, e.g. runs/demo.yaml) or config, not both")
    config = (
        PipelineConfig.from_yaml(config_path, overrides or []) if config_path else PipelineConfig.model_validate(config)
    )
    log = get_run_logger()
    storage, run = split_run_url(config.run)
    api_key = await resolve_api_key(None)  # $CLOTHO_API_KEY (clotho run --api-key sets it)
    work_dir = default_work_dir(storage, run)
    view = await asyncio.to_thread(RunView, config, run, work_dir)  # reads storage, imports TensorBoard
    await view.open(config_path, overrides)
    # Resolved with the evaluated version when the last phase's stop rule is met.
    stop_rule_met: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    # Resolved with the reason when every server rejected a checkpoint: the run cannot go on.
    served_failed: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    async with contextlib.AsyncExitStack() as stack:
        # Servers, the reload watcher and the evaluator run for the whole pipeline.
        urls = await start_services(stack, config, api_key, view, stop_rule_met, served_failed, log)
        end_step = 0
        for phase in config.phases:
            end_step += phase.steps
            await run_phase(config, phase, end_step, urls, view, stop_rule_met, served_failed, log)
        if not stop_rule_met.done():
            # The last checkpoint is served (and evaluated) before the pipeline stops.
            await wait_until_served(urls, api_key, end_step, timeout_s=120)
            if config.evaluation is not None:
                await view.curve.wait_for(end_step, timeout_s=300)
    await view.close()
    summary = await asyncio.to_thread(run_summary, config, view, storage, run, stop_rule_met)
    await acreate_markdown_artifact(
        report_markdown(run, view.curve, summary), key=f"{view.key}-report", description=f"Pipeline run {run}"
    )
    work_dir.mkdir(parents=True, exist_ok=True)
    (work_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    log.info(
        "pipeline finished (%s): %s",
        work_dir / "summary.json",
        json.dumps({k: v for k, v in summary.items() if k not in ("curve", "completions")}),
    )
    return summary


async def start_services(
    stack: contextlib.AsyncExitStack,
    config: PipelineConfig,
    api_key: str | None,
    view: RunView,
    stop_rule_met: asyncio.Future[int],
    served_failed: asyncio.Future[str],
    log,
) -> list[str]:
    """The policy servers, the reload watcher and the evaluator, each stopped when `stack` closes;
    returns the servers' URLs (the pipeline's own first). `served_failed` gets the reason when every
    server rejected a checkpoint."""
    stack.callback(view.measured.close)
    # The model here, for what loads it here (servers, the watcher's parity check, the evaluator);
    # the trainer and rollout flows, maybe on other hosts, each fetch a model URL themselves.
    loads_here = (
        config.servers.count or (config.servers.reload_urls and config.servers.urls) or config.evaluation is not None
    )
    model = await asyncio.to_thread(local_model, config.model) if loads_here else config.model
    servers = await start_servers(config, model, api_key, log)
    stack.push_async_callback(stop_servers, servers)
    urls = [server.base_url for server in servers] + list(config.servers.urls)
    watcher = await asyncio.to_thread(reload_watcher, config, model, servers, api_key)  # loads the tokenizer
    if watcher is not None:
        stop_watching = asyncio.Event()
        stack.push_async_callback(asyncio.to_thread, watcher.discard_cache)  # after the watcher stops (in reverse)

        async def on_outcomes(outcomes) -> None:
            await view.measured.reloads(outcomes)
            blocked = watcher.blocked_by_rejection(config.max_lag)
            if blocked is not None and not served_failed.done():
                served_failed.set_result(
                    f"checkpoint {blocked[0]} was rejected by every server, which serve versions more than max_lag "
                    f"({config.max_lag}) older: the trainer would wait for ever for groups it can take ({blocked[1]}). "
                    "A parity failure means the served weights are not the trainer's: check servers.dtype, and the "
                    "servers' logs"
                )

        watching = asyncio.ensure_future(watcher.run(stop=stop_watching, on_outcomes=on_outcomes))
        stack.push_async_callback(stop_watcher, watching, stop_watching)
    else:
        log.info(
            "no reload watcher here: the servers at %s reload themselves (servers.reload_urls: false)", ", ".join(urls)
        )
    if config.evaluation is not None:
        evaluating = asyncio.ensure_future(
            evaluate_versions(
                config,
                urls[0],
                api_key,
                model,
                view.curve,
                view.measured,
                view.started,
                log,
                stop_rule_met,
                hold=watcher.hold if watcher is not None else None,
                # Its answers before the rollouts' waiting requests, where the server allows it: an
                # evaluation holds reloads while it answers.
                priority=servers[0].urgent_priority if servers else 0,
            )
        )
        stack.push_async_callback(cancel_and_wait, [evaluating])
    return urls


async def run_phase(
    config: PipelineConfig,
    phase: Phase,
    end_step: int,
    urls: list[str],
    view: RunView,
    stop_rule_met: asyncio.Future[int],
    served_failed: asyncio.Future[str],
    log,
) -> None:
    """One phase up to `end_step`: its trainer and rollout flows, watched every second, until the
    trainer ends (or the stop rule stops it); skipped when the run is already past it."""
    storage, run = split_run_url(config.run)
    position = await asyncio.to_thread(read_trainer_position, storage, run)
    if position is not None and position.steps >= end_step:
        log.info("phase %s: the run is already at step %d, past its end %d", phase.name, position.steps, end_step)
        return
    log.info("phase %s: steps up to %d on %s", phase.name, end_step, ", ".join(e.env for e in phase.environments))
    await asyncio.to_thread(
        clear_run_end, storage, run
    )  # a run its stop rule ended, resumed: its samplers sample again
    view.measured.phase(phase.name, end_step)
    trainer = await start_trainer(config, phase, end_step, default_work_dir(storage, run))
    rollouts = [
        asyncio.ensure_future(phase_rollout(config, phase, end_step, urls, config.model, index))
        for index in range(config.rollout.flows)
    ]
    try:
        while not stop_rule_met.done():
            outcome = await trainer.outcome()
            if outcome is not None:
                break
            await asyncio.sleep(1.0)
            await view.show_new_steps(phase, log)
            failed = [task for task in rollouts if task.done() and task.exception() is not None]
            if failed:
                raise RuntimeError(f"phase {phase.name}: a rollout flow failed: {failed[0].exception()}")
            if served_failed.done():
                raise RuntimeError(f"phase {phase.name}: {served_failed.result()}")
        if stop_rule_met.done():
            log.info(
                "phase %s: %s at version %d; stopping (%s)",
                phase.name,
                phase.stop.describe(),
                stop_rule_met.result(),
                view.curve.describe_best(),
            )
            await trainer.stop()  # it ends after its step in progress (trainer.stopping)
            await asyncio.to_thread(end_run_here, storage, run)
        elif outcome:
            raise RuntimeError(f"phase {phase.name}: {outcome}")
        # The rollout flows end on their own once the trainer took the phase's last groups
        # (or, stopped by the rule, those of the step it ended at).
        await asyncio.wait(rollouts, timeout=60)
        await view.show_new_steps(phase, log)
    finally:
        await trainer.stop()
        await cancel_and_wait(rollouts)
    await view.show_tables()


def run_summary(
    config: PipelineConfig, view: RunView, storage: str, run: str, stop_rule_met: asyncio.Future[int]
) -> dict[str, Any]:
    """What the pipeline returns and reports: steps, minutes, the trainer's and the servers'
    figures, the stop rule that ended it, the held-out curve with the training reward beside it."""
    summary = {"run": config.run, "steps": view.steps.last_step, "minutes": view.minutes(), **view.steps.summary()}
    summary |= view.measured.summary() | sample_utilization(storage, run, view.steps)
    if stop_rule_met.done():
        summary["stopped_by_rule"] = {"version": stop_rule_met.result(), "rule": config.phases[-1].stop.describe()}
    if view.curve.best is not None:
        summary["best"] = view.curve.best
    if view.curve.rows:
        summary["curve"] = with_training_reward(view.curve.rows, view.steps.rows)
    summary["storage"] = run_footprint(storage, run)
    if view.completions.first:  # what the model wrote at the start and at the end
        summary["completions"] = {"first": view.completions.first, "last": view.completions.latest}
    return summary


async def start_servers(config: PipelineConfig, model: str, api_key: str | None, log) -> list[PolicyServer]:
    """The pipeline's own policy servers, started at once (in parallel) on the initial model (`model`: its local directory)."""
    servers = [
        PolicyServer(
            model,
            api_key=api_key,
            dtype=config.servers.dtype,
            max_model_len=config.servers.max_model_len,
        )
        for _ in range(config.servers.count)
    ]
    try:
        await asyncio.gather(*(asyncio.to_thread(s.start, config.servers.startup_timeout_s) for s in servers))
    except BaseException:
        await stop_servers(servers)
        raise
    for server in servers:
        log.info("policy server %s up (log %s)", server.base_url, server.log_path)
    return servers


async def stop_servers(servers: list[PolicyServer]) -> None:
    """Each stopped in a thread of its own (a stop waits for the process), all at once."""
    await asyncio.gather(*(asyncio.to_thread(server.stop) for server in servers))


def end_run_here(storage: str, run: str) -> None:
    """The run ends at the stopped trainer's position: the samplers read it (flows.admission), store
    what they are sampling and end, as at a phase's last step."""
    position = read_trainer_position(storage, run)
    if position is not None:
        write_run_end(storage, run, position.steps)


def reload_watcher(
    config: PipelineConfig, model: str, servers: list[PolicyServer], api_key: str | None
) -> ReloadWatcher | None:
    """The watcher of the pipeline's own servers and of servers.urls unless they reload themselves;
    None when it would watch none. `model`: the initial model's local directory."""
    mode, timeout_s = config.servers.reload_mode, config.servers.reload_step_timeout_s
    policies = [ServedPolicy.of(server, reload_mode=mode, step_timeout_s=timeout_s) for server in servers]
    if config.servers.reload_urls:
        policies += [
            ServedPolicy(url.rstrip("/"), Path(model), api_key=api_key, reload_mode=mode, step_timeout_s=timeout_s)
            for url in config.servers.urls
        ]
    if not policies:
        return None
    guard = ParityGuard.for_model(model, dtype=config.servers.dtype)
    return ReloadWatcher(config.run, policies, guard, poll_s=config.servers.reload_poll_s)


async def start_trainer(config: PipelineConfig, phase: Phase, end_step: int, work_dir: Path) -> LocalTrainer | NodeRuns:
    """The phase's trainer, resuming the run's state: one process here, or one flow run per node
    (config.trainer_nodes)."""
    if config.trainer_nodes is not None:
        return await NodeRuns.start(config, phase, end_step)
    arguments = trainer_arguments(
        config.run, config.model, end_step, config.trainer_overrides(phase), config.data_timeout_s, work_dir
    )
    work_dir.mkdir(parents=True, exist_ok=True)
    log_path = work_dir / "trainer.log"
    environment = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # Its own process group: a Ctrl-C meant for the pipeline reaches it only through stop_process.
    with log_path.open("a") as log_file:  # the child holds its own copy
        process = subprocess.Popen(
            tethered([sys.executable, "-m", "trainer.cli", *arguments]),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=environment,
            cwd=REPO,
            start_new_session=True,
        )
    return LocalTrainer(process, log_path)


class LocalTrainer:
    """`clotho train` as a process of its own beside the pipeline (DeepSpeed owns its process)."""

    def __init__(self, process: subprocess.Popen, log_path: Path):
        self.process, self.log_path = process, log_path

    async def outcome(self) -> str | None:
        """None while it trains; "" once it ended well; else what failed."""
        code = self.process.poll()
        if code is None or code == 0:
            return None if code is None else ""
        return f"the trainer exited with {code}; see {self.log_path}"

    async def stop(self) -> None:
        """It ends after its step in progress (trainer.stopping), then SIGKILL."""
        await asyncio.to_thread(stop_process, self.process, TRAINER_STOP_S)


async def phase_rollout(
    config: PipelineConfig, phase: Phase, end_step: int, urls: list[str], tokenizer: str, index: int
) -> Any:
    """One rollout flow of a phase: a subflow here, or a run of the configured deployment (its
    worker may be on another machine; cancelling this cancels that flow run). It samples only
    groups that the phase's steps will train, and ends once the trainer took the last of them."""
    environments = [EnvSpec(import_path=e.env, weight=e.weight, config=e.config) for e in phase.environments]
    parameters = dict(
        environments=[spec.model_dump() for spec in environments],
        servers=urls[index % len(urls) :] + urls[: index % len(urls)],
        run_url=config.run,
        tokenizer=tokenizer,
        groups=None,
        max_concurrent_groups=config.rollout.max_concurrent_groups,
        shard_max_age_s=config.rollout.shard_max_age_s,
        max_lag=config.max_lag,
        seed=index,
        task_run_s=config.rollout.task_run_s,
        until_step=end_step,
    )
    name = f"{phase.name}-{index}"
    if config.rollout.deployment is None:
        return await rollout.with_options(flow_run_name=name)(**parameters)
    return await follow(FollowedRun(config.rollout.deployment, parameters, name, config.rollout.restarts))


async def cancel_and_wait(tasks: list[asyncio.Future]) -> None:
    """Cancel and wait for each to finish its cleanup (a rollout stores every finished group)."""
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(BaseException):
            await task


async def stop_watcher(watching: asyncio.Future, stop: asyncio.Event) -> None:
    """Stop the watcher between polls, never in the middle of a reload (a server left paused)."""
    stop.set()
    try:
        await asyncio.wait_for(asyncio.shield(watching), timeout=60)
    except BaseException:  # noqa: BLE001 - a timeout, a cancel or the watcher's error: it is cancelled either way
        await cancel_and_wait([watching])


async def wait_until_served(urls: list[str], api_key: str | None, version: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for url in urls:
        async with PolicyClient(url, api_key=api_key) as client:
            while await client.weight_version() < version and time.monotonic() < deadline:
                await asyncio.sleep(0.5)


def sample_utilization(storage: str, run: str, steps: StepLog) -> dict[str, float]:
    """Groups trained / groups the samplers committed, over the run (the trainer's utilization
    counts what it read; this also counts what was sampled and never read)."""
    sampled = groups_committed(storage, run)
    trained = steps.rows[-1].get("groups_trained") if steps.rows else None
    if not sampled or trained is None:
        return {}
    return {"groups_sampled": sampled, "groups_trained": trained, "sample_utilization": trained / sampled}


EVALUATOR_PIN = "evaluator"  # the pin (storage.checkpoints.pin_steps) of the step being evaluated


async def evaluate_versions(
    config: PipelineConfig,
    url: str,
    api_key: str | None,
    tokenizer: str,
    curve: Curve,
    measured: PipelineLog,
    started: float,
    log,
    stop_rule_met: asyncio.Future[int],
    hold: asyncio.Lock | None = None,
    priority: int = 0,
) -> None:
    """Greedy evaluation (the environment's `evaluate`, held-out items) of the served policy at
    version 0, then whenever it is `evaluation.every` versions past the last one evaluated, and
    at the last step: the curve, the same measure in every phase. Resolves `stop_rule_met` with
    the version at which the last phase's stop rule holds, and ends there. Each evaluated checkpoint
    that beats the best so far is marked best (checkpoints/BEST, kept by retention; curve.best).

    One version answers a whole evaluation: `hold` (the reload watcher's) keeps the servers from
    reloading while it answers, and an evaluation whose answers several versions sampled anyway (a
    server that reloads itself) is not recorded but made again at the newer version."""
    storage, run = split_run_url(config.run)
    best = await asyncio.to_thread(read_best, storage, run)  # a resumed run's, from before
    if best is not None:
        curve.best = {**best, "checkpoint": checkpoint_url(storage, run, int(best["step"]))}
    evaluation = config.evaluation
    last_step = config.total_steps
    async with PolicyClient(url, api_key=api_key, priority=priority) as client:
        env = await evaluated_environment(evaluation.env, evaluation.config, client, tokenizer)
        evaluated: int | None = None
        while evaluated != last_step:
            version = await client.weight_version()
            if evaluated is None or version >= min(evaluated + evaluation.every, last_step):
                # Pinned while it is evaluated: retention would otherwise delete, once the trainer
                # moves on, the checkpoint this evaluation may find best.
                async def pin(version: int) -> None:
                    await asyncio.to_thread(pin_steps, storage, run, EVALUATOR_PIN, {version})

                try:
                    done = await evaluate_version(env, client, evaluation.items, hold=hold, on_version=pin)
                except VersionMoved as moved:
                    log.warning("evaluation: %s (a server reloaded under it); evaluating again", moved)
                    continue
                version, report, answered_s = done.version, done.report, done.seconds
                row = curve.add(
                    config.phase_of(version).name,
                    version,
                    report["mean_score"],
                    (time.monotonic() - started) / 60,
                    items=report["items"],
                    seconds=round(answered_s, 3),
                )
                measured.evaluation(row)
                log.info(
                    "evaluation at version %d (%s): mean score %.3f over %d items, answered in %.1f s",
                    version,
                    row["phase"],
                    report["mean_score"],
                    report["items"],
                    answered_s,
                )
                evaluated = version
                if version > 0 and (curve.best is None or row["reward"] > curve.best["reward"]):
                    if await asyncio.to_thread(mark_best, storage, run, version, row["reward"]):
                        curve.best = {
                            "step": version,
                            "reward": row["reward"],
                            "checkpoint": checkpoint_url(storage, run, version),
                        }
                await asyncio.to_thread(pin_steps, storage, run, EVALUATOR_PIN, set())  # BEST keeps the best
                # The last phase's evaluations: of the versions it trained (not the one it started from).
                last_phase, last_phase_start = config.phases[-1], last_step - config.phases[-1].steps
                if last_phase.stop is not None and version > last_phase_start:
                    rewards = [r["reward"] for r in curve.rows if r["step"] > last_phase_start]
                    if last_phase.stop.met(rewards):
                        stop_rule_met.set_result(version)
                        return
            await asyncio.sleep(0.5)


def with_training_reward(curve: list[dict[str, Any]], steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The curve's rows, each with `train_reward`: the mean reward of the groups trained in the
    steps since the row before (sampled rollouts on training items; None where the steps had no
    reward, e.g. SFT's demonstrations), beside its greedy held-out `reward`."""
    rows, previous = [], -1
    for row in curve:
        scores = [
            s["score_mean"] for s in steps if previous < s["step"] <= row["step"] and s.get("score_mean") is not None
        ]
        rows.append({**row, "train_reward": sum(scores) / len(scores) if scores else None})
        previous = row["step"]
    return rows
