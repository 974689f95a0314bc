"""Rollout flow throughput vs a bare asyncio client sending the same requests, in one run.

    python bench/bench_rollout.py [--server URL] [--groups 48] [--concurrency 8]

Without --server it builds the tiny model and starts a vLLM-CPU server. Both sides send the same
requests for the same Arithmetic prompts (/weight_info, then one completion of n=group_size per
group) at the same concurrency; the order is
bare, flow, bare, flow so drift in the server's speed hits both sides alike.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")

from environments.arithmetic import Arithmetic  # noqa: E402
from flows.rollout import rollout  # noqa: E402
from inference.client import PolicyClient  # noqa: E402
from inference.server import PolicyServer  # noqa: E402
from inference.tiny_model import build_tiny_model  # noqa: E402
from tasks.rollout import EnvSpec  # noqa: E402

CONFIG = {"group_size": 8, "max_tokens": 128, "temperature": 1.0}


async def bare(url: str, tokenizer: str, groups: int, concurrency: int, score: bool = False) -> tuple[float, int]:
    """The same requests the flow sends, from one asyncio loop with a semaphore; with score=True
    the environment's whole collect_trajectories (requests, decoding, scoring, group validation)."""
    async with PolicyClient(url) as client:
        env = Arithmetic(CONFIG, client=client, tokenizer=tokenizer)
        await env.setup()
        items = [await env.get_item() for _ in range(groups)]
        limit = asyncio.Semaphore(concurrency)

        async def one(item) -> int:
            async with limit:
                if score:
                    group = await env.collect_trajectories(item)
                    return sum(s.num_trained_tokens for s in group.sequences)
                await client.weight_version()  # the environment stamps every group with it
                prompt_ids, completions = await env.sample_chat(item.prompt)
            return sum(len(c.token_ids) for c in completions)

        started = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(item) for item in items)))
        return time.perf_counter() - started, tokens


def flow_run(url: str, tokenizer: str, groups: int, concurrency: int, storage: str, run: str) -> tuple[float, int, float]:
    started = time.perf_counter()
    summary = asyncio.run(
        rollout(
            environments=[EnvSpec(import_path="environments.arithmetic:Arithmetic", config=CONFIG)],
            servers=[url], storage=storage, run=run, tokenizer=tokenizer, groups=groups,
            max_concurrent_groups=concurrency, shard_max_groups=groups,
        )  # fmt: skip
    )
    wall = time.perf_counter() - started
    trained = summary["environments"][0]["trained tokens"]
    return wall, trained, summary["totals"]["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", help="base URL of a running policy server")
    parser.add_argument("--tokenizer", help="tokenizer path (default: the tiny model)")
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=CONFIG["group_size"])
    parser.add_argument("--max-tokens", type=int, default=CONFIG["max_tokens"])
    args = parser.parse_args()
    CONFIG.update(group_size=args.group_size, max_tokens=args.max_tokens)
    workdir = Path(tempfile.mkdtemp(prefix="clotho-bench-rollout-"))
    server = None
    tokenizer = args.tokenizer
    if args.server is None:
        model = build_tiny_model(workdir / "model")
        tokenizer = tokenizer or str(model)
        server = PolicyServer(model, log_path=workdir / "vllm.log").start(timeout=600)
        url = server.base_url
    else:
        url = args.server
    try:
        storage = f"file://{workdir}/store"
        flow_run(url, tokenizer, 2, 2, storage, "warmup")  # starts the Prefect server, loads code
        asyncio.run(bare(url, tokenizer, 2, 2))
        results = {"bare": [], "flow": [], "env": []}
        for round_ in range(2):
            results["bare"].append(asyncio.run(bare(url, tokenizer, args.groups, args.concurrency)))
            results["env"].append(asyncio.run(bare(url, tokenizer, args.groups, args.concurrency, score=True)))
            wall, tokens, inner = flow_run(url, tokenizer, args.groups, args.concurrency, storage, f"bench{round_}")
            results["flow"].append((inner, tokens))
            results.setdefault("flow_wall", []).append(wall)
        bare_time = sum(t for t, _ in results["bare"])
        bare_tokens = sum(n for _, n in results["bare"])
        flow_time = sum(t for t, _ in results["flow"])
        flow_tokens = sum(n for _, n in results["flow"])
        env_time = sum(t for t, _ in results["env"])
        env_tokens = sum(n for _, n in results["env"])
        groups = 2 * args.groups
        report = {
            "groups": groups,
            "group_size": CONFIG["group_size"],
            "max_tokens": CONFIG["max_tokens"],
            "concurrency": args.concurrency,
            "bare_tokens_per_s": round(bare_tokens / bare_time, 1),
            "flow_tokens_per_s": round(flow_tokens / flow_time, 1),
            "bare_groups_per_s": round(groups / bare_time, 3),
            "flow_groups_per_s": round(groups / flow_time, 3),
            "env_tokens_per_s": round(env_tokens / env_time, 1),
            # The issue's ratio: the flow vs bare requests. Its gap holds the environments' own
            # work (decoding, scoring, validation) as well as Prefect's.
            "ratio_tokens_per_s": round((flow_tokens / flow_time) / (bare_tokens / bare_time), 3),
            # Prefect's share alone: the flow vs the same collect_trajectories calls without it.
            "ratio_vs_env_without_prefect": round((flow_tokens / flow_time) / (env_tokens / env_time), 3),
            "ratio_groups_per_s": round(bare_time / flow_time, 3),
            # Extra latency each task run adds (state API calls, thread hand-off), from the throughput
            # difference: with `concurrency` tasks in flight, each added ms costs 1/concurrency ms.
            "overhead_ms_per_task": round(1000 * (flow_time - env_time) / groups * args.concurrency, 1),
            "flow_s": round(flow_time, 2),
            "flow_wall_s_with_setup_and_artifacts": round(sum(results["flow_wall"]), 2),
            "bare_wall_s": round(bare_time, 2),
            "env_wall_s": round(env_time, 2),
        }
        print(json.dumps(report, indent=1))
    finally:
        if server:
            server.stop()


if __name__ == "__main__":
    main()
